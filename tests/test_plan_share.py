"""Every process plans, the planner publishes a digest (`policy/shared.py`, `schedule/codec.py`).

A planner coordinator and a follower coordinator share an in-memory exchange (the key-value
store's part): each failure and rejoin is decided by both, the planner publishes its decision's
digest, and the follower's plan, checked against it, must equal the planner's op for op and
route for route, with the same policy, restore, phases and log. The store's side
(`runtime/plan_exchange.py`) runs on a stand-in for the coordination service's client; the
multi-process job that does all of it through the real store is
`tests/test_multiprocess.py::test_sigkill_matches_in_process_run`.
"""

import json
import time

import pytest

from resilient_jax.config import DistributedConfig
from resilient_jax.exit_codes import EXIT_WAIT_TIMEOUT
from resilient_jax.policy import NoDevicesLeft, RunCoordinator, StageLost
from resilient_jax.runtime import kvstore as kvstore_module
from resilient_jax.runtime.cluster import Cluster
from resilient_jax.runtime.plan_exchange import KVPlanExchange, plan_key
from resilient_jax.schedule import codec
from resilient_jax.schedule.pipelines import PipelineSet
from resilient_jax.schedule.plan import step_program
from tests.helpers import tiny_config


class _Store:
  """The exchange's store: written once per key, like the coordination service's."""

  def __init__(self):
    self.data: dict[str, bytes] = {}


class _Exchange:
  def __init__(self, store: _Store, planner: bool):
    self.store = store
    self.planner = planner
    self.reads = 0

  def publish(self, key, data):
    assert key not in self.store.data, f"{key} published twice"
    self.store.data[key] = data

  def read(self, key):
    self.reads += 1
    return self.store.data[key]


def _pair(cfg, nodes):
  store = _Store()
  out = []
  for planner in (True, False):
    lines = []
    coord = RunCoordinator(cfg, nodes, log=lines.append)
    coord.exchange = _Exchange(store, planner)
    out.append((coord, lines))
  return out


def _same_plan(a, b):
  """Op for op, route for route, node for node (every slot of the step program)."""
  pa, pb = step_program(a), step_program(b)
  assert pa.name == pb.name
  assert sorted(pa.slots) == sorted(pb.slots)
  for slot, prog in pa.slots.items():
    other = pb.slots[slot]
    assert (prog.node, prog.split, prog.stage, prog.replica) == \
      (other.node, other.split, other.stage, other.replica), slot
    assert tuple(prog.ops) == tuple(other.ops), slot
  assert list(pa.route) == list(pb.route)
  assert type(a) is type(b)
  if isinstance(a, PipelineSet):
    assert a == b


def _apply(pair, event, key):
  """Applies `event` to the planner, then the follower; returns their decisions."""
  kind, nodes, step = event
  out = []
  for coord, _ in pair:
    call = coord.fail if kind == "fail" else coord.rejoin
    out.append(call(nodes, step, key=key))
  return out


EVENTS = {
  # (policy, dp, pp, events); nodes are d * pp + s.
  "recycle single then spread": ("recycle", 4, 2, [("fail", {5}, 2), ("fail", {2, 7}, 3),
                                                    ("rejoin", {5}, 4)]),
  "recycle host": ("recycle", 4, 2, [("fail", {2, 3}, 2)]),  # both workers of pipeline 1
  "auto switches": ("auto", 4, 2, [("fail", {0}, 2), ("fail", {2}, 3), ("fail", {4}, 4)]),
  "oobleck": ("oobleck", 4, 2, [("fail", {5}, 2), ("rejoin", {5}, 3)]),
  "bamboo": ("bamboo", 4, 2, [("fail", {1}, 2)]),
  # A restore onto a smaller layout, then a rejoin that grows it back (a planned restart): the
  # layout itself crosses.
  "restart shrinks and grows": ("restart", 2, 4, [("fail", {5}, 3), ("rejoin", {5}, 6)]),
}


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_followers_build_the_planners_plan(name):
  policy, dp, pp, events = EVENTS[name]
  cfg = tiny_config(mesh__dp=dp, mesh__pp=pp, resilience__policy=policy,
                    resilience__mean_steps_between_failures=500.0)
  (planner, planner_log), (follower, follower_log) = pair = _pair(cfg, range(dp * pp))
  for i, event in enumerate(events):
    mine, theirs = _apply(pair, event, f"step/{event[2]}/plan/{i}/{i}")
    _same_plan(mine.plan, theirs.plan)
    # The digest is taken over the encoding, which loses nothing: it decodes to the plan.
    _same_plan(codec.decode_plan(codec.encode_plan(mine.plan)), mine.plan)
    _same_plan(planner.plan, follower.plan)
    assert (mine.restore, mine.reason) == (theirs.restore, theirs.reason)
    assert follower.policy == planner.policy
    assert follower.plan_name == planner.plan_name
    assert follower.live_count == planner.live_count
    assert follower.down_nodes == planner.down_nodes
  assert follower.exchange.reads == len(events)
  assert [(p.schedule_name, p.live, p.predicted_ratio, p.failure_step, p.event)
          for p in follower.phases] == \
    [(p.schedule_name, p.live, p.predicted_ratio, p.failure_step, p.event) for p in planner.phases]
  # The same log, but for the line saying who published and who checked.
  assert [x for x in planner_log if "plan: decided in" not in x] == \
    [x for x in follower_log if "plan: decided in" not in x]
  assert sum("its digest published" in x for x in planner_log) == len(events)
  assert sum("the same as the planner's" in x for x in follower_log) == len(events)
  if name == "restart shrinks and grows":
    assert (mine.restore, follower.grid.dp) == (True, 2) and "growing the layout" in mine.reason
  if name == "auto switches":
    assert planner.policy == "bamboo"  # the switch itself crossed (auto's choice)


def test_a_large_grid_crosses_as_a_digest():
  """64 x 4 x 16 is planned on the touched pipelines and expanded, by every process: what
  crosses the store is the decision's digest, a few dozen bytes whatever the grid."""
  dp, pp, m = 64, 4, 16
  cfg = tiny_config(mesh__dp=dp, mesh__pp=pp, model__num_layers=pp, pipeline__microbatches=m,
                    pipeline__schedule="zb-h1", train__global_batch=dp * m,
                    resilience__policy="recycle")
  (planner, _), (follower, _) = pair = _pair(cfg, range(dp * pp))
  mine, theirs = _apply(pair, ("fail", {40 * pp + 2, 50 * pp + 1}, 3), "k")
  published = planner.exchange.store.data["k"]
  assert len(published) < 100 and set(codec.from_bytes(published)) == {"digest"}
  _same_plan(mine.plan, theirs.plan)


def test_a_follower_whose_decision_differs_stops_with_one_line():
  """A planner that planned otherwise (here: another policy) is a bug the digest catches."""
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="recycle")
  (planner, _), (follower, _) = _pair(cfg, range(4))
  planner.active = planner.policies["naive"]
  planner.fail({1}, 2, key="k")
  with pytest.raises(RuntimeError, match="differs from the planner's"):
    follower.fail({1}, 2, key="k")


def test_a_lost_stage_ends_the_followers_too():
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="recycle",
                    resilience__restore_on_stage_loss=False)
  pair = _pair(cfg, range(4))
  for coord, _ in pair:
    with pytest.raises(StageLost, match="every worker of stage 1"):
      coord.fail({1, 3}, 2, key="k")


def test_no_devices_left_ends_the_followers_too():
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="restart")
  pair = _pair(cfg, range(4))
  for coord, _ in pair:
    with pytest.raises(NoDevicesLeft):
      coord.fail({0, 1, 2, 3}, 2, key="k")


def test_a_planner_bug_stops_the_followers_at_once():
  """Not at their wait's bound: the error is published as the decision."""
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="recycle")
  (planner, _), (follower, _) = _pair(cfg, range(4))

  def broken(*_, **__):
    raise ValueError("no plan today")

  planner._plan_of = broken
  with pytest.raises(ValueError, match="no plan today"):
    planner.fail({1}, 2, key="k")
  with pytest.raises(RuntimeError, match="failed to decide k: ValueError: no plan today"):
    follower.fail({1}, 2, key="k")


def test_runs_round_trip():
  for ids in ([], [3], [0, 1, 2, 5, 6, 9], list(range(16384))):
    assert codec.unruns(codec.runs(ids)) == ids
  assert codec.runs(list(range(16384))) == [[0, 16384]]


# --- the key-value store's side (runtime/plan_exchange.py), on a stand-in for the client -------


class _Client:
  """The coordination service's string key-value calls, as they behave."""

  def __init__(self):
    self.kv: dict[str, str] = {}
    self.read_bytes = 0

  def key_value_set(self, key, value, allow_overwrite=False):
    if key in self.kv and not allow_overwrite:
      raise RuntimeError(f"ALREADY_EXISTS: {key}")
    self.kv[key] = value

  def key_value_try_get(self, key):
    if key not in self.kv:
      raise RuntimeError(f"NOT_FOUND: {key}")
    self.read_bytes += len(self.kv[key])
    return self.kv[key]

  def blocking_key_value_get(self, key, timeout_ms):
    if key in self.kv:
      self.read_bytes += len(self.kv[key])
      return self.kv[key]
    time.sleep(timeout_ms / 1000)
    raise RuntimeError("DEADLINE_EXCEEDED")


def _cluster(client, process_id, lines):
  cl = Cluster.__new__(Cluster)  # no jax.distributed: only what the exchange calls
  cl.cfg = DistributedConfig(wait_timeout_s=1)
  cl.client, cl.process_id, cl.log = client, process_id, lines.append
  return cl


def test_the_store_carries_the_plan_once_per_follower():
  client, lines = _Client(), []
  planner = KVPlanExchange(_cluster(client, 0, lines))
  follower = KVPlanExchange(_cluster(client, 3, lines))
  assert (planner.planner, follower.planner) == (True, False)
  key = plan_key(4, 7, 2)
  data = bytes(range(256)) * 40  # not text: compressed JSON
  planner.publish(key, data)
  assert all(isinstance(v, str) for v in client.kv.values())  # string reads of `step/` work
  client.read_bytes = 0
  assert follower.read(key) == data
  assert client.read_bytes < 1.3 * len(data)  # read once (the wake-up key is tiny)
  assert lines == [f"process 3: checks its plan against process 0's digest {key} "
                   f"({len(data)} bytes, waited {lines[0].rsplit('waited ', 1)[1]}"]
  with pytest.raises(RuntimeError, match="publishing the plan"):
    planner.publish(key, data)  # written once


def test_a_slow_planner_ends_a_follower_with_the_wait_timeout_exit(monkeypatch):
  def end_process(code, message):
    raise SystemExit((code, message))

  monkeypatch.setattr(kvstore_module, "end_process", end_process)
  # The service answers (the planner is slow, not gone): the wait's own exit, not exit 5's.
  monkeypatch.setattr(Cluster, "_coordinator_reachable", lambda self: True)
  follower = KVPlanExchange(_cluster(_Client(), 2, []))
  with pytest.raises(SystemExit) as e:
    follower.read(plan_key(5, 9, 1))
  code, message = e.value.code
  assert code == EXIT_WAIT_TIMEOUT == 6
  assert "waited more than 1s for process 0's decision step/5/plan/9/1" in message


def test_gathering_reads_the_directory_once_a_poll_and_leaves_out_the_dead():
  """`Cluster.await_keys` (what process 0's `Job.gather` and the leaving barrier wait with): the
  values of every owner from one directory read, not one read per owner; an owner proven dead
  before it wrote is left out, one that wrote then died is kept; other keys in the directory
  (a decision, deeper keys) are not values."""

  class Dir(_Client):
    dir_reads = 0

    def key_value_dir_get(self, directory):
      self.dir_reads += 1
      return [(k, v) for k, v in self.kv.items() if k.startswith(directory + "/")]

  client = Dir()
  for p in (0, 1, 3):
    client.key_value_set(f"step/4/x/{p}", json.dumps({"p": p}))
  client.key_value_set("step/4/x/speeds", json.dumps(None))
  client.key_value_set("step/4/x/left/2", json.dumps(True))
  cl = _cluster(client, 0, [])
  cl.dead = lambda ids: {p for p in ids if p in (2, 3)}
  assert cl.await_keys("step/4/x", [0, 1, 2, 3], "x") == {0: {"p": 0}, 1: {"p": 1}, 3: {"p": 3}}
  assert client.dir_reads == 2  # the first read, and the re-read once 2 was found dead
  client.dir_reads = 0
  assert cl.await_keys("step/4/x", [0, 1], "x") == {0: {"p": 0}, 1: {"p": 1}}
  assert client.dir_reads == 1
