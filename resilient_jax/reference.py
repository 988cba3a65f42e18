"""Single-device training of the same model and data: the reference the pipeline must match.

Deliberately shares nothing with the pipeline path but the model definition, the data and the
optimizer: the plain fused `jax.value_and_grad` of the whole model on the whole global batch, no
stages, taps, schedules or collectives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from resilient_jax.config import RunConfig
from resilient_jax.model.blocks import _Marked, blocks_at, layers_path, swap_blocks
from resilient_jax.model.cut import default_loss_fn, loss_terms
from resilient_jax.model.sharding import layout_requests_dropped, outside_ambient_mesh
from resilient_jax.model.staging import Binder, flat_params, variable_names
from resilient_jax.programs.compiled import OnEachDevice
from resilient_jax.recipe import (
  eval_data,
  make_data,
  make_model,
  reference_optimizer,
  sample_seeds,
  step_data,
)


def mean_loss_fn(model: Any, cfg: RunConfig, loss_fn: Any = None):
  """`(params by name, batch, seeds) -> the batch's mean loss` of `loss_fn(model, batch)` (the
  model's own loss when None) on one device, as docs/own_model.md's randomness rule says a
  user's own loop computes it: with RNG streams, sample `i` of step `t` runs alone, every
  stream's key folded with `(t, i)` and its count reset; the mean is over every loss element
  (weighted where the loss returns weights)."""
  loss_fn = loss_fn or default_loss_fn(model)
  remat = cfg.model.remat
  bind = Binder(model, variable_names(model))

  def call(m: Any, batch: Any) -> Any:
    if remat != "none":  # the same blocks rematerialised, as the pipeline runs them
      path = layers_path(m, getattr(cfg.model, "layers", ""))
      swap_blocks(m, path, [_Marked(b, i, remat, False, mark=False)
                            for i, b in enumerate(blocks_at(m, path))])
    return loss_terms(loss_fn(m, batch))

  def mean(p: dict, batch: dict, seeds: Any) -> Any:
    with layout_requests_dropped():  # one device: a layout request means nothing
      losses, weights = bind.run(p, call, (batch,), seeds if bind.uses_rng else None)
    if weights is None:
      return losses.mean()
    return (losses * weights).sum() / weights.sum()

  return mean


@outside_ambient_mesh
def train_reference(
  cfg: RunConfig, steps: int | None = None, model: Any = None, loss_fn: Any = None,
  data: Any = None,
) -> tuple[list[float], dict]:
  """Trains on one device; returns per-step losses and the final flat parameters (numpy).

  Args:
    cfg: the run's config (`run_config(config, model)` for a user's model).
    steps: how many steps (default: `train.steps`).
    model: a user's model (left unchanged); None builds the config's model family.
    loss_fn, data: the user's loss and data (`train`'s), None for the model's and the config's.
  """
  model = make_model(cfg) if model is None else model
  names = variable_names(model)
  params = flat_params(model, names)
  mean_loss = mean_loss_fn(model, cfg, loss_fn)
  optimizer = reference_optimizer(cfg)
  opt_state = optimizer.init(params)
  source, plan = make_data(cfg, data)

  def train_step(p, o, batch, seeds):
    loss, grads = jax.value_and_grad(mean_loss)(p, batch, seeds)
    updates, o = optimizer.update(grads, o, p)
    return jax.tree.map(lambda a, u: a + u, p, updates), o, loss

  # On one device, committed, so the compiled step is the library's cached program.
  device = jax.local_devices()[0]
  step = OnEachDevice(train_step)
  params, opt_state = jax.device_put((params, opt_state), device)

  losses = []
  for t in range(1, (steps or cfg.train.steps) + 1):
    ids, batch = step_data(cfg, source, plan, t)
    seeds = sample_seeds(t, ids).reshape(-1, 2)
    batch = {k: v.reshape(-1, *v.shape[2:]) for k, v in batch.items()}
    params, opt_state, loss = step(params, opt_state, *jax.device_put((batch, seeds), device))
    losses.append(float(loss))
  return losses, {k: np.asarray(v) for k, v in params.items()}


@outside_ambient_mesh
def eval_reference(cfg: RunConfig, params: Mapping[str, Any], model: Any = None,
                   loss_fn: Any = None, data: Any = None) -> float:
  """The held-out loss of flat parameters `params` (by global name) on one device: the mean
  loss over every held-out sample of an evaluation (`data.held_out`) in one batch, the number
  the pipelined evaluation (`training/evaluation.py`) must match.

  Args:
    cfg: the run's config (with `train.eval_every` set).
    params: every parameter, e.g. `Interpreter.all_params()` or `train_reference`'s.
    model: a user's model (its structure only); None builds the config's model family.
    loss_fn, data: the user's loss and data, as `train_reference`'s.
  """
  model = make_model(cfg) if model is None else model
  source, _ = make_data(cfg, data)
  parts = [eval_data(cfg, source, b, 1) for b in range(cfg.train.eval_batches)]
  ids = np.concatenate([i.reshape(-1) for i, _ in parts])
  batch = {k: np.concatenate([b[k].reshape(-1, *b[k].shape[2:]) for _, b in parts])
           for k in parts[0][1]}
  # One device, committed, so the compiled program is the library's cached one.
  mean_loss = OnEachDevice(mean_loss_fn(model, cfg, loss_fn))
  device = jax.local_devices()[0]
  return float(mean_loss(*jax.device_put((dict(params), batch, sample_seeds(0, ids)), device)))
