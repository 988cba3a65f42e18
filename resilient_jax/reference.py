"""Single-device training of the same model and data: the reference the pipeline must match.

Deliberately shares nothing with the pipeline path but the model definition, the data and the
optimizer: the plain fused `jax.value_and_grad` of the whole model on the whole global batch, no
stages, taps, schedules or collectives.
"""

from __future__ import annotations

import jax
import numpy as np

from models.layers import FlatBinder, flat_params
from resilient_jax.config import RunConfig
from resilient_jax.recipe import make_data, make_model, make_optimizer, step_batch


def train_reference(cfg: RunConfig, steps: int | None = None) -> tuple[list[float], dict]:
  """Trains on one device; returns per-step losses and the final flat parameters (numpy)."""
  model = make_model(cfg)
  bind = FlatBinder(model)
  params = dict(flat_params(model))
  optimizer = make_optimizer(cfg)
  opt_state = optimizer.init(params)
  source, plan = make_data(cfg)

  def loss_fn(p, x, y):
    mod = bind(p)
    return mod.loss(mod(x), y).mean()

  @jax.jit
  def step(p, o, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
    updates, o = optimizer.update(grads, o, p)
    return jax.tree.map(lambda a, u: a + u, p, updates), o, loss

  losses = []
  for t in range(1, (steps or cfg.train.steps) + 1):
    _, inputs, targets = step_batch(cfg, source, plan, t)
    x = inputs.reshape(-1, inputs.shape[-1])
    y = targets.reshape(-1, targets.shape[-1])
    params, opt_state, loss = step(params, opt_state, x, y)
    losses.append(float(loss))
  return losses, {k: np.asarray(v) for k, v in params.items()}
