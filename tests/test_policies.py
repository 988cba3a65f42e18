"""The Oobleck, Bamboo and auto policies on the real runtime: same failures, same training."""

import dataclasses

import jax
import numpy as np
import pytest

from resilient_jax import policy as policies
from resilient_jax.config import ConfigError
from resilient_jax.observe.events import Copied, Failure, Restored
from resilient_jax.observe.profiling import costs_from_records, measured_durations
from resilient_jax.observe.records import WorkerLost
from resilient_jax.recipe import step_data
from resilient_jax.runtime.interpreter import Interpreter
from resilient_jax.schedule.bamboo import bamboo_set
from resilient_jax.schedule.core import FR
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.pipelines import Pipeline, PipelineSet
from resilient_jax.schedule.plan import step_program
from resilient_jax.schedule.price import replay_measured, replay_program
from resilient_jax.training.loop import Trainer
from tests.helpers import (
  assert_matches_reference,
  expected_digests,
  loaded_checkpoints,
  quick_only,
  run_launcher,
  tiny_config,
)
from tests.test_failures import SCENARIOS


def run_policy(tmp_path, policy, dp, pp, **overrides):
  between, mid = SCENARIOS[(dp, pp)]
  cfg = tiny_config(
    mesh__dp=dp, mesh__pp=pp, faults__schedule=between, resilience__policy=policy, **overrides
  )
  lines = []
  result = Trainer(cfg, tmp_path, log=lines.append, faults=[mid]).run()
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
  failed = [e for e in result.events if isinstance(e, Failure)]
  failures = len(failed)
  # Faults at the start of the same step fail together: one decision for all of them.
  decisions = len({(e.mid_step, e.step) for e in failed})
  if policy == "restart":
    # The smaller grid after a restore may leave a later fault's device out: it never fails.
    assert 1 <= failures <= 1 + len(cfg.faults.schedule)
  else:
    assert failures == 1 + len(cfg.faults.schedule)
  return cfg, result, lines, decisions


@pytest.mark.parametrize("dp,pp", quick_only(sorted(SCENARIOS), [(2, 2)]))
def test_oobleck_survives_the_rerouting_scenarios(tmp_path, dp, pp):
  # Templates from 2 nodes up: with pp=4 and 4 layers, 4-node pipelines would be the only ones.
  cfg, result, lines, _ = run_policy(tmp_path, "oobleck", dp, pp,
                                     resilience__min_pipeline_nodes=2)
  assert {m["schedule"] for m in result.metrics} == {"oobleck"}
  if (dp, pp) == (4, 2):
    # Two failures at step 2 (one decision), one at step 3, each re-instantiated in place:
    # layers were copied, nothing restored.
    assert sum("re-instantiated" in line for line in lines) == 2
    assert any("copied" in line and "0.00 MiB" not in line for line in lines)
    assert not any("restor" in line for line in lines)  # restoring, or nothing to restore
    assert result.metrics[-1]["live_workers"] == 5
  if (dp, pp) == (2, 2):
    # One pipeline is left after the first failure: the second loses layers for good.
    assert any("lost every replica" in line and "no checkpoint to restore" in line
               for line in lines)


@pytest.mark.parametrize("dp,pp", quick_only(sorted(SCENARIOS), [(2, 2)]))
def test_bamboo_survives_the_rerouting_scenarios(tmp_path, dp, pp):
  cfg, result, lines, _ = run_policy(tmp_path, "bamboo", dp, pp)
  failovers = sum("failover:" in line for line in lines)
  if (dp, pp) == (2, 4):
    # Stages 1 and 2 of pipeline 1 both fail: the replica of one died with it.
    assert failovers == 2
    assert any("failed together" in line and "no checkpoint to restore" in line
               for line in lines)
  else:
    assert failovers == 1 + len(cfg.faults.schedule)
    assert not [e for e in result.events if isinstance(e, Restored)]
    # The predecessor took over from its replica: nothing was copied.
    assert sum(e.nbytes for e in result.events if isinstance(e, Copied)) < 2**20 / 200


@pytest.mark.parametrize("dp,pp", quick_only(sorted(SCENARIOS), [(4, 2)]))
def test_auto_switches_policies_mid_run_and_keeps_the_mathematics(tmp_path, dp, pp):
  """`auto` chooses at every failure (the choices themselves are checked against the
  simulator's in test_policy_layer.py); here the runtime carries them out: state moves between
  a re-routed grid and Bamboo's pipelines, both ways, and the run still trains what one device
  would (`run_policy` checks digests, losses and parameters)."""
  cfg, result, lines, decisions = run_policy(tmp_path, "auto", dp, pp)
  choices = [line.rsplit(": ", 1)[1] for line in lines if "auto: predicted" in line]
  assert len(choices) == decisions
  expected = {(2, 2): ["recycle", "bamboo"], (2, 4): ["recycle", "bamboo", "recycle"],
              (4, 2): ["recycle", "bamboo"]}[(dp, pp)]  # step 2: two workers at once
  assert choices == expected
  ran = {"recycle": "adaptive", "bamboo": "bamboo"}
  assert result.metrics[-1]["schedule"] == ran[choices[-1]]
  assert not [e for e in result.events if isinstance(e, Restored)]


@pytest.mark.parametrize("dp,pp", quick_only(sorted(SCENARIOS), [(2, 2)]))
def test_restart_survives_the_rerouting_scenarios(tmp_path, dp, pp):
  cfg, result, lines, decisions = run_policy(tmp_path, "restart", dp, pp,
                                             checkpoint__every_steps=1)
  restores = [e for e in result.events if isinstance(e, Restored)]
  assert len(restores) == decisions
  assert "resilience.policy=restart" in restores[0].reason
  assert all(0 < e.from_step < e.step for e in restores)  # a checkpoint, each time


@pytest.mark.parametrize("policy", quick_only(
  ["recycle", "naive", "oobleck", "bamboo", "restart", "auto"], ["recycle"]))
def test_a_stage_of_no_layers_survives_failures_under_every_policy(tmp_path, policy):
  """2 x 4 with layers 2,1,0,1: the empty stage's worker (1, 2) fails, its peer takes its
  micro-batches; then worker (0, 1) fails. Samples, losses and parameters stay one device's."""
  cfg = tiny_config(mesh__dp=2, mesh__pp=4, pipeline__partition="2,1,0,1",
                    pipeline__schedule="zb-h1", faults__schedule="2:1.2,3:0.1", train__steps=4,
                    resilience__policy=policy, checkpoint__every_steps=1)
  result = Trainer(cfg, tmp_path, log=lambda _: None).run()
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert result.metrics[1]["live_workers"] < 8
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)


def test_tied_head_is_reduced_by_name_across_different_splits(tmp_path):
  # A one-stage pipeline holds embedding and head in one slot, a two-stage one in two: the
  # tied gradient is summed over every holder of the name either way.
  base = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="oobleck", train__steps=2)
  cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, tied_head=True))
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  plan = PipelineSet(
    "mixed",
    (
      Pipeline(((0, 4),), (0,), (0, 1, 2), generate("1f1b", 1, 1, 3)),
      Pipeline(((0, 1), (1, 4)), (1, 2), (3, 4, 5, 6, 7), generate("zb-h1", 1, 2, 5)),
    ),
    4,
  )
  ex = Interpreter(trainer.run_state.programs, trainer.transport, plan)
  holders = [slot for slot in plan.slots if "embed.wte.embedding" in ex.params[slot]]
  assert holders == [(0, 0), (1, 0), (1, 1)]
  metrics = []
  for step in (1, 2):
    ids, batch = step_data(cfg, trainer.source, trainer.plan, step)
    result = ex.run_step(batch)
    metrics.append({"loss": result.loss})
    assert sorted(result.processed) == list(range(8))
  assert_matches_reference(metrics, ex.all_params(), cfg)
  tied = [np.asarray(ex.params[slot]["embed.wte.embedding"]) for slot in holders]
  for t in tied[1:]:
    np.testing.assert_array_equal(t, tied[0])


def test_bamboo_runs_the_redundant_forward_of_every_microbatch(tmp_path):
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="bamboo", train__steps=1)
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  ex = trainer.interpreter
  seen = []
  _, batch = step_data(cfg, trainer.source, trainer.plan, 1)
  ex.run_step(batch, after_op=lambda node, op: seen.append((node, op)))
  fr = [(n, op.mb) for n, op in seen if op.kind == FR]
  # Every worker runs its successor's forward of each of its pipeline's micro-batches.
  assert sorted(fr) == sorted((d * 2 + s, mb) for d in range(2) for s in range(2)
                              for mb in range(d * 4, d * 4 + 4))
  # Each replica equals its stage's state after the optimizer step.
  for (p, s), (params, _) in ex.replicas.items():
    r = (s + 1) % 2
    for n, v in params.items():
      np.testing.assert_array_equal(np.asarray(v), np.asarray(ex.params[(p, r)][n]))
  # And its cost shows in the fault-free plan: Bamboo's predicted step is longer.
  recycle = policies.stage_costs(cfg)
  from resilient_jax.schedule.cost import simulate

  grid = simulate(generate(cfg.pipeline.schedule, 2, 2, 4), recycle).makespan
  assert trainer.coordinator.predicted_makespan() > grid

  # Node 1 (stage 1 of pipeline 0) fails: node 0, its predecessor, runs that stage from then
  # on. Across processes, whether node 0's last refresh of its replica arrived before node 1
  # died is known to node 0's process only, so the hand-over every process computes alike
  # takes stage 1 from the lowest live node that holds it: node 2, whose replica of live node
  # 3's stage counts.
  old = ex.step_program
  ex.place(trainer.coordinator.fail({1}, 2).plan, ex.sources({1}), dead={1})
  assert [(src, dst) for src, dst, _ in ex.handover_transfers(old, {1})] == [(2, 0)]
  # Stage 1's buffers, whole: node 2 holds them in the layout node 0's new slot runs
  # (`StateHandover._wanted`: no program reads or packs them by name).
  split = old.slots[(0, 1)].split
  assert set(ex.handover_transfers(old, {1})[0][2]) == ex._keys(split, 1, whole=True)
  assert all(k.startswith("L") for k in ex._keys(split, 1, whole=True))

  # What the simulator prices is what ran. The profiled step after the failover runs exactly
  # the ops of the plan in force (node 0 now holds two slots); replayed with each stage's mean
  # measured op times it takes the step time the simulator's Bamboo policy predicts for the
  # same failure from those costs, on its own path (one pipeline per distinct damage).
  _, batch = step_data(cfg, trainer.source, trainer.plan, 2)
  records = ex.run_step(batch, step=2, profile=True).records
  sp = step_program(trainer.coordinator.plan)
  assert sorted((r.worker, r.op) for r in records) == sorted(
    (slot, op) for slot, prog in sp.slots.items() for op in prog.ops)
  assert {sp.slots[r.worker].node for r in records} == {0, 2, 3}
  measured = costs_from_records(records, 2)
  replayed = replay_program(sp, measured.duration).makespan
  sim = policies.build_policies(["bamboo"])["bamboo"]
  grid = policies.Grid(2, 2, cfg.pipeline.microbatches, cfg.pipeline.schedule)
  predicted = sim.step_time(grid, frozenset({(0, 1)}),
                            policies.AnalyticCosts(measured, trainer.coordinator.costs.profile))
  assert predicted == pytest.approx(replayed, rel=1e-9)
  # With every op's own time instead of its stage's mean (for the record: on simulated CPU
  # devices the two differ by the spread of op times, first runs on a new node included).
  print(f"bamboo after failover: predicted {predicted * 1e3:.2f} ms, replayed from measured op "
        f"times {replay_measured(sp, measured_durations(records)).makespan * 1e3:.2f} ms")


def test_failure_mid_step_leaves_committed_state_untouched(tmp_path):
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="oobleck", train__steps=1)
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  ex = trainer.interpreter
  before = {k: np.asarray(v) for k, v in ex.export_state()[0].items()}
  _, batch = step_data(cfg, trainer.source, trainer.plan, 1)

  def boom(node, op):
    if op.kind == "AR":
      raise WorkerLost(node)

  with pytest.raises(WorkerLost):
    ex.run_step(batch, after_op=boom)
  after = ex.export_state()[0]
  for k, v in before.items():
    np.testing.assert_array_equal(v, np.asarray(after[k]))


def test_place_copies_only_what_a_device_lacks(tmp_path):
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="oobleck")
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  ex: Interpreter = trainer.interpreter
  assert ex.place(ex.plan, ex.sources()) == 0  # the same plan: everything is already there
  held = {node: set() for node in ex.plan.nodes}
  sizes = {}
  for slot in ex.plan.slots:
    node = ex.plan.pipelines[slot[0]].nodes[slot[1]]
    held[node] |= set(ex.params[slot])
    sizes.update({n: v.nbytes for n, v in ex.params[slot].items()})
  plan = trainer.coordinator.fail({2}, 1).plan
  copied = ex.place(plan, ex.sources({2}))
  missing = [
    n
    for slot in plan.slots
    for n in ex.program(slot).param_names
    if n not in held[plan.pipelines[slot[0]].nodes[slot[1]]]
  ]
  assert missing  # the new split moved layers
  # A missing parameter brings its two AdamW moments: three arrays of its size.
  assert copied == 3 * sum(sizes[n] for n in missing)
  for slot in plan.slots:
    dev = ex.device(slot)
    assert all(v.devices() == {dev} for v in ex.params[slot].values())


def test_pipeline_set_checks_its_shape():
  sched = generate("1f1b", 1, 2, 2)
  ok = Pipeline(((0, 2), (2, 4)), (0, 1), (0, 1), sched)
  PipelineSet("x", (ok,), 4)
  with pytest.raises(ScheduleError, match="not 0..n-1"):
    PipelineSet("x", (ok, ok), 4)
  with pytest.raises(ScheduleError, match="contiguous"):
    Pipeline(((0, 2), (3, 4)), (0, 1), (0, 1), sched)
  with pytest.raises(ScheduleError, match="does not match"):
    Pipeline(((0, 4),), (0,), (0, 1), sched)
  other = Pipeline(((0, 2), (2, 4)), (1, 2), (2, 3), sched)
  with pytest.raises(ScheduleError, match="two pipelines"):
    PipelineSet("x", (ok, other), 4)


def test_bamboo_set_hosts_failed_stages_on_the_predecessor():
  plan = bamboo_set(2, 4, 2, [(0, 0), (1, 2)], partition=[(0, 1), (1, 2), (2, 3), (3, 4)])
  assert plan.pipelines[0].nodes == (3, 1, 2, 3)  # stage 0 on the last stage's node
  assert plan.pipelines[1].nodes == (4, 5, 5, 7)
  # Neither a host nor a failed stage keeps a replica; the others still do.
  assert [plan.pipelines[0].replica_of(s) for s in range(4)] == [None, 2, 3, None]
  assert [plan.pipelines[1].replica_of(s) for s in range(4)] == [1, None, None, 0]
  # Every slot's dependencies are met inside the plan: each op waits only on ops that exist.
  sp = step_program(plan)
  ops = {(slot, op) for slot, p in sp.slots.items() for op in p.ops}
  assert all(dep in ops for slot, op in ops for dep in sp.dependencies(slot, op))
  with pytest.raises(ScheduleError, match="failed together"):
    bamboo_set(2, 4, 2, [(1, 3), (1, 0)], partition=[(0, 1), (1, 2), (2, 3), (3, 4)])


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--config.resilience.policy=bamboo", "--config.mesh.pp=1"], "needs mesh.pp >= 2"),
    (["--config.resilience.policy=oobleck", "--config.distributed.enabled=true"],
     "distributed.enabled=true: coordinator_address should be defined"),
    (["--config.resilience.tolerate=-1"], "resilience.tolerate must be an integer >= 0"),
  ],
)
def test_bad_policy_settings_exit_2(tmp_path, flags, message):
  proc = run_launcher(
    "--config=configs/gpt_tiny.py:runlocal", f"--workdir={tmp_path}", *flags, timeout=60
  )
  assert proc.returncode == 2, proc.stderr
  assert message in proc.stderr
  assert "Traceback" not in proc.stderr


def test_config_rejects_unknown_policy():
  """A name that is no policy's is refused by the config; one that no policy is registered
  under, by the registry (at the CLI before JAX, and when the run starts)."""
  with pytest.raises(ConfigError, match="must be a policy's name"):
    tiny_config(resilience__policy="re cycle")
  with pytest.raises(ConfigError, match="is not one of recycle, naive, oobleck"):
    policies.check_config(tiny_config(resilience__policy="spares"))


def test_devices_hold_only_their_slots(tmp_path):
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="oobleck", train__steps=1)
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  used = {trainer.interpreter.device(s) for s in trainer.interpreter.local_slots}
  assert used == set(jax.devices()[:4])


@pytest.mark.slow  # resuming on another layout is in the quick subset (test_checkpoint.py)
def test_checkpoints_move_between_policies(tmp_path):
  # Saved by Oobleck's pipelines, resumed by Bamboo's grid: universal checkpoints by name.
  first = tiny_config(
    mesh__dp=2, mesh__pp=2, resilience__policy="oobleck", train__stop_after=2,
    checkpoint__every_steps=1,
  )
  done = Trainer(first, tmp_path, log=lambda _: None).run()
  assert [m["step"] for m in done.metrics] == [1, 2]
  second = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="bamboo")
  lines = []
  result = Trainer(second, tmp_path, log=lines.append).run()
  assert [s for s, _, _ in loaded_checkpoints(result)] == [2]
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(second)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), second)
