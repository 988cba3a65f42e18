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
from resilient_jax.model.forward import ModelCut
from resilient_jax.model.sharding import outside_ambient_mesh
from resilient_jax.model.staging import (
  Binder,
  flat_params,
  loss_terms,
  variable_names,
  weighted_mean,
)
from resilient_jax.programs.compiled import OnEachDevice
from resilient_jax.recipe import (
  eval_batch,
  make_data,
  make_model,
  reference_optimizer,
  sample_seeds,
  step_batch,
)


@outside_ambient_mesh
def train_reference(
  cfg: RunConfig, steps: int | None = None, model: Any = None
) -> tuple[list[float], dict]:
  """Trains on one device; returns per-step losses and the final flat parameters (numpy).

  Args:
    cfg: the run's config (`run_config(config, model)` for a user's model).
    steps: how many steps (default: `train.steps`).
    model: a user's model (left unchanged); None builds the config's model family.
  """
  model = make_model(cfg) if model is None else model
  names = variable_names(model)
  stage = _whole(model, cfg)
  bind = Binder(model, names)
  params = flat_params(model, names)
  terms = loss_terms(model)
  optimizer = reference_optimizer(cfg)
  opt_state = optimizer.init(params)
  source, plan = make_data(cfg)

  def mean_loss(p, x, y, seeds):
    return weighted_mean(terms(bind.run(p, stage, (None, x), seeds), y, x))

  def train_step(p, o, x, y, seeds):
    loss, grads = jax.value_and_grad(mean_loss)(p, x, y, seeds)
    updates, o = optimizer.update(grads, o, p)
    return jax.tree.map(lambda a, u: a + u, p, updates), o, loss

  # On one device, committed, so the compiled step is the library's cached program.
  device = jax.local_devices()[0]
  step = OnEachDevice(train_step)
  params, opt_state = jax.device_put((params, opt_state), device)

  losses = []
  for t in range(1, (steps or cfg.train.steps) + 1):
    ids, inputs, targets = step_batch(cfg, source, plan, t)
    seeds = sample_seeds(t, ids).reshape(-1, 2)
    x = inputs.reshape(-1, inputs.shape[-1])
    y = targets.reshape(-1, targets.shape[-1])
    params, opt_state, loss = step(params, opt_state, *jax.device_put((x, y, seeds), device))
    losses.append(float(loss))
  return losses, {k: np.asarray(v) for k, v in params.items()}


@outside_ambient_mesh
def eval_reference(cfg: RunConfig, params: Mapping[str, Any], model: Any = None) -> float:
  """The held-out loss of flat parameters `params` (by global name) on one device: the mean
  per-token loss over every held-out sample of an evaluation (`data.held_out`) in one batch,
  the number the pipelined evaluation (`training/evaluation.py`) must match.

  Args:
    cfg: the run's config (with `train.eval_every` set).
    params: every parameter, e.g. `Interpreter.all_params()` or `train_reference`'s.
    model: a user's model (its structure only); None builds the config's model family.
  """
  model = make_model(cfg) if model is None else model
  stage = _whole(model, cfg)
  bind = Binder(model, variable_names(model))
  terms = loss_terms(model)
  source, _ = make_data(cfg)
  batches = [eval_batch(cfg, source, b, 1) for b in range(cfg.train.eval_batches)]
  ids, x, y = (np.concatenate([b[i].reshape(-1, *b[i].shape[2:]) for b in batches])
               for i in range(3))
  # One device, committed, so the compiled program is the library's cached one.
  mean_loss = OnEachDevice(lambda p, x, y, s: weighted_mean(terms(bind.run(p, stage, (None, x), s),
                                                                  y, x)))
  device = jax.local_devices()[0]
  return float(mean_loss(*jax.device_put((dict(params), x, y, sample_seeds(0, ids)), device)))


def _whole(model: Any, cfg: RunConfig) -> Any:
  """The model's whole forward as one stage, its blocks as the config says."""
  return ModelCut(model, cfg.model.seq_len, getattr(cfg.model, "layers", ""),
                  cfg.model.remat).whole()
