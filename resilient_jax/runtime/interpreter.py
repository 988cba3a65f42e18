"""The one op interpreter: runs a step of any plan (every policy) over a transport.

A plan is compiled to a `StepProgram` (`schedule/plan.py`): slots, each with a node, a layer
split, a stage and an op list with global micro-batch ids, and each micro-batch's route
through the slots. The interpreter holds the parameters and optimizer state of the slots on
this process's nodes and walks their op lists, dispatching an op as soon as the ops it depends
on have been dispatched and what it reads from another process has arrived (JAX's asynchronous
dispatch then overlaps the devices; `runtime/inbox.py` says why a device's queue must never
wait on another process). Everything that crosses a slot boundary goes through the
`Transport`: activations and activation gradients (`send`/`recv`), the gradient reductions
(`reduce`), and the end of the step (`conclude`: commit, or the set of nodes lost). The
in-process transport moves arrays between local devices; the multi-process one pulls them from
other processes and agrees on every collective and on the step's outcome through the
coordination service (`runtime/multiprocess.py`).

**Gradient reduction is keyed by parameter name.** Every parameter's gradient is summed over
every slot that holds it, whichever stage that is in its pipeline: a grid's stage group, a tied
embedding/head held by the first and last stages, or an Oobleck set whose pipelines cut the
model in different places. Names with the same holders share one collective; holders on one
device are added there first (a Bamboo node running two stages). A slot's `AR` finishes when
every group of its names is reduced, so each stage steps its optimizer as soon as its own
gradients are ready (the staggered optimizer ReCycle fills bubbles with).

Each op's dispatch is annotated for `jax.profiler` (`TraceAnnotation`: its name in the schedule,
`F3`, with stage, micro-batch and pipeline; always on: about half a microsecond an op when no
trace runs), beside the named scopes its programs carry on the device (`stages.py`).

New state is installed only when the step commits: a failure in the middle (`WorkerLost`
raised by the `after_op` hook in-process, or a lost peer in a multi-process job) leaves the
committed state untouched and the step is re-run on the new plan with the same samples.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import TraceAnnotation

from resilient_jax.compiled import Built, OnEachDevice
from resilient_jax.logs import info
from resilient_jax.model.sharding import Where, where_key
from resilient_jax.runtime.handover import Source, StateHandover
from resilient_jax.runtime.inbox import expect_inputs, transfer_in
from resilient_jax.runtime.transport import ACT, GRAD, Outcome, Transport
from resilient_jax.schedule.core import AR, BW, FR, OPT, B, F, Op, W
from resilient_jax.schedule.pipelines import LayerRange
from resilient_jax.schedule.plan import Plan, Slot, StepProgram, step_program
from resilient_jax.stages import StagePrograms

Params = dict[str, jax.Array]
ProgramsFor = Callable[[tuple[LayerRange, ...]], Sequence[StagePrograms]]
AfterOp = Callable[[int, Op], None]
"""Called with (node, op with its global micro-batch id) after each op is dispatched, and with
`Op(AR)` per slot inside its reduction; may raise `WorkerLost` to inject a failure."""


@dataclasses.dataclass
class OpRecord:
  """One executed op; times are host wall-clock seconds from the step start."""

  worker: Slot
  op: Op
  start: float
  end: float


@dataclasses.dataclass
class StepResult:
  loss: float
  microbatch_losses: dict[int, float]
  step_time_s: float
  records: list[OpRecord]
  """Per-op timings; filled only in profile mode (each op is then waited for)."""
  processed: list[int]
  """Micro-batch ids whose loss was computed (each exactly once when committed)."""
  dispatch_time_s: float = 0.0
  """Host time until every op was dispatched, before waiting for the devices (benchmarks)."""
  committed: bool = True
  lost: frozenset[int] = frozenset()
  """Nodes that died during the step (multi-process; the step did not commit)."""
  detected_at: float = 0.0
  """`time.time()` when the outcome was known."""
  grad_norm: float = 0.0
  """The global norm of the step's gradients, over every parameter once."""
  skipped: bool = False
  """The gradients were not finite: every stage kept its state (the step committed nothing)."""
  clipped: bool = False
  """Global-norm clipping scaled the gradients (each stage redid its optimizer step)."""
  attempts: int = 1
  """Attempts the step took (set by the training loop)."""
  stop: bool = False
  """A process asked to stop after this step (`Outcome.stop`)."""
  built: Built = Built()
  """What the attempt built; its seconds are not counted in `step_time_s` (set by the training
  loop)."""


class WorkerLost(Exception):
  """Raised by a fault hook when a node dies in the middle of a step."""

  def __init__(self, node: int):
    super().__init__(f"node {node} failed")
    self.node = node


@dataclasses.dataclass(frozen=True)
class _Group:
  """One reduction: the names `names`, summed over `holders`."""

  index: int
  holders: tuple[Slot, ...]
  names: tuple[str, ...]


class Interpreter(StateHandover):
  """Holds the state of this process's slots and runs steps.

  Args:
    programs_for: the stage programs of a layer split (cached by the caller).
    transport: how data crosses slot boundaries.
    plan: the plan to start with.
    state: where the state comes from (`place`); default the model's initial parameters.
    clip_global_norm: clip the gradients to this global norm (0: off).
    nonfinite: (step, stage) pairs whose gradients are made NaN on every replica before the
      optimizer step (`faults.nonfinite`: rehearses a diverging step, which the step skips).
    replicas: take the replicas a slot keeps of another stage (Bamboo) now, from other
      processes too; False in a process relaunched into a running job, whose peers offer
      nothing until they admit it (`place` takes them then).
  """

  def __init__(
    self,
    programs_for: ProgramsFor,
    transport: Transport,
    plan: Plan,
    state: Sequence[Source] | None = None,
    clip_global_norm: float = 0.0,
    nonfinite: Collection[tuple[int, int]] = (),
    replicas: bool = True,
  ):
    self._programs_for = programs_for
    self.transport = transport
    self.clip_global_norm = clip_global_norm
    self.nonfinite = frozenset(nonfinite)
    self.params: dict[Slot, Params] = {}
    self.opt_state: dict[Slot, Any] = {}
    self.replicas: dict[Slot, tuple[Params, Any]] = {}
    self._specs: dict[tuple, dict[str, Any]] = {}
    self._set_plan(plan)
    if state is not None:
      self.place(plan, state)
      return
    for slot in self.local_slots:
      prog, dev = self.program(slot), self.device(slot)
      self.params[slot] = prog.initial_params(dev)
      self.opt_state[slot] = prog.init_opt_state(self.params[slot], dev)
    if replicas:
      self._refresh_replicas()

  # ---------------------------------------------------------------- layout

  def _set_plan(self, plan: Plan) -> None:
    self.plan = plan
    self.step_program: StepProgram = step_program(plan)
    self.local_slots: list[Slot] = [
      s for s, p in sorted(self.step_program.slots.items()) if self.transport.is_local(p.node)
    ]
    self._groups = self._reduction_groups()
    # Each name's reduced gradient is the same on all its holders: its first holder counts it
    # into the global norm.
    owned: dict[Slot, list[str]] = {}
    for g in self._groups:
      owned.setdefault(g.holders[0], []).extend(g.names)
    self._owned: dict[Slot, dict[str, jax.Array]] = {
      s: self.program(s).norm_weights(owned.get(s, ()), self.device(s)) for s in self.local_slots
    }

  def programs(self, split: tuple[LayerRange, ...]) -> Sequence[StagePrograms]:
    return self._programs_for(split)

  def program(self, slot: Slot, sp: StepProgram | None = None) -> StagePrograms:
    p = (sp or self.step_program).slots[slot]
    return self.programs(p.split)[p.stage]

  def device(self, slot: Slot, sp: StepProgram | None = None) -> Where:
    """Where `slot`'s whole arrays go: its node's device, or replicated over its sub-mesh (the
    stage programs split parameter-shaped state over it, `StagePrograms.param_shardings`)."""
    return self.transport.device((sp or self.step_program).slots[slot].node)

  def node(self, slot: Slot) -> int:
    return self.step_program.slots[slot].node

  @property
  def devices(self) -> dict[int, Where]:
    """The device of every node of the current plan."""
    return {n: self.transport.device(n) for n in self.step_program.nodes}

  def _reduction_groups(self) -> list[_Group]:
    """Every parameter name's holders, grouped; in one global order (every process the same)."""
    holders: dict[str, list[Slot]] = {}
    for slot in sorted(self.step_program.slots):
      for n in self.program(slot).param_names:
        holders.setdefault(n, []).append(slot)
    by_holders: dict[tuple[Slot, ...], list[str]] = {}
    for n, hs in holders.items():
      by_holders.setdefault(tuple(hs), []).append(n)
    ordered = sorted(by_holders.items())
    return [_Group(i, hs, tuple(sorted(ns))) for i, (hs, ns) in enumerate(ordered)]

  # ---------------------------------------------------------------- state

  def sources(self, dead_nodes: set[int] = frozenset()) -> list[Source]:
    """Every state held on a live local node: the slots' own and the replicas."""
    from resilient_jax.checkpoint import universal

    out: list[Source] = []
    for slot in self.local_slots:
      if self.node(slot) in dead_nodes:
        continue
      dev = self.device(slot)
      out.append((dev, self.params[slot], universal.flatten_state(self.opt_state[slot])))
      if slot in self.replicas:
        params, opt = self.replicas[slot]
        out.append((dev, params, universal.flatten_state(opt)))
    return out

  def place(
    self,
    plan: Plan,
    sources: Sequence[Source],
    *,
    dead: frozenset[int] | set[int] = frozenset(),
    tag: tuple[int, int] = (0, 0),
  ) -> int:
    """Switches to `plan`, taking every local slot's state from `sources`; returns bytes copied.

    A slot uses an array already on its device when one exists, else copies one from another
    device (or host memory). With `dead` given, this is a hand-over after a failure: what no
    local source holds comes from a live node of another process that held it in the old plan
    (`Transport.exchange`, named by `tag`, the step and attempt of the failure).

    Raises:
      KeyError: no source holds a parameter or optimizer entry a slot needs.
    """
    from resilient_jax.checkpoint import universal

    old = self.step_program
    self._set_plan(plan)
    sources = list(sources)
    if dead and self.transport.remote_collectives:
      sources += self._handover(old, set(dead), sources, tag)
    params: dict[Slot, Params] = {}
    opt: dict[Slot, Any] = {}
    copied = 0

    def pick(key: str, dev: Where, table: int, prog: StagePrograms) -> jax.Array:
      nonlocal copied
      held = [src for src in sources if key in src[table]]
      if not held:
        what = "parameter" if table == 1 else "optimizer entry"
        raise KeyError(f"{what} {key!r} has no surviving replica")
      local = next((src for src in held if src[0] == dev), None)
      if local is not None:
        return local[table][key]
      value = held[0][table][key]
      if held[0][0] is not None:
        copied += value.nbytes
      put = prog.place_param if table == 1 else prog.place_opt_entry
      return put(key, value, dev)

    for slot in self.local_slots:
      prog, dev = self.program(slot), self.device(slot)
      params[slot] = {n: pick(n, dev, 1, prog) for n in prog.param_names}
      template = jax.eval_shape(prog.optimizer.init, prog.abstract_params())
      entries = {k: pick(k, dev, 2, prog) for k in universal.flatten_state(template)}
      opt[slot] = universal.unflatten_state(template, entries, what="optimizer state")
    self.params, self.opt_state = params, opt
    self._refresh_replicas(tag, channel=1)
    return copied

  def _refresh_replicas(self, tag: tuple[int, int] = (0, 0), channel: int = 2) -> None:
    """Every slot that runs FR gets a copy of its successor stage's current state (from
    another process if that stage's slot lives there)."""
    from resilient_jax.checkpoint import universal

    self.replicas = {}
    sp = self.step_program
    remote: list[tuple[int, int, list[str]]] = []
    specs: dict[str, Any] = {}
    for slot, p in sorted(sp.slots.items()):
      if p.replica is None:
        continue
      src = (slot[0], p.replica)
      src_node = sp.slots[src].node
      if self.transport.is_local(p.node) and self.transport.is_local(src_node):
        rep, dev = self.programs(p.split)[p.replica], self.device(slot)
        self.replicas[slot] = (jax.device_put(self.params[src], rep.param_shardings(dev)),
                               jax.device_put(self.opt_state[src], rep.opt_shardings(dev)))
      elif self.transport.is_local(p.node) or self.transport.is_local(src_node):
        keys = self._state_specs(p.split, p.replica)
        specs.update(keys)
        remote.append((src_node, p.node, sorted(keys)))
    if not remote:
      return
    # A source process that died after the step committed and before serving its state leaves
    # its successor's replica out (none is better than a stale one): the step that finds it
    # dead hands that stage's state over from a live data-parallel peer instead, and the FR
    # ops of the slot skip until the next refresh.
    got = self._exchange(remote, self.sources(), specs, channel=channel, tag=tag, lost_ok=True)
    for slot, p in sorted(sp.slots.items()):
      if p.replica is None or slot in self.replicas or not self.transport.is_local(p.node):
        continue
      dev = self.device(slot)
      arrived = next((src for src in got if src[0] == dev), None)
      if arrived is None:
        info(f"replica of stage {p.replica} on worker {slot} not refreshed: its source was "
             "lost; a failover takes that stage's state from a live peer")
        continue
      _, params, entries = arrived
      prog = self.programs(p.split)[p.replica]
      template = jax.eval_shape(prog.optimizer.init, prog.abstract_params())
      self.replicas[slot] = (
        {n: params[n] for n in prog.param_names},
        universal.unflatten_state(template, entries, what="replica state"),
      )

  def export_state(self) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """This process's parameters by global name and optimizer entries (universal layout), one
    holder each; arrays stay on their devices."""
    from resilient_jax.checkpoint import universal

    params: dict[str, jax.Array] = {}
    opt: list[dict[str, Any]] = []
    for slot in self.local_slots:
      params.update({k: v for k, v in self.params[slot].items() if k not in params})
      opt.append(universal.flatten_state(self.opt_state[slot]))
    return params, universal.merge(opt)

  def import_state(self, params: Mapping[str, Any], opt_entries: Mapping[str, Any]) -> None:
    """Loads universal-layout state (a checkpoint) into every local slot (any layout).

    Raises:
      KeyError: the state lacks a parameter or optimizer entry some slot needs.
    """
    for slot in self.local_slots:
      missing = [n for n in self.program(slot).param_names if n not in params]
      if missing:
        raise KeyError(f"parameter {missing[0]!r} is missing from the checkpoint")
    self.place(self.plan, [(None, dict(params), dict(opt_entries))])

  def stage_params(self, stage: int) -> Params:
    """Parameters of the first local slot of `stage`."""
    for slot in self.local_slots:
      if self.step_program.slots[slot].stage == stage:
        return self.params[slot]
    raise KeyError(f"no live slot holds stage {stage}")

  def all_params(self) -> dict[str, np.ndarray]:
    """Every local parameter by global name, fetched to the host."""
    return {k: np.asarray(v) for k, v in self.export_state()[0].items()}

  def warm_up(self, everything: bool = False) -> None:
    """Compiles every local slot's split backward (`B`, `W`) by running it once on zeros; with
    `everything`, its fused backward and optimizer step too.

    Fault-free schedules may use only the fused backward; the replanned schedule after a
    failure splits it, and compiling then would add to the recovery time. A process relaunched
    into a running job builds everything before it announces itself, so that its first step is
    not its slowest.
    """
    outs = []
    for slot in self.local_slots:
      prog, dev = self.program(slot), self.device(slot)
      zeros = lambda spec, dev=dev: jax.device_put(jnp.zeros(spec.shape, spec.dtype), dev)  # noqa: E731
      tgt = zeros(prog.target_spec) if prog.info.last else None
      seeds = zeros(jax.ShapeDtypeStruct((prog.input_spec.shape[0], 2), jnp.int32)) \
        if prog.uses_rng else None
      _, res, saved = prog.forward(self.params[slot], zeros(prog.input_spec), tgt, seeds)
      scalar = jax.ShapeDtypeStruct((), jnp.float32)
      g = zeros(scalar if prog.info.last else prog.output_spec)
      _, taps = prog.backward_input(res, g)
      params = self.params[slot]
      outs.append(prog.backward_weight(params, saved, taps, prog.zero_grads(params, dev)))
      if everything:
        _, grads = prog.backward_fused(res, saved, params, g, prog.zero_grads(params, dev))
        outs.append(prog.optimizer_step(params, self.opt_state[slot], grads, self._owned[slot]))
        for group in self._groups:  # the gradient all-reduce's own programs
          if slot in group.holders and len({self.device(h) for h in group.holders}) > 1:
            zero = prog.zero_grads(params, dev)
            outs += self.transport.prepare_reduce({dev: {n: zero[n] for n in group.names}})
    self.transport.wait(outs, "the warm-up of the split backward")

  # ---------------------------------------------------------------- one step

  def run_step(
    self,
    inputs: np.ndarray,
    targets: np.ndarray,
    *,
    step: int = 0,
    attempt: int = 0,
    profile: bool = False,
    after_op: AfterOp | None = None,
    seeds: np.ndarray | None = None,
  ) -> StepResult:
    """Runs one attempt at a step of the current plan.

    Args:
      inputs: token ids `[num_microbatches, microbatch_size, seq_len]`, by global id.
      targets: next-token targets, same shape.
      step, attempt: name the transfers and agreements of a multi-process job.
      profile: wait for every op to record its duration (serialises the devices).
      after_op: see `AfterOp`.
      seeds: `(step, sample id)` of every sample `[num_microbatches, microbatch_size, 2]`, for
        models that draw random numbers (dropout); see `recipe.sample_seeds`.

    Returns:
      The outcome; in a multi-process job it may be uncommitted, naming the nodes lost.
    """
    sp, tp = self.step_program, self.transport
    t0 = time.perf_counter()
    tp.begin(step, attempt, sp.nodes)
    residuals: dict[tuple[Slot, int], Any] = {}
    saved: dict[tuple[Slot, int], Any] = {}
    taps: dict[tuple[Slot, int], Any] = {}
    fr_in: dict[tuple[Slot, int], jax.Array] = {}
    losses: dict[int, jax.Array] = {}
    processed: list[int] = []
    acc: dict[Slot, Params] = {}
    new_state: dict[Slot, tuple[Params, Any]] = {}
    sumsq: list[jax.Array] = []
    records: list[OpRecord] = []

    def grads_of(slot: Slot) -> Params:
      if slot not in acc:
        acc[slot] = self.program(slot).zero_grads(self.params[slot], self.device(slot))
      return acc[slot]

    def seeds_of(prog: StagePrograms, mb: int, dev: Where) -> jax.Array | None:
      if not prog.uses_rng:
        return None
      if seeds is None:
        raise ValueError("the model draws random numbers: run_step needs per-sample seeds")
      return jax.device_put(seeds[mb], dev)

    def compute(slot: Slot, op: Op) -> list[jax.Array]:
      p = sp.slots[slot]
      progs = self.programs(p.split)
      prog, dev, s, mb, key = progs[p.stage], self.device(slot), p.stage, op.mb, (slot, op.mb)
      incoming = transfer_in(sp, prog, slot, op)
      if op.kind == F:
        x = jax.device_put(inputs[mb], dev) if incoming is None else tp.recv(*incoming, dev)
        tgt = jax.device_put(targets[mb], dev) if p.last else None
        out, residuals[key], saved[key] = prog.forward(self.params[slot], x, tgt,
                                                       seeds_of(prog, mb, dev))
        if p.last:
          losses[mb] = out
          processed.append(mb)
        else:
          tp.send((mb, s, ACT), out, sp.slots[sp.route[mb][s + 1]].node)
          if p.replica is not None:
            fr_in[key] = out
        return [out]
      if op.kind == FR:
        if slot not in self.replicas:  # its refresh lost the source (`_refresh_replicas`)
          return []
        r = p.replica
        x = jax.device_put(inputs[mb], dev) if p.last else fr_in.pop(key)
        tgt = jax.device_put(targets[mb], dev) if r == len(p.split) - 1 else None
        rep = progs[r]
        return [rep.forward(self.replicas[slot][0], x, tgt, seeds_of(rep, mb, dev))[0]]  # unread
      if op.kind == W:
        acc[slot] = prog.backward_weight(self.params[slot], saved.pop(key), taps.pop(key),
                                         grads_of(slot))
        return list(acc[slot].values())[:1]
      if op.kind not in (B, BW):
        raise ValueError(f"not a compute op: {op}")
      if incoming is None:  # the last stage: the loss's own gradient
        # From the host: `jnp.float32(1.0)` is a computation on the process's first device,
        # which would make this stage's backward wait for everything queued there.
        g = jax.device_put(np.float32(1.0), dev)
      else:
        g = tp.recv(*incoming, dev)
      if op.kind == B:
        dx, taps[key] = prog.backward_input(residuals.pop(key), g)
      else:
        dx, acc[slot] = prog.backward_fused(residuals.pop(key), saved.pop(key), self.params[slot],
                                            g, grads_of(slot))
      if dx is not None:
        tp.send((mb, s, GRAD), dx, sp.slots[sp.route[mb][s - 1]].node)
        return [dx]
      return list(jax.tree.leaves(taps[key]))[:1] if op.kind == B else list(acc[slot].values())[:1]

    def optimize(slot: Slot) -> tuple[Params, jax.Array]:
      # Optimistic: unclipped, checked against the global norm when the step concludes.
      grads = grads_of(slot)
      if (step, sp.slots[slot].stage) in self.nonfinite:
        grads = _make_nan(grads)
      stepped, opt_state, share = self.program(slot).optimizer_step(
        self.params[slot], self.opt_state[slot], grads, self._owned[slot])
      new_state[slot] = (stepped, opt_state)
      sumsq.append(share)
      return stepped, share

    def reduce(group: _Group) -> None:
      """Sums `group`'s names over its holders: on-device first, then one collective."""
      began = time.perf_counter() - t0
      for h in group.holders:
        ar_start.setdefault(h, began)  # an AR's record starts with its first collective
      per_dev: dict[Where, Params] = {}
      for h in group.holders:
        if h in self.params:
          dev, g = self.device(h), grads_of(h)
          part = {n: g[n] for n in group.names}
          per_dev[dev] = {n: per_dev[dev][n] + v for n, v in part.items()} if dev in per_dev \
            else part
      devices = tuple(sorted({self.device(h) for h in group.holders}, key=where_key))
      nodes = sorted({sp.slots[h].node for h in group.holders})
      if len(devices) > 1:
        per_dev = tp.reduce(group.index, nodes, devices, per_dev)
      for h in group.holders:
        if h in self.params:
          acc[h] = {**grads_of(h), **per_dev[self.device(h)]}

    local = set(self.local_slots)
    slot_groups = {s: [g for g in self._groups if s in g.holders] for s in local}
    group_done: set[int] = set()
    arrived: set[Slot] = set()
    pos = {s: 0 for s in local}
    done: set[tuple[Slot, Op]] = set()
    ar_start: dict[Slot, float] = {}

    def after(slot: Slot, op: Op) -> None:
      if after_op is not None:
        after_op(sp.slots[slot].node, op)

    # Every array a local op reads from another process is pulled now and the op dispatched
    # once it arrived (`runtime.inbox` says why).
    remote_in = expect_inputs(sp, self.program, self.device, tp, self.local_slots)

    def waits(slot: Slot, op: Op) -> bool:
      """Whether the op's dependencies are dispatched (those in other processes: not waited
      for; their data is)."""
      return all(d in done or d[0] not in local for d in sp.dependencies(slot, op))

    def ready(slot: Slot, op: Op) -> bool:
      key = remote_in.get((slot, op))
      return waits(slot, op) and (key is None or tp.arrived(key))

    def finish(slot: Slot, op: Op, start: float, outs: Any) -> None:
      if profile:
        jax.block_until_ready(outs)
        records.append(OpRecord(slot, op, start, time.perf_counter() - t0))
      done.add((slot, op))
      pos[slot] += 1

    remaining = [sum(len(sp.slots[s].ops) for s in local)]

    def complete(g: _Group) -> None:
      """Finishes the AR of every local holder of `g` whose groups are now all reduced (at
      once, so that a profiled AR ends when its collective does)."""
      for h in g.holders:
        if h in arrived and (h, Op(AR)) not in done and all(
          x.index in group_done for x in slot_groups[h]
        ):
          finish(h, Op(AR), ar_start[h], [acc.get(h)])
          remaining[0] -= 1
          after(h, Op(AR))

    def try_reduce(blocking_ok: bool) -> bool:
      """Runs every group whose local holders have all arrived at their AR; a group with
      holders on other processes only when `blocking_ok` (nothing else can be dispatched),
      in the global group order, so no two processes wait on each other."""
      ran = False
      for g in self._groups:
        if g.index in group_done or not any(h in local for h in g.holders):
          continue
        if not all(h in arrived for h in g.holders if h in local):
          if tp.remote_collectives:
            return ran  # keep the global order
          continue
        remote = any(h not in local for h in g.holders)
        if remote and not blocking_ok:
          return ran
        with TraceAnnotation("AR", group=g.index, stage=sp.slots[g.holders[0]].stage):
          reduce(g)
        group_done.add(g.index)
        complete(g)
        ran = True
      return ran

    while remaining[0]:
      progressed = False
      for slot in self.local_slots:
        ops = sp.slots[slot].ops
        while pos[slot] < len(ops) and ready(slot, ops[pos[slot]]):
          op = ops[pos[slot]]
          if op.kind == AR:
            if slot in arrived:
              break  # waiting for the other holders of its names
            arrived.add(slot)
            try_reduce(blocking_ok=False)
            progressed = True
            continue
          progressed = True
          start = time.perf_counter() - t0
          with TraceAnnotation(str(op), stage=sp.slots[slot].stage, mb=op.mb, pipeline=slot[0]):
            finish(slot, op, start, optimize(slot) if op.kind == OPT else compute(slot, op))
          if op.kind != OPT:
            after(slot, op)
          remaining[0] -= 1
      if not progressed:
        # Heads whose only missing input is on its way from another process.
        pending = [remote_in[h] for h in ((s, sp.slots[s].ops[pos[s]]) for s in local
                                          if pos[s] < len(sp.slots[s].ops))
                   if h in remote_in and waits(*h)]
        if pending:
          tp.wait_arrival(pending, f"step {step}'s activations and gradients from other "
                          "processes")
          continue
      if not progressed and not try_reduce(blocking_ok=True):
        heads = {s: str(sp.slots[s].ops[pos[s]]) for s in local if pos[s] < len(sp.slots[s].ops)}
        raise RuntimeError(f"plan {sp.name} cannot make progress; stuck at {heads}")
    dispatch_time = time.perf_counter() - t0

    outcome: Outcome = tp.conclude(losses, [p for p, _ in new_state.values()], sumsq)
    if not outcome.committed:
      return StepResult(0.0, {}, time.perf_counter() - t0, records, [], dispatch_time,
                        committed=False, lost=frozenset(outcome.lost),
                        detected_at=outcome.detected_at)
    norm = math.sqrt(outcome.grad_sumsq) if outcome.grad_sumsq >= 0 else math.nan
    skipped = not math.isfinite(norm)
    clipped = not skipped and 0 < self.clip_global_norm < norm
    if clipped:
      # Post-validation: every process knows the same global norm, so every stage redoes its
      # step with the same factor, from the committed state (the optimistic one is dropped).
      scale = jnp.float32(self.clip_global_norm / norm)
      for slot in new_state:
        new_state[slot] = self.program(slot).optimizer_step(
          self.params[slot], self.opt_state[slot], acc[slot], self._owned[slot],
          jax.device_put(scale, self.device(slot)))[:2]
    if not skipped:
      for slot, (params, opt_state) in new_state.items():
        self.params[slot], self.opt_state[slot] = params, opt_state
      self._refresh_replicas((step, attempt))
    elapsed = time.perf_counter() - t0
    mb_losses = outcome.losses
    return StepResult(
      loss=float(sum(mb_losses[mb] for mb in sorted(mb_losses))),
      microbatch_losses=mb_losses,
      step_time_s=elapsed,
      records=records,
      processed=sorted(mb_losses) if outcome.remote else processed,
      dispatch_time_s=dispatch_time,
      detected_at=outcome.detected_at,
      grad_norm=norm,
      skipped=skipped,
      clipped=clipped,
      stop=outcome.stop,
    )


_make_nan = OnEachDevice(lambda grads: jax.tree.map(lambda g: g * jnp.nan, grads))
"""`faults.nonfinite`'s injection: a stage's gradients, all NaN."""
