"""The interpreter's dispatch (`runtime.dispatch`): the same training whichever threads dispatch
the ops, and a failure on a dispatch thread reaches the caller with the committed state kept."""

import numpy as np
import pytest

from resilient_jax.recipe import step_batch
from resilient_jax.runtime.dispatch import DISPATCH_MODES
from resilient_jax.runtime.interpreter import Interpreter
from resilient_jax.runtime.records import WorkerLost
from resilient_jax.schedule.core import BW, F, Op
from resilient_jax.training.loop import Trainer
from tests.helpers import tiny_config


def test_every_dispatch_mode_trains_bitwise_the_same(tmp_path):
  # zb-h1 splits B and W; after worker (1, 1) is lost its micro-batches cross to pipeline 0,
  # so the pipelines' dispatch threads wait on each other's ops.
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, pipeline__schedule="zb-h1", train__steps=2)
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  rerouted = trainer.coordinator.fail({3}, 1).plan
  batches = [step_batch(cfg, trainer.source, trainer.plan, step)[1:] for step in (1, 2)]
  trained = {}
  for mode in DISPATCH_MODES:
    ex = Interpreter(trainer._programs_for, trainer.transport, trainer.coordinator.plan)
    ex.dispatch = mode
    losses = [ex.run_step(*batches[0], step=1).loss]
    ex.place(rerouted, ex.sources({3}))
    result = ex.run_step(*batches[1], step=2)
    assert sorted(result.processed) == list(range(8))
    trained[mode] = (losses + [result.loss], ex.all_params())
  serial_losses, serial_params = trained["serial"]
  for mode, (losses, params) in trained.items():
    assert losses == serial_losses, mode
    for name, value in serial_params.items():
      np.testing.assert_array_equal(params[name], value, err_msg=f"{mode}: {name}")


def test_a_failure_on_a_dispatch_thread_reaches_the_caller(tmp_path):
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=1)
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  ex = trainer.interpreter
  ex.dispatch = "pipelines"  # a thread per pipeline
  before = {k: np.asarray(v) for k, v in ex.export_state()[0].items()}
  _, inputs, targets = step_batch(cfg, trainer.source, trainer.plan, 1)
  # An injected loss after a forward, any other error after a fused backward.
  for fail_at, error in ((Op(F, 2), WorkerLost), (Op(BW, 5), RuntimeError)):
    seen = []

    def hook(node, op, fail_at=fail_at, seen=seen):
      seen.append((node, op))
      if op == fail_at:
        raise WorkerLost(node) if op.kind == F else RuntimeError("the device fell over")

    with pytest.raises(error):
      ex.run_step(inputs, targets, after_op=hook)
    assert fail_at in [op for _, op in seen]
    after = ex.export_state()[0]
    for k, v in before.items():
      np.testing.assert_array_equal(v, np.asarray(after[k]))
  # The abandoned attempts' threads are gone: the step runs again, whole.
  assert sorted(ex.run_step(inputs, targets).processed) == list(range(8))
