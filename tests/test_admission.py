"""The admission protocol of relaunched processes, on an in-memory key-value store (no JAX
processes: `test_multiprocess.py::test_a_relaunched_process_rejoins` runs it for real)."""

import json

import pytest

from resilient_jax.policy import RunCoordinator
from resilient_jax.runtime import admission
from resilient_jax.runtime.liveness import first_writer_wins
from tests.helpers import tiny_config


class Store:
  """The coordination service's key-value store, as `jax.distributed`'s client offers it."""

  def __init__(self):
    self.keys: dict[str, str] = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    if key in self.keys and not allow_overwrite:
      raise RuntimeError(f"ALREADY_EXISTS: {key}")
    self.keys[key] = value

  def key_value_try_get(self, key):
    if key not in self.keys:
      raise RuntimeError(f"NOT_FOUND: {key}")
    return self.keys[key]


class FakeCluster:
  """What `runtime.admission` uses of `Cluster`, over one shared `Store`."""

  def __init__(self, store: Store, process_id: int):
    self.client, self.process_id, self.address = store, process_id, f"host:{9000 + process_id}"

  def kv_set(self, key, value):
    self.client.key_value_set(key, json.dumps(value), True)

  def kv_try_get(self, key):
    raw = self.client.keys.get(key)
    return None if raw is None else json.loads(raw)

  def kv_get(self, key):
    return json.loads(self.client.keys[key])

  def kv_delete(self, key):
    for k in [k for k in self.client.keys if k == key or k.startswith(key + "/")]:
      del self.client.keys[k]

  def kv_dir(self, directory):
    return {k.rsplit("/", 1)[1]: json.loads(v) for k, v in self.client.keys.items()
            if k.startswith(directory + "/")}

  def decide(self, key, proposal):
    return first_writer_wins(self.client, key, proposal)

  def poll(self, what, check, wake_key=None):
    out = check()
    assert out is not None, f"would wait for {what}"
    return out


FAILED_1 = [{"kind": "fail", "nodes": [1], "step": 3, "mid_step": True}]


def test_every_live_process_follows_one_admission_and_a_token_is_admitted_once():
  store = Store()
  joiner, p0, p2 = FakeCluster(store, 1), FakeCluster(store, 0), FakeCluster(store, 2)
  nodes, live = range(4), {0, 2, 3}
  assert admission.decide(p0, 5, live, nodes, 9, FAILED_1) is None  # nobody announced yet
  token = admission.announce(joiner)
  FakeCluster(store, 3).kv_set("join/7", {"token": "x", "address": "a", "time": 0.0})  # no node
  # Process 0 decides first; process 2, with a stale view that has process 1 live, follows it.
  first = admission.decide(p0, 6, live, nodes, 9, FAILED_1)
  second = admission.decide(p2, 6, live | {1}, nodes, 11, [])
  assert first == second
  assert first.step == 6 and sorted(first.joiners) == [1] and first.attempts == 9
  assert first.joiners[1]["token"] == token and first.joiners[1]["address"] == "host:9001"
  assert first.joiners[1]["generation"] == 1 and first.history == FAILED_1
  got = admission.await_admission(joiner, token)
  assert got == first and "join/1" not in store.keys  # the announcement is spent
  # Admitted and then lost again: its old token never admits it a second time, a new one does,
  # as the next generation.
  history = [*FAILED_1, first.event(), {"kind": "fail", "nodes": [1], "step": 8, "mid_step": False}]
  store.keys["join/1"] = json.dumps({"token": token, "address": "a", "time": 0.0})
  assert admission.decide(p0, 9, live, nodes, 12, history) is None
  again = admission.announce(joiner)
  later = admission.decide(p0, 10, live, nodes, 12, history)
  assert later.joiners[1]["token"] == again and later.joiners[1]["generation"] == 2
  assert admission.generations([*history, later.event()]) == {1: 2}


def test_a_live_process_is_not_admitted_and_a_joiner_leaves_when_the_job_ends():
  store = Store()
  joiner, p0 = FakeCluster(store, 1), FakeCluster(store, 0)
  token = admission.announce(joiner)
  # Its predecessor is not found dead yet: it is admitted once the failure is agreed.
  assert admission.decide(p0, 4, {0, 1, 2, 3}, range(4), 5, []) is None
  with pytest.raises(AssertionError, match="would wait"):
    admission.await_admission(joiner, token)
  p0.kv_set(admission.ENDED_KEY, "finished")
  assert admission.await_admission(joiner, token) is None


def test_replaying_the_history_gives_the_survivors_plan():
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, train__steps=6)
  quiet = lambda _: None  # noqa: E731
  survivor = RunCoordinator(cfg, range(4), log=quiet)
  fault_free = survivor.plan_text()
  survivor.fail({1}, 3, mid_step=True)
  joiner = RunCoordinator(cfg, range(4), log=quiet)
  admission.replay(joiner, FAILED_1)
  assert joiner.plan_text() == survivor.plan_text() != fault_free
  assert joiner.live == survivor.live == {0, 2, 3}
  for c in (survivor, joiner):  # both apply the admission the same way: recycle takes it back
    assert not c.rejoin([1], 6).restore
    assert c.plan_text() == fault_free
  # A straggler's speed put in force is in the history too (`training/stragglers.py`): a later
  # joiner plans the re-weighted grid the others run.
  survivor.reweigh({(1, 0): 0.25}, 7)
  later = RunCoordinator(cfg, range(4), log=quiet)
  admission.replay(later, [*FAILED_1, {"kind": "rejoin", "nodes": [1], "step": 6},
                           {"kind": "speeds", "speeds": [[1, 0, 0.25]], "step": 7}])
  assert later.plan_text() == survivor.plan_text() != fault_free
  assert later.grid.speeds == (((1, 0), 0.25),)


def test_a_readmitted_process_is_silent_only_from_its_admission():
  """Its predecessor's heartbeat counter stopped long ago (it may even equal the new one's):
  after `forget` the silence counts from the admission, not from the predecessor's death."""
  from resilient_jax.runtime.liveness import HeartbeatMonitor

  m = HeartbeatMonitor(0, timeout_s=1.0, min_beats=1)
  m.observe({0: 1, 1: 5}, 0.0)
  assert m.observe({0: 9, 1: 5}, 2.0) == {1}
  m.forget(1)
  assert m.observe({0: 10, 1: 5}, 2.1) == set()
  assert m.observe({0: 20, 1: 5}, 3.2) == {1}  # and silent again after the timeout
