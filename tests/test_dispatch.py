"""The interpreter's dispatch (`runtime.dispatch`): a failure during it reaches the caller with
the committed state kept."""

import numpy as np
import pytest

from resilient_jax.observe.records import WorkerLost
from resilient_jax.recipe import step_data
from resilient_jax.schedule.core import BW, F, Op
from resilient_jax.training.loop import Trainer
from tests.helpers import tiny_config


def test_a_failure_during_dispatch_reaches_the_caller(tmp_path):
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=1)
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  ex = trainer.interpreter
  before = {k: np.asarray(v) for k, v in ex.export_state()[0].items()}
  _, batch = step_data(cfg, trainer.source, trainer.plan, 1)
  # An injected loss after a forward, any other error after a fused backward.
  for fail_at, error in ((Op(F, 2), WorkerLost), (Op(BW, 5), RuntimeError)):
    seen = []

    def hook(node, op, fail_at=fail_at, seen=seen):
      seen.append((node, op))
      if op == fail_at:
        raise WorkerLost(node) if op.kind == F else RuntimeError("the device fell over")

    with pytest.raises(error):
      ex.run_step(batch, after_op=hook)
    assert fail_at in [op for _, op in seen]
    after = ex.export_state()[0]
    for k, v in before.items():
      np.testing.assert_array_equal(v, np.asarray(after[k]))
  # Nothing of the abandoned attempts lingers: the step runs again, whole.
  assert sorted(ex.run_step(batch).processed) == list(range(8))
