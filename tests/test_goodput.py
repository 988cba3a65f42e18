"""Goodput: failure traces from published mixes, and each policy's ETTR with its losses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from resilient_jax.policy.base import Grid, Recovery, Transition
from resilient_jax.sim import from_config_dict, run_simulation
from resilient_jax.sim.config import load_config_file
from resilient_jax.sim.cost_model import CostModel
from resilient_jax.sim.goodput import LOSSES, Slowdown, pause_parts, young_daly_interval
from resilient_jax.sim.layout import Layout
from resilient_jax.sim.mixes import llama3_mix
from resilient_jax.sim.traces import FailureTracker, Stragglers, mix_trace
from tests.test_sim import PROFILE

HOUR = 3600.0


@pytest.fixture(scope="module")
def costs() -> CostModel:
  return CostModel.from_profile(PROFILE)


def _trace(seed: int, **kw):
  args = dict(nodes=64, devices_per_node=8, duration_s=1000 * HOUR, device_mtbf_s=256 * HOUR,
              causes=llama3_mix(0.5 * HOUR, 0.1 * HOUR), nodes_per_switch=2,
              stragglers=Stragglers(512 * HOUR, 0.5, 0.25 * HOUR), seed=seed)
  return mix_trace(**{**args, **kw})


def test_mix_trace_is_reproducible_by_seed():
  a, b, c = _trace(3), _trace(3), _trace(4)
  assert a.events == b.events
  assert a.events != c.events
  # Stragglers draw from their own stream: the failures of a seed do not move without them.
  plain = _trace(3, stragglers=None)
  assert [e for e in a.events if e.kind in ("fail", "rejoin")] == list(plain.events)


def test_mix_trace_matches_its_rate_and_cause_shares():
  """512 devices at 256 h each: two failures an hour, ~2000 in 1000 h. The count is Poisson and
  each cause's count binomial: both within 4 standard deviations of what the mix says."""
  trace = _trace(0)
  causes = llama3_mix(0.5 * HOUR, 0.1 * HOUR)
  counts = trace.causes()
  n = sum(counts.values())
  expected = 512 / 256 * 1000  # the repairs are short: few units are down at any time
  assert abs(n - expected) < 4 * math.sqrt(expected)
  total = sum(c.share for c in causes)
  for cause in causes:
    p = cause.share / total
    assert abs(counts.get(cause.name, 0) - n * p) < 4 * math.sqrt(n * p * (1 - p)) + 1, cause.name
  # What each failure takes down and for how long: a switch takes its two nodes at one instant,
  # a transient cause comes back after its own repair time.
  fails = [e for e in trace.events if e.kind == "fail"]
  switch = [e for e in fails if e.cause == "network switch/cable"]
  assert switch and all(e.device == -1 for e in switch)
  times = {e.time_s for e in switch}
  assert len(switch) == 2 * len(times)
  gpus = [e for e in fails if e.cause == "faulty GPU"]
  assert gpus and all(e.device >= 0 for e in gpus)  # one device each, and there are some
  bug = next(e for e in fails if e.cause == "software bug")
  back = next(e for e in trace.events if e.kind == "rejoin" and e.node == bug.node
              and e.time_s > bug.time_s and e.cause == "software bug")
  assert back.time_s - bug.time_s == pytest.approx(0.1 * HOUR)
  # Stragglers: episodes at 512 devices / 512 h, one an hour, each over after 15 minutes.
  slow = [e for e in trace.events if e.kind == "slow"]
  assert abs(len(slow) - 1000) < 4 * math.sqrt(1000)
  assert all(e.speed == 0.5 for e in slow)


def test_a_slow_device_slows_its_worker_and_the_step():
  lay = Layout(dp=2, pp=4, tp=2, microbatches=4, devices_per_node=2)
  trace = mix_trace(nodes=8, devices_per_node=2, duration_s=100 * HOUR, device_mtbf_s=1e9 * HOUR,
                    causes=llama3_mix(HOUR, HOUR), stragglers=Stragglers(20 * HOUR, 0.5, HOUR),
                    seed=1)
  tracker = FailureTracker(lay)
  first = next(e for e in trace.events if e.kind == "slow")
  tracker.apply(first)
  worker = lay.worker_of_device(first.node * 2 + first.device)
  assert tracker.slow == {(worker, 0.5)} and not tracker.failed


def test_young_daly_interval():
  assert young_daly_interval(10_000.0, 5.0) == pytest.approx(math.sqrt(2 * 10_000 * 5))
  assert young_daly_interval(math.inf, 5.0) == math.inf
  assert young_daly_interval(100.0, 0.0) == math.inf
  cd = load_config_file("configs/sim/llama3_16k.py:runlocal")
  cfg = from_config_dict(cd)
  mtbf = cfg.trace.device_mtbf_s / cfg.layout.devices
  # Young/Daly on the blocking part of a save (0.5 s), never below the background write (5 s).
  assert cfg.checkpoint_blocking_s == 0.5 and cfg.checkpoint_write_s == 5.0 and cfg.young_daly
  assert cfg.recovery.checkpoint_interval_s == pytest.approx(max(math.sqrt(2 * mtbf * 0.5), 5))


def test_pause_parts_sum_to_the_pause(costs):
  grid = Grid(4, 4, 4)
  fail = Transition(grid, frozenset(), frozenset({(1, 2)}), costs, 2.0)
  rejoin = Transition(grid, frozenset({(1, 2)}), frozenset(), costs, 2.0)
  cases = [
    (Recovery(30 + 10 + 1.0), fail, {"detection": 30, "rerun": 1.0, "replanning": 10}),
    (Recovery(630, rollback=True), fail, {"detection": 30, "restarts": 600}),
    (Recovery(600, restart=True), rejoin, {"restarts": 600}),
    (Recovery(10), rejoin, {"replanning": 10}),
    (Recovery(5), fail, {"detection": 5}),  # clipped: never more than the pause
  ]
  for rec, t, want in cases:
    parts = pause_parts(rec, t, detect_s=30.0)
    assert sum(parts.values()) == pytest.approx(rec.pause_s)
    assert {k: v for k, v in parts.items() if v} == pytest.approx(want)


def test_slowdown_factor(costs):
  grid = Grid(4, 4, 4)
  slowdown = Slowdown(grid, costs)
  assert slowdown.factor([], frozenset()) == 1.0
  half = slowdown.factor([((0, 3), 0.5)], frozenset())
  assert 1.0 < half <= 2.0
  assert slowdown.factor([((0, 3), 0.5)], frozenset({(0, 3)})) == 1.0  # failed: not waited for
  assert slowdown.factor([((0, 3), 0.5), ((1, 0), 0.9)], frozenset()) == half


@pytest.fixture(scope="module")
def tiny():
  """The Llama 3 preset's tiny variant: 8 workers, six hours of its mix with stragglers."""
  return run_simulation(from_config_dict(load_config_file("configs/sim/llama3_16k.py:runlocal")),
                        log=lambda _: None)


def test_ettr_breakdown_sums_to_wall_time(tiny):
  g = tiny["goodput"]
  wall = tiny["trace"]["duration_s"]
  assert tiny["trace"]["summary"] and g["slowdowns"] > 0 and sum(g["failures_by_cause"].values())
  for name, p in g["policies"].items():
    assert set(p["losses_s"]) == set(LOSSES)
    assert p["committed_s"] + sum(p["losses_s"].values()) == pytest.approx(wall), name
    assert p["ettr"] == pytest.approx(p["committed_s"] / wall) and 0 < p["ettr"] <= 1
    # Committed time is the committed samples at the ideal step's rate.
    run = tiny["trace"]["policies"][name]
    batch = tiny["config"]["global_batch"]
    assert run["samples"] == pytest.approx(p["committed_s"] * batch / g["ideal_step_s"])
    r = p["recoveries"]
    assert r["failures"] == r["in_place"] + r["restores"] and r["fallbacks"] <= r["restores"]
  assert g["policies"]["restart"]["recoveries"]["in_place"] == 0
  assert g["policies"]["restart"]["recovery_success_rate"] is None
  assert g["policies"]["recycle"]["losses_s"]["restarts"] == 0


def test_each_policy_checkpoints_for_the_restores_it_needs(tiny):
  """Young/Daly per policy: restart restores at every failure and saves often; recycle never
  restored in this trace and saves as if it might once in it; a save blocks 0.5 s of each
  interval, and that is the checkpoint loss."""
  g = tiny["goodput"]["policies"]
  hours = tiny["trace"]["duration_s"]
  for name, p in g.items():
    restores = max(p["recoveries"]["restores"], 1)
    want = max(math.sqrt(2 * 0.5 * hours / restores), 5.0)
    assert p["checkpoint_interval_s"] == pytest.approx(want), name
  assert g["restart"]["recoveries"]["restores"] > 1 and g["recycle"]["recoveries"]["restores"] == 0
  assert g["restart"]["checkpoint_interval_s"] < g["recycle"]["checkpoint_interval_s"]
  for name in ("recycle", "restart"):
    stall = g[name]["losses_s"]["checkpoint"] / (g[name]["committed_s"]
                                                + g[name]["losses_s"]["checkpoint"]
                                                + g[name]["losses_s"]["slowed"]
                                                + g[name]["losses_s"]["stragglers"])
    assert stall == pytest.approx(0.5 / g[name]["checkpoint_interval_s"], rel=1e-6), name


def test_auto_matches_the_best_single_policy(tiny):
  g = tiny["goodput"]
  ettr = {n: p["ettr"] for n, p in g["policies"].items()}
  assert ettr["auto"] >= max(v for n, v in ettr.items() if n != "auto") - 1e-9
  assert g["best_single"]["ettr"] == max(v for n, v in ettr.items() if n != "auto")
  assert np.isfinite(g["over_restart"]["recycle"]["points"])


def test_the_runtime_goodput_counts_the_start_up_in_its_wall_time():
  """`goodput.json` of a run: the wall time from the process's start (the launcher's), and the
  start-up in it (imports, joining, building), named apart."""
  from resilient_jax.observe.goodput import GoodputLog

  log = GoodputLog()
  log.started = log.ready - 12.0  # the process started 12 s before the run was built
  report = log.report([{"step": 1, "step_time_s": 3.0, "samples_per_s": 1.0}],
                      now=log.ready + 8.0)["run"]
  assert report["startup_s"] == 12.0 and report["wall_s"] == 20.0
  assert report["effective_fraction"] == 0.15
