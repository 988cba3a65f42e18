"""The public entry points of training: `train` (one call, to the end) and `run_config` (a
config, with a user's model described in place of the config's family)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax

from resilient_jax.config import ConfigError, RunConfig, from_config_dict
from resilient_jax.data import sample_shapes
from resilient_jax.model.sharding import outside_ambient_mesh
from resilient_jax.training.loop import Trainer, TrainResult


@outside_ambient_mesh
def run_config(config: RunConfig | Mapping[str, Any], model: Any = None, *, loss_fn: Any = None,
               data: Any = None) -> RunConfig:
  """`config` (a `RunConfig`, ConfigDict or dict) as a `RunConfig`; with a user's `model`,
  checked (`check_stageable`: its loss traced and cut at its blocks) and described in place of
  the config's `model` section (whose `seq_len`, the token data's sequence length, `remat` and
  `layers`, the dotted path of its blocks when two lists could be, are kept).

  Args:
    config: the run's config.
    model: the user's `nnx.Module`, or None for the config's model family.
    loss_fn: the user's `loss_fn(model, batch)` (None: the model's own forward and loss).
    data: the user's random-access source (`data.RecordSource`), or None for `train.data`.

  Raises:
    ConfigError: a bad config, data or model that cannot be staged (one readable message).
  """
  if model is None:
    if loss_fn is not None:
      raise ConfigError("loss_fn is given without a model: pass model=your nnx.Module too")
    return config if isinstance(config, RunConfig) else from_config_dict(config)
  from resilient_jax.model.check import check_stageable, describe, token_batch

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
  if data is None:
    batch = token_batch(seq_len)
  else:
    shapes = sample_shapes(as_source(data))
    batch = {k: jax.ShapeDtypeStruct((1, *s), d) for k, (s, d) in shapes.items()}
    tokens = shapes.get("tokens", shapes.get("inputs"))
    seq_len = tokens[0][-1] if tokens is not None and tokens[0] else seq_len
  cut = check_stageable(model, num_stages=pp, batch=batch, layers=layers, loss_fn=loss_fn)
  try:
    module = getattr(config.model, "module", "") if isinstance(config, RunConfig) else \
      dict(config.get("model", {}) or {}).get("module", "")
    described = dataclasses.replace(describe(model, batch, layers, loss_fn, seq_len, cut),
                                     remat=remat, layers=layers, module=module or "")
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if isinstance(config, RunConfig):
    return dataclasses.replace(config, model=described)
  return from_config_dict(config, model=described)


def as_source(data: Any) -> Any:
  """The user's data as the runtime reads it (`data.RecordSource`).

  Raises:
    ConfigError: data that is not a random-access source of dicts of arrays.
  """
  from resilient_jax.data import RecordSource

  if isinstance(data, RecordSource):
    return data
  try:
    return RecordSource(data)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def load_code(ref: str, what: str) -> Any:
  """The object `package.module:name` names (imported from the Python path: your own code).

  Raises:
    ConfigError: the module cannot be imported or has no such name (one line).
  """
  import importlib

  module, name = ref.split(":")
  try:
    obj = importlib.import_module(module)
  except Exception as e:  # noqa: BLE001 - the user's module: its failure named, not raised
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise ConfigError(f"{what}={ref!r}: importing {module} failed: {type(e).__name__}: "
                      f"{text}") from None
  for part in name.split("."):
    if not hasattr(obj, part):
      raise ConfigError(f"{what}={ref!r}: {module} has no {name}")
    obj = getattr(obj, part)
  return obj


def user_code(cfg: RunConfig) -> tuple[Any, Any, Any]:
  """The model, loss and data a config names as code (`model.module`, `train.loss_fn`,
  `train.data` as `package.module:name`), built: `(model or None, loss_fn or None, data or
  None)`. `model.module` names a function returning the model (called with `seed=train.seed`
  when it takes a `seed`); `train.data` a source, or a function of no arguments returning one.

  Raises:
    ConfigError: what cannot be imported, called or used (one line).
  """
  import inspect

  from resilient_jax.config import is_code_ref

  model = loss_fn = data = None
  ref = getattr(cfg.model, "module", "")
  if ref:
    build = load_code(ref, "model.module")
    try:
      takes_seed = "seed" in inspect.signature(build).parameters
      model = build(seed=cfg.train.seed) if takes_seed else build()
    except Exception as e:  # noqa: BLE001
      text = str(e).strip().splitlines()[0] if str(e).strip() else ""
      raise ConfigError(f"model.module={ref!r}: building the model failed: "
                        f"{type(e).__name__}: {text}") from None
  if cfg.train.loss_fn:
    loss_fn = load_code(cfg.train.loss_fn, "train.loss_fn")
    if not callable(loss_fn):
      raise ConfigError(f"train.loss_fn={cfg.train.loss_fn!r} is not a function")
  if is_code_ref(cfg.train.data):
    data = load_code(cfg.train.data, "train.data")
    if callable(data) and not hasattr(data, "__getitem__"):
      data = data()
  return model, loss_fn, data


def train(config: RunConfig | Mapping[str, Any], workdir: str | os.PathLike, *,
          model: Any = None, loss_fn: Any = None, data: Any = None, **kwargs) -> TrainResult:
  """Trains to the end; see `Trainer` for the other keyword arguments.

  Args:
    config: the run's config: a `RunConfig`, or the launcher's keys as a ConfigDict or dict.
    workdir: where outputs go; a workdir holding checkpoints is resumed from.
    model: your own `nnx.Module` in place of the config's model family; its current
      parameters are the initial ones.
    loss_fn: your `loss_fn(model, batch)`: a scalar mean loss, per-example losses, or
      `(per-example losses, weights)` (see `model.cut.loss_terms`); None: the model's own
      forward on `batch["tokens"]` against `batch["targets"]`.
    data: your random-access source (`len(data)`, `data[i]` a dict of arrays: a grain
      `MapDataset`, a list of dicts, or a dict of arrays with a leading samples axis) in place
      of `train.data`.

  With `distributed.enabled` this process joins the `jax.distributed` job (before JAX starts
  its backends) unless a `cluster` is given, and trains its share of it.
  """
  if model is None and loss_fn is None and data is None:
    named = config if isinstance(config, RunConfig) else from_config_dict(config)
    model, loss_fn, data = user_code(named)
  source = None if data is None else as_source(data)
  cfg = run_config(config, model, loss_fn=loss_fn, data=source)
  if cfg.distributed.enabled and kwargs.get("cluster") is None:
    from resilient_jax.runtime.cluster import Cluster

    kwargs["cluster"] = Cluster(cfg.distributed)
  return Trainer(cfg, workdir, model=model, loss_fn=loss_fn, data=source, **kwargs).run()
