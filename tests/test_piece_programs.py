"""A piece of a micro-batch through the stage programs: the first step of the runtime running
sample-split plans (issue 50).

The runtime does not run plans with pieces yet (`PlannerPolicy.runtime_plan` refuses them). What
it would run is already here: a stage's programs built for a micro-batch of `n` samples are a
piece's programs (another batch dimension), and the loss of the last stage is scaled over the
global batch (`StagePrograms.loss_scale`), so a sample is the unit. This checks that on the tiny
GPT split in two stages: the last stage run on two pieces of a micro-batch (rows 0:1 and 1:2 of
2) gives the whole micro-batch's loss as the sum of the pieces', its input gradient as their
rows, and its weight gradients as their sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.helpers import assert_close, tiny_config


def test_a_micro_batch_in_pieces_gives_its_loss_and_gradients():
  from resilient_jax.model.check import token_batch
  from resilient_jax.programs.shared import build_stage_programs
  from resilient_jax.recipe import make_model, make_optimizer

  cfg = tiny_config(mesh__dp=1, mesh__pp=2)
  model = make_model(cfg)
  size = cfg.microbatch_size
  assert size >= 2
  seq = cfg.model.seq_len

  def programs(n):
    return build_stage_programs(model, cfg.partition, token_batch(seq, n), make_optimizer(cfg),
                                cfg.step_batch)

  whole, piece = programs(size), programs(1)
  dev = jax.devices()[0]
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (size, seq)), jnp.int32)
  targets = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (size, seq)), jnp.int32)
  batch = {"tokens": tokens, "targets": targets}
  first, last = whole
  p0, p1 = first.initial_params(dev), last.initial_params(dev)
  x, _, _ = first.forward(p0, None, batch)
  loss, res, saved = last.forward(p1, x, batch)
  g = jax.device_put(jnp.float32(1.0), dev)
  dx, grads = last.backward_fused(res, saved, p1, g, last.zero_grads(p1, dev))

  _, last_piece = piece
  acc = last_piece.zero_grads(p1, dev)
  losses, dxs = [], []
  for lo in range(size):  # every sample its own piece
    rows = {k: v[lo:lo + 1] for k, v in batch.items()}
    loss_i, res_i, saved_i = last_piece.forward(p1, x[lo:lo + 1], rows)
    dx_i, acc = last_piece.backward_fused(res_i, saved_i, p1, g, acc)
    losses.append(loss_i)
    dxs.append(dx_i)
  assert_close(sum(losses), loss)
  assert_close(jnp.concatenate(dxs), dx)
  for name in last.param_names:
    assert_close(acc[name], grads[name], err_msg=name)
