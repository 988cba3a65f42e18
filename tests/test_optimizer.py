"""The optimizer of `optimizer.*`, and global-norm clipping and non-finite skipping that act on
the whole model while each stage still steps on its own: against one device running
`optax.clip_by_global_norm` in front of the same optimizer."""

import math

import jax
import numpy as np
import pytest

from resilient_jax.config import ConfigError
from resilient_jax.schedule.core import B, Op
from resilient_jax.training.faults import FaultEvent
from resilient_jax.training.hooks import NonFiniteSteps
from resilient_jax.training.loop import Trainer
from tests.helpers import assert_matches_reference, expected_digests, reference_for, tiny_config


def _run(tmp_path, faults=(), **overrides):
  cfg = tiny_config(**overrides)
  result = Trainer(cfg, tmp_path, log=lambda _: None, faults=list(faults)).run()
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  params = result.interpreter.all_params()
  if cfg.optimizer.name == "lion":
    # Lion steps by the sign of its update. The attention's key bias has a zero gradient
    # (softmax ignores it), so its "gradient" is float noise whose sign no two summation orders
    # agree on; leave that slice out, compare the rest.
    ref = reference_for(cfg)[1]
    d = cfg.model.d_model
    for name in params:
      if name.endswith("attn.qkv.bias"):
        params[name] = np.concatenate([params[name][:d], ref[name][d:2 * d], params[name][2 * d:]])
  assert_matches_reference(result.metrics, params, cfg)
  return cfg, result


@pytest.mark.parametrize("pp,tied,policy,faults,mid", [
  (2, False, "recycle", "", FaultEvent(2, (1, 0), after_op=Op(B, 3))),
  pytest.param(4, True, "oobleck", "2:1.2", None, marks=pytest.mark.slow),
])
def test_global_norm_clipping_matches_one_device(tmp_path, pp, tied, policy, faults, mid):
  cfg, result = _run(
    tmp_path, [mid] if mid else [], mesh__dp=2, mesh__pp=pp, model__tied_head=tied,
    pipeline__schedule="zb-h1", resilience__policy=policy, faults__schedule=faults,
    resilience__min_pipeline_nodes=2, optimizer__clip_global_norm=0.3)
  # The threshold clips: every step's global norm is above it, and each row says so.
  assert all(m["grad_norm"] > 0.3 and m.get("clipped") for m in result.metrics)
  if tied:
    # The embedding and the tied head are one weight held by two stages: still identical.
    holders = [p for p in result.interpreter.params.values() if "embed.wte.embedding" in p]
    assert len(holders) >= 2
    for p in holders[1:]:
      np.testing.assert_array_equal(np.asarray(p["embed.wte.embedding"]),
                                    np.asarray(holders[0]["embed.wte.embedding"]))


# adam and sgd are `add_decayed_weights` chained in front of optax's own, adafactor's decay is
# optax's; lion steps by a sign, which makes float noise visible (see `_run`).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["lion"])
def test_every_optimizer_matches_one_device(tmp_path, name):
  _run(tmp_path, mesh__dp=2, mesh__pp=2, optimizer__name=name, optimizer__schedule="linear",
       optimizer__clip_global_norm=0.5)


def _poison(trainer, at_call):
  """Makes one stage's weight gradient infinite in its `at_call`-th backward call."""
  prog = trainer.programs[-1]
  calls = [0]
  for attr in ("backward_weight", "backward_fused"):
    real = getattr(prog, attr)

    def poisoned(*args, _real=real, _attr=attr):
      out = _real(*args)
      calls[0] += 1
      if calls[0] != at_call:
        return out
      infinite = lambda acc: jax.tree.map(lambda v: v * np.inf, acc)  # noqa: E731
      if _attr == "backward_fused":
        dx, acc = out
        return dx, infinite(acc)
      return infinite(out)

    setattr(prog, attr, poisoned)


def test_a_non_finite_gradient_skips_the_step_on_every_stage(tmp_path):
  """The last stage's gradient turns infinite: no stage steps (the first stage's gradients were
  finite), and the step is marked (`test_too_many_non_finite_steps_stop_the_run`: the run goes
  on through such steps)."""
  cfg = tiny_config(mesh__dp=1, mesh__pp=2, train__steps=1)
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  before = trainer.interpreter.all_params()
  _poison(trainer, at_call=cfg.pipeline.microbatches)  # the step's last backward there
  result = trainer.run()
  assert result.metrics[0].get("skipped") and not math.isfinite(result.metrics[0]["grad_norm"])
  after = trainer.interpreter.all_params()
  for k, v in before.items():
    np.testing.assert_array_equal(after[k], v, err_msg=k)


def test_too_many_non_finite_steps_stop_the_run(tmp_path):
  """Steps 1 and 2 are non-finite: exit 8 after step 2. The resume (from the checkpoint of step
  1) counts step 1 on, so step 2 stops it again: it once started a fresh allowance."""
  cfg = tiny_config(mesh__dp=1, mesh__pp=2, train__steps=3, train__max_nonfinite_steps=2,
                    checkpoint__every_steps=1)

  def poisoned() -> Trainer:
    trainer = Trainer(cfg, tmp_path, log=lines.append)
    prog = trainer.programs[0]
    real = prog.optimizer_step

    def infinite_share(*args, **kwargs):
      params, opt_state, share = real(*args, **kwargs)
      return params, opt_state, share * np.inf

    prog.optimizer_step = infinite_share
    return trainer

  lines = []
  with pytest.raises(NonFiniteSteps, match=r"2 steps in a row .*\(steps 1-2\)"):
    poisoned().run()
  lines.clear()
  with pytest.raises(NonFiniteSteps, match=r"2 steps in a row .*\(steps 1-2\)"):
    poisoned().run()
  assert any(x.startswith("restored step 1") for x in lines), lines
  assert any(x.startswith("step 1 had non-finite gradients") for x in lines), lines


@pytest.mark.parametrize("key,value,message", [
  ("name", "adagrad", "optimizer.name='adagrad' is not one of"),
  ("learning_rate", float("inf"), "optimizer.learning_rate must be a positive number"),
  ("b1", 5.0, "optimizer.b1 must be in [0, 1)"),
  ("b2", -3.0, "optimizer.b2 must be a non-negative number"),
  ("weight_decay", -100.0, "optimizer.weight_decay must be a non-negative number"),
  ("clip_global_norm", float("nan"), "optimizer.clip_global_norm must be a non-negative"),
  ("schedule", "cosine", "optimizer.schedule='cosine' is not one of"),
])
def test_bad_optimizer_settings_name_the_key(key, value, message):
  with pytest.raises(ConfigError) as e:
    tiny_config(**{f"optimizer__{key}": value})
  assert message in str(e.value)


@pytest.mark.slow
def test_bfloat16_compute_matches_one_device_in_bfloat16(tmp_path):
  """`model.dtype=bfloat16`: stages compute and pass activations in bfloat16, while parameters,
  gradients, their accumulation and the data-parallel reduction stay float32; the pipelined run
  (with a failure, clipping, on the shipped token file) matches one device computing in
  bfloat16 to bfloat16's tolerance."""
  cfg = tiny_config(model__dtype="bfloat16", mesh__dp=2, mesh__pp=2,
                    pipeline__schedule="zb-h1", faults__schedule="2:1.1",
                    train__data="tokens", optimizer__clip_global_norm=1.0)
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  reduced = set()
  reduce = trainer.transport.reduce

  def recording(index, nodes, devices, local):
    reduced.update(str(v.dtype) for part in local.values() for v in part.values())
    return reduce(index, nodes, devices, local)

  trainer.transport.reduce = recording
  result = trainer.run()
  assert reduced == {"float32"}
  assert str(trainer.programs[0].output_spec.dtype) == "bfloat16"  # activations between stages
  params = result.interpreter.all_params()
  assert {str(v.dtype) for v in params.values()} == {"float32"}
  ref_losses, ref_params = reference_for(cfg)
  np.testing.assert_allclose([m["loss"] for m in result.metrics], ref_losses, rtol=1e-4)
  diffs = np.concatenate([np.abs(params[k] - v).ravel() for k, v in ref_params.items()])
  # Summation order changes the last bits of bfloat16 values; Adam turns a near-zero gradient's
  # noise into a step of up to the learning rate, so a few parameters differ by that much.
  lr_steps = cfg.optimizer.learning_rate * cfg.train.steps
  assert np.median(diffs) < 1e-4 and np.percentile(diffs, 99) < 1e-3 and diffs.max() < lr_steps


@pytest.mark.slow
def test_accumulating_two_global_batches_is_one_optimizer_step_over_both(tmp_path):
  """`train.accumulate_steps=2`: each optimizer step trains on two global batches (each
  pipeline runs twice the micro-batches, of the same size), as one device stepping on both."""
  cfg, result = _run(tmp_path, mesh__dp=2, mesh__pp=2, train__accumulate_steps=2,
                     pipeline__schedule="zb-h1", faults__schedule="2:1.0")
  assert cfg.microbatch_size == tiny_config().microbatch_size
  assert all(m["samples"] == 2 * cfg.train.global_batch for m in result.metrics)
