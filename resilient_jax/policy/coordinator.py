"""The run's coordinator: which nodes are alive, and what the policy in force runs on them.

It holds no JAX state and has no policy logic of its own, and names no policy: every decision
is one of the policy objects of `registry.build_policies`, the same ones the simulator drives,
asked through their protocol (`base.InPlacePolicy`: what it runs now, that plan as the runtime
runs it on the grid's nodes, its predicted step time, its log lines, why it cannot go on, and
whether it keeps its grid on a restore); a policy that chooses among others (`auto`) puts its
choice in force. Nodes are ints (devices
in a single-process run, processes in a multi-process job); the grid's worker `(d, s)` is
`grid_nodes[d * pp + s]`, and the policies see positions of that grid. On a failure (one node,
or a host's several at once) `fail` asks the policy in force and returns the `Decision`:

* `recycle` / `naive`: re-route the failed workers' micro-batches to their stage's peers and
  replan (`rerouting.py`); the global batch never changes.
* `oobleck`: re-instantiate the pipeline templates on the survivors (`templates.py`); the
  runtime then copies the layers a node lacks from surviving replicas.
* `bamboo`: a failed stage runs on its predecessor's node, from the replica it kept
  (`redundancy.py`).
* `restart`: restore the latest checkpoint onto the survivors (`restart.py`).
* `auto`: at each failure, the candidate expected to train the most until the next failure,
  switch costs included (`auto.py`), with recovery costs from the `resilience` keys in
  fault-free steps (`costs.recovery_params`).

`rejoin` is the mirror of `fail`: a worker back at a step's start returns to the policy in force
(`rejoin.py`: in place always; a restored, smaller layout grows back with a planned restart
only when that pays back before the next expected failure, else the node stays idle).

When the policy in force cannot go on (a stage lost every worker, a layer lost every replica,
two neighbouring Bamboo stages died) the decision is a restore onto a fresh layout of the
survivors: Oobleck's templates on all of them, else `restart.restore_layout`. Planning inputs
are deterministic (grid shape, failed set, FLOP-based costs), so any process would derive the
same plan: in a multi-process job every process does, and process 0 publishes its decision's
digest through the key-value store for the others to check theirs against (`exchange`,
`policy/shared.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from resilient_jax.config import FaultsConfig, MeshConfig, RunConfig
from resilient_jax.exit_codes import EXIT_NO_DEVICES
from resilient_jax.observe.events import Decided, EventLog, Failure, Rejoined
from resilient_jax.observe.logs import info
from resilient_jax.policy.base import Grid, Layout, Policy, Transition, plans_speeds
from resilient_jax.policy.costs import analytic_costs, even_partition, recovery_params
from resilient_jax.policy.phases import Phase, PhaseLog
from resilient_jax.policy.registry import build_policies, check_config
from resilient_jax.policy.rejoin import rejoin_choice
from resilient_jax.policy.restart import NoDevicesLeft, restore_layout
from resilient_jax.policy.shared import PlanExchange
from resilient_jax.schedule import codec
from resilient_jax.schedule.core import Schedule, Worker
from resilient_jax.schedule.cost import simulate
from resilient_jax.schedule.generators import generate
from resilient_jax.schedule.pipelines import PipelineSet
from resilient_jax.schedule.plan import Plan
from resilient_jax.schedule.routing import speed_scaled

"""Grids with more compute ops than this skip `validate` on the recovery path, and their step
time comes from the planner instead of a replay of every worker (tests and small grids validate
and replay every plan; the planners' output on large grids is validated in tests)."""


class StageLost(RuntimeError):
  """Every worker of a stage is dead and `resilience.restore_on_stage_loss` is false."""

  exit_code = EXIT_NO_DEVICES

  def __init__(self, stage: int, step: int):
    super().__init__(
      f"every worker of stage {stage} has failed (step {step}); its weights have no live "
      "replica, so training cannot continue by re-routing"
    )
    self.stage = stage
    self.step = step


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the runtime does next.

  Attributes:
    plan: the plan to run (every node in it is live).
    restore: load the latest checkpoint onto `plan` and redo the steps since. After a rejoin
      it is a planned restart: the caller saves the committed state first, so nothing is redone.
    reason: one line for the log when `restore`.
  """

  plan: Plan
  restore: bool
  reason: str = ""


class RunCoordinator(PhaseLog):
  """Live nodes and the plan the policy in force runs on them.

  Args:
    cfg: the run configuration (grid, base schedule, micro-batches, policy).
    nodes: the nodes the run may use, in order.
    log: where decisions are reported.
    events: where failures, rejoins and decisions are recorded (`observe.events`); None: a log
      of its own over `log`.
  """

  exchange: PlanExchange | None = None
  """In a multi-process job, how the planner process shares its decisions with the others (set
  by the runtime; `policy/shared.py`); None: every decision is made here."""

  def __init__(self, cfg: RunConfig, nodes: Sequence[int], log: Callable[[str], None] = info,
               events: EventLog | None = None):
    check_config(cfg)  # the policy is registered, and can serve this run
    self.cfg = cfg
    self.log = log
    self.events = events if events is not None else EventLog(log)
    self.live: set[int] = set(nodes)
    self.failed: list[tuple[int, int]] = []
    self.rejoined: list[tuple[int, int]] = []
    self.nodes = list(nodes)
    self.base = cfg.pipeline.schedule
    self.configured = cfg.resilience.policy
    self.planned = None
    """What the policy in force runs, in its own terms (a schedule, an Oobleck instance,
    Bamboo's failovers); None in a process that follows another's plans."""
    self._layout(cfg.mesh.dp, cfg.mesh.pp, list(nodes)[: cfg.mesh.num_workers])
    self.fault_free_makespan = self.predicted_makespan()
    self.phases: list[Phase] = [Phase(self.plan_name, self.live_count, 1.0)]
    # The configured grid, kept for pricing a rejoin that would grow a restored layout back:
    # restart's own step times and recovery on it, as the simulator prices the same move.
    self._origin = (self.grid, self.costs, self.policies["restart"], self._horizon,
                    {n: w for w, n in self._node_of().items()})

  # ---------------------------------------------------------------- layouts

  def _layout(self, dp: int, pp: int, nodes: Sequence[int]) -> None:
    """Makes a DP x PP grid on `nodes` the layout, with fresh policies and no failure."""
    cfg = self.cfg
    counts = cfg.pipeline.partition if pp == cfg.mesh.pp else ()
    self.layout = dataclasses.replace(
      cfg,
      mesh=MeshConfig(dp=dp, pp=pp),
      pipeline=dataclasses.replace(cfg.pipeline, partition=counts),
      faults=FaultsConfig(),  # named in the initial grid; this layout is only for planning
    )
    self.partition = (
      tuple((r.start, r.stop) for r in self.layout.partition) if counts
      else even_partition(cfg.model.num_layers, pp)
    )
    self.grid_nodes = list(nodes)
    self._positions: dict[Worker, int] | None = None
    # With `resilience.pieces` the re-routing planner may cut micro-batches into pieces of
    # their samples (`Grid.samples`); else it moves whole micro-batches only.
    samples = cfg.step_batch // (dp * cfg.step_microbatches) if cfg.resilience.pieces else 1
    self.grid = Grid(dp, pp, cfg.step_microbatches, self.base,
                     cfg.resilience.memory_cap or None, cfg.step_batch, samples=samples)
    self.costs = analytic_costs(self.layout, self.partition)
    self.dead: frozenset[Worker] = frozenset()
    # One pipeline has the grid's fault-free makespan (the pipelines only meet in each stage's
    # all-reduce, which costs the same whatever their number) at 1/dp of the replay's cost.
    fault_free = simulate(generate(self.base, 1, pp, self.grid.m), self.costs.op).makespan
    self.policies = build_policies(
      params=recovery_params(cfg, fault_free),
      tolerate=cfg.resilience.tolerate,
      min_pipeline_nodes=cfg.resilience.min_pipeline_nodes,
    )
    self.chosen: Policy = self.policies[self.configured]
    """The configured policy (`resilience.policy`); the one in force, `active`, is the same,
    or its choice when it chooses (`auto`)."""
    self._horizon = cfg.resilience.mean_steps_between_failures * fault_free
    if self.chosen.chooses:
      self.chosen.reset(self._horizon)
      self.chosen.step_time(self.grid, self.dead, self.costs)  # chooses the fault-free one
      self.active: Policy = self.chosen.current
    else:
      self.active = self.chosen
    self.planned = None
    self._apply(self._plan_of(self.active, switched=True))

  def _plan_of(self, policy: Policy, *, switched: bool):
    """What `policy` runs on the grid with `self.dead` down; None where it cannot go on.

    `switched`: `policy` was not the one running (it plans afresh rather than from what ran).
    """
    return policy.runs(self.grid, self.dead, self.costs, self.planned, switched=switched)

  def _view(self) -> Layout:
    return Layout(self.grid, self.partition, self.cfg.model.num_layers, self.grid_nodes,
                  self._node_of(), frozenset(self.live))

  def _apply(self, planned) -> None:
    """Makes `planned` (what `_plan_of` returned for the policy in force) the current plan."""
    self.planned = planned
    self._plan = self.active.runtime_plan(planned, self._view(), self.costs)

  # ---------------------------------------------------------------- what runs now

  @property
  def policy(self) -> str:
    """The name of the policy in force (for `auto`, the candidate it chose)."""
    return self.active.name

  @property
  def plan(self) -> Plan:
    return self._plan

  @property
  def schedule(self) -> Schedule:
    """The grid plan's schedule (a pipeline set has none)."""
    return self._plan.schedule

  def _node_of(self) -> dict[Worker, int]:
    # Built once per layout (read-only for its callers): rebuilding it on every call costs
    # O(workers), several times per failure.
    if self._positions is None:
      pp = self.grid.pp
      self._positions = {divmod(i, pp): n for i, n in enumerate(self.grid_nodes)}
    return self._positions

  @property
  def plan_name(self) -> str:
    return self.policy if isinstance(self._plan, PipelineSet) else self._plan.schedule.name

  @property
  def live_count(self) -> int:
    if isinstance(self._plan, PipelineSet):
      return len(self._plan.nodes)
    return len(self._plan.schedule.ops)

  def plan_text(self) -> str:
    return self.plan.to_text()

  def predicted_makespan(self) -> float:
    """The cost model's step time of the current plan, in block units (a replay of every
    worker on a small grid, the touched pipelines' plan's on a large one: the same number)."""
    return self.active.planned_step_time(self.grid, self.dead, self.costs, self.planned)

  # ---------------------------------------------------------------- failures

  def fail(self, nodes: Collection[int], step: int, *, mid_step: bool = False,
           key: str | None = None) -> Decision:
    """Marks `nodes` dead and decides what runs next.

    Args:
      nodes: the nodes lost.
      step: the step they were lost at (or before).
      mid_step: lost during the step rather than at its start (for the log).
      key: in a multi-process job, the event's key under which the planner process publishes
        the decision and the others read it (`policy/shared.py`); None: decide here (a
        single-process run, or a relaunched process replaying the history).

    Raises:
      StageLost: a stage lost every worker and `resilience.restore_on_stage_loss` is false.
      NoDevicesLeft: no plan fits on the survivors.
    """
    new = sorted(n for n in nodes if n in self.live)
    if not new:
      return Decision(self.plan, False)
    position = {n: w for w, n in self._node_of().items()}
    for n in new:
      self.live.discard(n)
      self.failed.append((step, n))
      self.events.emit(Failure(step, n, position.get(n), mid_step))
    workers = frozenset(position[n] for n in new if n in position)
    if not workers:
      return Decision(self.plan, False)
    return self._decided(key, lambda: self._replan(workers, new, step))

  def _replan(self, workers: frozenset[Worker], new: list[int], step: int) -> Decision:
    """`fail`'s decision, once `workers` (of `new` nodes) are marked lost."""
    before = self.predicted_makespan()
    old_dead, self.dead = self.dead, self.dead | workers
    if self.active.reroutes:
      lost = self._lost_stage(workers, step)
      if lost is not None:
        return self._restore(lost, step)
    previous = self.active
    if self.chosen.chooses:
      self._choose(Transition(self.grid, old_dead, self.dead, self.costs, before))
    planned = self._plan_of(self.active, switched=self.active is not previous)
    if planned is None:
      return self._restore(self._why_not(new, step), step)
    self._apply(planned)
    self._report(workers if self.active is previous else self.dead)
    self._decided_event(step, before)
    self._new_phase(self.plan_name, self.live_count, self._relative_step_time(), step)
    return Decision(self.plan, False)

  def _decided_event(self, step: int, before: float, *, line: bool = True) -> None:
    """Records the plan now in force and its predicted step time against `before`'s."""
    after = self.predicted_makespan()
    self.events.emit(Decided(step, self.policy, self.plan_name, self.live_count, after / before,
                             after / self.fault_free_makespan), line=line)

  def _relative_step_time(self) -> float:
    """The predicted step time relative to the fault-free plan's."""
    return self.predicted_makespan() / self.fault_free_makespan

  # ---------------------------------------------------------------- stragglers

  def reweigh(self, speeds: Mapping[Worker, float], step: int, *, key: str | None = None
              ) -> Decision:
    """Puts the measured `speeds` of slow workers (positions of the grid; those absent run at
    full speed) in force from the start of `step`, and replans when the policy in force
    re-weights (`plans_speeds`: recycle and naive move work off a straggler in proportion);
    another policy keeps its plan, which runs at the slow worker's pace (the log says so).
    `key`: as for `fail`.
    """
    grid = self.grid.with_speeds(speeds, self.dead)
    if grid.speeds == self.grid.speeds:
      return Decision(self.plan, False)
    return self._decided(key, lambda: self._reweighed(grid, step))

  def _reweighed(self, grid: Grid, step: int) -> Decision:
    """`reweigh`'s decision on `grid` (the current one with the new speeds)."""
    old = self.planned if isinstance(self.planned, Schedule) else None
    self.grid = grid
    if not self.active.reweights or (grid.speeds and not plans_speeds(self.active, grid)):
      self.log(f"  {self.policy} does not re-weight stragglers (on this grid): its plan runs at "
               "the slow worker's pace")
      return Decision(self.plan, False)
    op = self.costs.op_costs(grid.live_per_stage(self.dead))
    before = (simulate(old, speed_scaled(op, grid.speeds), comm=op.comm).makespan
              if old is not None else self.predicted_makespan())
    planned = self._plan_of(self.active, switched=False)
    if planned is None:  # cannot happen while no stage is lost: keep what runs
      return Decision(self.plan, False)
    self._apply(planned)
    after = self.predicted_makespan()
    if isinstance(planned, Schedule):
      loads = {w: len(planned.microbatches_of(w)) for w, _ in grid.speeds}
      for (d, s), v in grid.speeds:
        self.log(f"  re-weighted: (dp={d}, stage={s}) at speed {v:.2f} keeps {loads[(d, s)]} of "
                 f"{self.grid.m} micro-batches; its stage's peers take the rest")
    why = "for the measured speeds" if grid.speeds else "with every worker at full speed"
    self.log(f"  replanned with the {self.plan_name} planner {why}: predicted step time "
             f"x{after / before:.2f} of the plan before at these speeds")
    self._decided_event(step, before, line=False)
    self._new_phase(self.plan_name, self.live_count, after / self.fault_free_makespan, step,
                    event="straggler")
    return Decision(self.plan, False)

  # ---------------------------------------------------------------- rejoins

  @property
  def down_nodes(self) -> set[int]:
    """The run's nodes that are not live now (failed, not rejoined)."""
    return set(self.nodes) - self.live

  def rejoin(self, nodes: Collection[int], step: int, *, key: str | None = None) -> Decision:
    """Marks `nodes` live again at the start of `step` and decides what runs next (the mirror
    of `fail`; the rule is `rejoin.rejoin_choice`, the simulator's too).

    A node of the current grid goes back to the policy in force: recycle/naive replan for the
    failures that remain (the fault-free plan when none do), oobleck re-instantiates from its
    fault-free instance without the remaining failures (so on every live node it can cover),
    bamboo drops the failovers it no longer needs, auto re-decides. A node outside the current
    grid (the layout shrank at a restore) grows the layout back with a planned restart
    (`Decision.restore`) when restart's pricing on the configured grid says that pays back
    before the next expected failure; otherwise it stays idle (live, in no plan), which the log
    says, until a later event re-lays the job out.

    Raises:
      ValueError: a node that is not one of the run's.
    """
    unknown = sorted(set(nodes) - set(self.nodes))
    if unknown:
      raise ValueError(f"nodes {unknown} are not nodes of this run {self.nodes}")
    new = sorted(n for n in nodes if n not in self.live)
    if not new:
      return Decision(self.plan, False)
    position = {n: w for w, n in self._node_of().items()}
    origin = self._origin[4]
    for n in new:
      self.live.add(n)
      self.rejoined.append((step, n))
      self.events.emit(Rejoined(step, n, position.get(n, origin.get(n, (None, None)))))
    workers = frozenset(position[n] for n in new if n in position) & self.dead
    outside = [n for n in new if n not in position]
    if not workers and not outside:
      return Decision(self.plan, False)
    return self._decided(key, lambda: self._take_in(workers, outside, step))

  def _take_in(self, workers: frozenset[Worker], outside: list[int], step: int) -> Decision:
    """`rejoin`'s decision: `workers` (positions of the grid) back, `outside` nodes grow it."""
    decision = Decision(self.plan, False)
    if workers:
      decision = self._take_back(workers, step)
    if outside and not decision.restore:
      decision = self._grow(outside, step)
    return decision

  def _take_back(self, workers: frozenset[Worker], step: int) -> Decision:
    """The policy in force takes `workers` (dead positions of the current grid) back."""
    before = self.predicted_makespan()
    old_dead, self.dead = self.dead, self.dead - workers
    t = Transition(self.grid, old_dead, self.dead, self.costs, before)
    deciding = self.chosen if self.chosen.chooses else self.active
    choice = rejoin_choice(deciding, t, self._horizon)
    if deciding.chooses:
      self.log(f"  {deciding.name}: {choice.describe()}; {deciding.current.name} in force")
      self.active = deciding.current
    if not choice.take:
      self.dead = old_dead
      self.log(f"  workers {sorted(workers)} stay idle: {choice.describe()}")
      return Decision(self.plan, False)
    planned = self._plan_of(self.active, switched=True)
    if planned is None:  # restart in force (auto's choice) while failures remain, or oobleck's
      # layers still lack a replica: a fresh layout on the live nodes, entered as a planned
      # restart (the caller checkpoints first)
      return self._restore(f"{self.policy} re-lays the job out on the live nodes at the rejoin "
                           f"at step {step}", step)
    self._apply(planned)
    self._report(workers, rejoin=True)
    self._decided_event(step, before)
    self._new_phase(self.plan_name, self.live_count, self._relative_step_time(), step,
                    event="rejoin")
    return Decision(self.plan, False)

  def _grow(self, outside: list[int], step: int) -> Decision:
    """`outside` (live nodes in no plan) grow the layout back, or stay idle (see `rejoin`)."""
    grid0, costs0, restart, horizon0, origin = self._origin
    after = frozenset(origin[n] for n in self.nodes if n not in self.live and n in origin)
    idle = set(self.live) - set(self.grid_nodes)
    before = after | frozenset(origin[n] for n in idle if n in origin)
    t = Transition(grid0, before, after, costs0, restart.step_time(grid0, before, costs0))
    choice = rejoin_choice(restart, t, horizon0)
    alive = [n for n in self.nodes if n in self.live]
    dp, pp = restore_layout(grid0, len(alive), self.cfg.model.num_layers,
                            min_pp=self.chosen.min_pp)
    if not choice.take or dp * pp <= self.grid.workers:
      why = choice.describe() if not choice.take else "no larger layout fits the live nodes"
      self.log(f"  nodes {outside} stay idle outside the dp={self.grid.dp} pp={self.grid.pp} "
               f"layout: {why}")
      return Decision(self.plan, False)
    self._layout(dp, pp, alive[: dp * pp])
    ratio = self.predicted_makespan() / self.fault_free_makespan
    self.log(f"  {choice.describe()} (restart's step times on the configured grid)")
    self._new_phase(self.plan_name, self.live_count, ratio, step, event="rejoin")
    return Decision(self.plan, True, f"growing the layout to dp={dp} pp={pp} with the nodes "
                    f"that rejoined at step {step}")

  def _lost_stage(self, workers: frozenset[Worker], step: int) -> str | None:
    """Why re-routing cannot go on (a stage lost every worker), or None.

    Raises:
      StageLost: when so and `resilience.restore_on_stage_loss` is false.
    """
    live = self.grid.live_per_stage(self.dead)
    for _, s in sorted(workers):
      if not live[s]:
        if not self.cfg.resilience.restore_on_stage_loss:
          raise StageLost(s, step)
        return str(StageLost(s, step))
    return None

  def _why_not(self, new: list[int], step: int) -> str:
    return self.active.why_not(self.dead, new, step, self.configured)

  def _choose(self, t: Transition) -> None:
    """A choosing policy (`auto`): the candidate expected to train the most until the next
    failure takes over."""
    chooser = self.chosen
    chooser.recovery(t)
    options = ", ".join(f"{p.name} {p.step_time(t.grid, t.after, t.costs):.1f}"
                        for p in chooser.usable(t.grid, t.costs))
    self.log(f"  {chooser.name}: predicted step times (block units) {options}: "
             f"{chooser.current.name}")
    self.active = chooser.current

  def _report(self, workers: frozenset[Worker], *, rejoin: bool = False) -> None:
    """The log lines of what the policy in force did about `workers` (lost, or back)."""
    for line in self.active.report(self.planned, self._plan, self._view(), workers, self.dead,
                                   rejoin=rejoin):
      self.log(line)

  def _restore(self, reason: str, step: int) -> Decision:
    """A fresh layout on every survivor, to restore the latest checkpoint onto."""
    alive = sorted(self.live)
    position = {n: i for i, n in enumerate(self.grid_nodes)}
    planned = self.chosen.restore_on(self.grid, self.costs,
                                     [position[n] for n in alive if n in position])
    if planned is not None:  # the policy keeps its grid (Oobleck: a fresh instance on it)
      self._apply(planned)
    else:
      dp, pp = restore_layout(self.grid, len(alive), self.cfg.model.num_layers,
                              min_pp=self.chosen.min_pp)
      self._layout(dp, pp, alive[: dp * pp])
    ratio = self.predicted_makespan() / self.fault_free_makespan
    self._new_phase(self.plan_name, self.live_count, ratio, step)
    return Decision(self.plan, True, reason)


  # ---------------------------------------------------------------- one planner per job

  def _decided(self, key: str | None, decide: Callable[[], Decision]) -> Decision:
    """`decide()` here; in a multi-process job (`exchange` set and a `key`) every process
    decides alike (the planners are deterministic, and every process has seen the same agreed
    events), the planner process publishes its decision's digest under `key`, and the others
    check theirs against it (`policy/shared.py`). Either way the caller gets the same
    `Decision`."""
    exchange = self.exchange
    if key is None or exchange is None:
      return decide()
    if not exchange.planner:
      return self._checked(key, decide)
    t0, phases = time.perf_counter(), len(self.phases)
    try:
      decision = decide()
    except StageLost as e:
      exchange.publish(key, codec.to_bytes({"lost_stage": [e.stage, e.step]}))
      raise
    except NoDevicesLeft as e:
      exchange.publish(key, codec.to_bytes({"no_devices": str(e)}))
      raise
    except Exception as e:  # a bug: the others stop too, rather than at their wait's bound
      exchange.publish(key, codec.to_bytes({"planner_error": f"{type(e).__name__}: {e}"}))
      raise
    raw = codec.to_bytes({"digest": self._digest(decision, phases)})
    exchange.publish(key, raw)
    self.log(f"  plan: decided in {time.perf_counter() - t0:.3f}s, its digest published as "
             f"{key} ({len(raw)} bytes)")
    return decision

  def _checked(self, key: str, decide: Callable[[], Decision]) -> Decision:
    """A follower's decision: its own, checked against the digest the planner published."""
    t0, phases = time.perf_counter(), len(self.phases)
    try:
      decision = decide()
      mine = self._digest(decision, phases)
    except (StageLost, NoDevicesLeft):
      raise  # the planner reaches the same end (and publishes it)
    raw = self.exchange.read(key)
    shared = codec.from_bytes(raw)
    if "planner_error" in shared:
      raise RuntimeError(f"the planner process failed to decide {key}: "
                         f"{shared['planner_error']}")
    if shared.get("digest") != mine:
      raise RuntimeError(f"this process's decision {key} differs from the planner's "
                         f"({shared}): the planning is not deterministic (a bug)")
    self.log(f"  plan: decided in {time.perf_counter() - t0:.3f}s, the same as the planner's "
             f"(its digest, {len(raw)} bytes)")
    return decision

  def _digest(self, decision: Decision, phases: int) -> str:
    """What a decision is, every process the same: its plan (as `schedule/codec.py` encodes
    it), restore, reason, the policy in force, the layout, partition and failed workers, and the
    phase it started (of `self.phases` past the first `phases`)."""
    new_phase = self.phases[-1] if len(self.phases) > phases else None
    return codec.digest({
      "plan": codec.encode_plan(decision.plan),
      "restore": decision.restore,
      "reason": decision.reason,
      "policy": self.active.name,
      "layout": [self.grid.dp, self.grid.pp, codec.runs(self.grid_nodes)],
      "partition": [list(r) for r in self.partition],
      "dead": sorted(map(list, self.dead)),
      "phase": None if new_phase is None else [
        new_phase.schedule_name, new_phase.live, new_phase.predicted_ratio,
        new_phase.failure_step, new_phase.event],
    })
