"""Silent data corruption (`training/integrity.py`): a replica whose parameters differ from its
stage's others is found at the next check and dropped like a failed worker."""

import jax.numpy as jnp
import numpy as np
import pytest

from resilient_jax.observe.events import Corrupt
from resilient_jax.training.api import train
from resilient_jax.training.integrity import odd_replicas, state_digest
from tests.helpers import tiny_config


def test_a_corrupted_replica_is_dropped_and_the_run_is_a_failure_at_the_next_step(tmp_path):
  """dp=3 x pp=2: one bit of worker (1, 0)'s parameters flips after step 2. The check after
  step 2 finds it (two replicas of stage 0 against one) and drops it at the start of step 3:
  the run is, bit for bit, the run in which worker (1, 0) failed at the start of step 3."""
  common = dict(mesh__dp=3, mesh__pp=2, train__steps=4, train__global_batch=12)
  lines = []
  checked = train(tiny_config(**common, faults__corrupt="2:1.0",
                              resilience__check_replicas_every=1),
                  tmp_path / "checked", log=lines.append)
  failed = train(tiny_config(**common, faults__schedule="3:1.0"), tmp_path / "failed",
                 log=lambda _: None)
  hits = [e for e in checked.events if isinstance(e, Corrupt)]
  assert [(e.step, e.node, e.worker) for e in hits] == [(2, 2, (1, 0))], hits
  rows = checked.metrics
  assert [r.get("corrupt_nodes") for r in rows] == [None, [2], None, None]
  assert all(r["replicas_checked"] for r in rows)
  assert [r["loss"] for r in rows] == [r["loss"] for r in failed.metrics]
  assert [r["live_workers"] for r in rows] == [6, 6, 5, 5]
  a, b = checked.interpreter.all_params(), failed.interpreter.all_params()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_the_digest_sees_one_bit_and_the_majority_names_the_odd_replica():
  x = {"w": jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float32).reshape(4, 6), "b": jnp.ones(3)}
  flipped = dict(x, w=x["w"].at[2, 3].set(np.nextafter(np.float32(x["w"][2, 3]), np.inf)))
  assert int(state_digest(x)) == int(state_digest(dict(x)))
  assert int(state_digest(x)) != int(state_digest(flipped))
  groups = [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1)]]
  assert odd_replicas({(0, 0): 5, (1, 0): 7, (2, 0): 5, (0, 1): 1, (1, 1): 1}, groups) == \
    [((1, 0), 5)]
  # Two replicas that disagree: no majority, both named.
  assert odd_replicas({(0, 0): 5, (1, 0): 5, (2, 0): 5, (0, 1): 1, (1, 1): 2}, groups) == \
    [((0, 1), None), ((1, 1), None)]


@pytest.mark.parametrize("flag,message", [
  ("resilience__check_replicas_every", "check_replicas_every"),
])
def test_a_bad_check_interval_is_one_line(flag, message):
  from resilient_jax.config import ConfigError

  with pytest.raises(ConfigError, match=message):
    tiny_config(**{flag: -1})
