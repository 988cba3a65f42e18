"""Held-out evaluation (`training/evaluation.py`): the pipelined forward-only loss equals one
device's on the same held-out samples and parameters, through failures; off, it changes
nothing."""

import math

import numpy as np
import pytest

from resilient_jax import data as data_lib
from resilient_jax.config import ConfigError
from resilient_jax.recipe import make_data
from resilient_jax.reference import eval_reference
from resilient_jax.schedule.core import F, Op
from resilient_jax.training.faults import FaultEvent
from resilient_jax.training.loop import Trainer
from tests.helpers import LOSS_RTOL, expected_digests, tiny_config
from tests.test_tensorboard import scalars

EVAL_KEYS = {"eval_loss", "eval_ppl"}


def test_eval_loss_is_one_devices_before_and_after_a_failure(rerouted_run):
  """2 x 2 grid: evaluated after step 2 (every worker) and step 4 (worker (1, 1) failed at step
  3, its stage's forward re-routed to its peer)."""
  cfg, rows = rerouted_run.cfg, rerouted_run.result.metrics
  assert [sorted(EVAL_KEYS & set(r)) for r in rows] == [[], sorted(EVAL_KEYS), [],
                                                        sorted(EVAL_KEYS)]
  assert [rows[1]["live_workers"], rows[3]["live_workers"]] == [4, 3]
  for row in (rows[1], rows[3]):
    expected = eval_reference(cfg, rerouted_run.params[row["step"]])
    np.testing.assert_allclose(row["eval_loss"], expected, rtol=LOSS_RTOL)
    assert row["eval_ppl"] == pytest.approx(math.exp(row["eval_loss"]))
  # Training read none of it: the steps' samples are those of a run that does not evaluate.
  assert [r["sample_digest"] for r in rows] == expected_digests(cfg)
  assert scalars(rerouted_run.workdir / "tb", "eval/loss") == [
    (r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in (rows[1], rows[3])]
  line = next(x for x in rerouted_run.lines if x.startswith("step    4/4"))
  assert f"eval_loss {rows[3]['eval_loss']:.4f}  eval_ppl " in line


def test_a_worker_lost_in_an_evaluation_is_replanned_and_it_runs_again(tmp_path):
  """Worker (1, 0) fails right after its F5 in the evaluation after step 1: the policy
  replans on 3 workers, the evaluation runs again there, and training goes on; the same run
  without evaluation writes the same rows less the eval keys."""
  off = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=2)
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=2, train__eval_every=1)
  plain = Trainer(off, tmp_path / "off", log=lambda _: None).run().metrics
  lines, params = [], {}
  trainer = Trainer(cfg, tmp_path / "on", log=lines.append,
                    faults=[FaultEvent(1, (1, 0), after_op=Op(F, 5), evaluation=True)])
  trainer.add_hook(lambda info: params.update({info.step: info.params()}))
  rows = trainer.run().metrics
  assert "  the evaluation after step 1 runs again on the new plan" in lines
  assert trainer.coordinator.live_count == 3 and rows[1]["live_workers"] == 3
  for row in rows:
    expected = eval_reference(cfg, params[row["step"]])
    np.testing.assert_allclose(row["eval_loss"], expected, rtol=LOSS_RTOL)
  assert [set(r) - set(p) for r, p in zip(rows, plain, strict=True)] == [EVAL_KEYS] * 2
  assert not EVAL_KEYS & set().union(*plain)
  assert rows[0]["loss"] == plain[0]["loss"]  # the failure came after step 1 trained
  np.testing.assert_allclose(rows[1]["loss"], plain[1]["loss"], rtol=LOSS_RTOL)
  assert [r["sample_digest"] for r in rows] == [p["sample_digest"] for p in plain]


def test_the_held_out_split_is_never_trained_on():
  # Synthetic (infinite): a reserved id range; training's plan is unchanged.
  trained, ids = data_lib.held_out(None, 4)
  assert trained is None and ids.tolist() == [2**48 + i for i in range(4)]
  # A file: its last windows, one window apart from the ones training permutes.
  assert data_lib.held_out(100, 0)[0] == 100
  trained, ids = data_lib.held_out(100, 10)
  assert trained == 89 and ids.tolist() == list(range(90, 100))
  with pytest.raises(ValueError, match="leaves none to train on"):
    data_lib.held_out(11, 10)
  cfg = tiny_config(train__data="text", train__eval_every=5, train__eval_batches=2)
  source, plan = make_data(cfg)
  held = 2 * cfg.step_batch
  assert plan.num_samples == source.num_samples - held - 1
  assert make_data(tiny_config(train__data="text"))[1].num_samples == source.num_samples
  with pytest.raises(ConfigError, match="train.eval_batches=100000"):
    make_data(tiny_config(train__data="text", train__eval_every=1, train__eval_batches=100000))
