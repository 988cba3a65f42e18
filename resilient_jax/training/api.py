"""The public entry points of training: `train` (one call, to the end) and `run_config` (a
config, with a user's model described in place of the config's family)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from resilient_jax.config import ConfigError, RunConfig, from_config_dict
from resilient_jax.model.sharding import outside_ambient_mesh
from resilient_jax.training.loop import Trainer, TrainResult


@outside_ambient_mesh
def run_config(config: RunConfig | Mapping[str, Any], model: Any = None) -> RunConfig:
  """`config` (a `RunConfig`, ConfigDict or dict) as a `RunConfig`; with a user's `model`,
  checked (`check_stageable`: its own forward, cut at its blocks) and described in place of
  the config's `model` section (whose `seq_len`, the data's sequence length, `remat` and
  `layers`, the dotted path of its blocks when two lists could be, are kept).

  Raises:
    ConfigError: a bad config or a model that cannot be staged (one readable message).
  """
  if model is None:
    return config if isinstance(config, RunConfig) else from_config_dict(config)
  from resilient_jax.model.check import check_stageable, describe

  if isinstance(config, RunConfig):
    seq_len, pp, remat = config.model.seq_len, config.mesh.pp, config.model.remat
    layers = getattr(config.model, "layers", "")
  else:
    section = dict(config.get("model", {}) or {})
    seq_len, remat = section.get("seq_len", 32), section.get("remat", "none")
    layers = section.get("layers", "")
    pp = dict(config.get("mesh", {}) or {}).get("pp", 1)
  if not isinstance(layers, str):
    raise ConfigError(f"model.layers={layers!r} is not a dotted path such as \"layers\"")
  check_stageable(model, num_stages=pp, seq_len=seq_len, layers=layers)
  try:
    described = dataclasses.replace(describe(model, seq_len, layers), remat=remat, layers=layers)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if isinstance(config, RunConfig):
    return dataclasses.replace(config, model=described)
  return from_config_dict(config, model=described)


def train(config: RunConfig | Mapping[str, Any], workdir: str | os.PathLike, *,
          model: Any = None, **kwargs) -> TrainResult:
  """Trains to the end; see `Trainer` for the keyword arguments.

  Args:
    config: the run's config: a `RunConfig`, or the launcher's keys as a ConfigDict or dict.
    workdir: where outputs go; a workdir holding checkpoints is resumed from.
    model: your own `nnx.Module` (its `__call__(tokens)`, cut at its list of blocks; see
      `resilient_jax.model.forward`) in place of the config's model family; its current
      parameters are the initial ones.

  With `distributed.enabled` this process joins the `jax.distributed` job (before JAX starts
  its backends) unless a `cluster` is given, and trains its share of it.
  """
  cfg = run_config(config, model)
  if cfg.distributed.enabled and kwargs.get("cluster") is None:
    from resilient_jax.runtime.cluster import Cluster

    kwargs["cluster"] = Cluster(cfg.distributed)
  return Trainer(cfg, workdir, model=model, **kwargs).run()
