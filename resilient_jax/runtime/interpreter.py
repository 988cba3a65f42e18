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

One attempt at a step is a `StepRun` (`runtime/step_run.py`): its state and its ops, dispatched
by one thread (`runtime/dispatch.py`, which says why one). An evaluation's attempt
(`run_forward`) is the same `StepRun` on the plan's forward ops only (`ForwardOnly`).

Each op's dispatch is annotated for `jax.profiler` (`TraceAnnotation`: its name in the schedule,
`F3`, with stage, micro-batch and pipeline; always on: about half a microsecond an op when no
trace runs), beside the named scopes its programs carry on the device (`stages.py`).

New state is installed only when the step commits: a failure in the middle (`WorkerLost`
raised by the `after_op` hook in-process, or a lost peer in a multi-process job) leaves the
committed state untouched and the step is re-run on the new plan with the same samples.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resilient_jax.model.sharding import Where, where_key
from resilient_jax.observe.logs import info
from resilient_jax.observe.records import StepResult
from resilient_jax.programs.stages import StagePrograms
from resilient_jax.runtime.dispatch import dispatch
from resilient_jax.runtime.handover import Source, StateHandover, same_layout
from resilient_jax.runtime.step_run import (
  AfterOp,
  DispatchList,
  Holder,
  ReductionGroup,
  StepRun,
  local_dispatch_lists,
)
from resilient_jax.runtime.transport import Transport
from resilient_jax.schedule.core import Op, Piece
from resilient_jax.schedule.pipelines import LayerRange
from resilient_jax.schedule.plan import Plan, Slot, StepProgram, step_program
from resilient_jax.spec.faults import Slowdown

Params = dict[str, jax.Array]
ProgramsFor = Callable[..., Sequence[StagePrograms]]
"""`programs_for(split)`: the stage programs of a layer split at the micro-batch size;
`programs_for(split, samples)`: at `samples` samples a micro-batch (a piece's)."""
__all__ = ["AfterOp", "Interpreter"]


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
    slowdowns: `faults.slow`: from a step on, a slot's ops take that many times as long
      (rehearses a straggler, `training/stragglers.py`; `step_run._stretch`).
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
    slowdowns: Collection[Slowdown] = (),
    replicas: bool = True,
  ):
    self._programs_for = programs_for
    self.transport = transport
    self.clip_global_norm = clip_global_norm
    self.nonfinite = frozenset(nonfinite)
    self.slowdowns = tuple(slowdowns)
    self.params: dict[Slot, Params] = {}
    self.opt_state: dict[Slot, Any] = {}
    self.replicas: dict[Slot, tuple[Params, Any]] = {}
    self._specs: dict[tuple, dict[str, Any]] = {}
    self._layouts = {}
    self._loss_seeds: dict[Where, jax.Array] = {}
    self._forward: ForwardOnly | None = None
    self._piece_programs: dict[tuple, StagePrograms] = {}
    self._set_plan(plan)
    if state is not None:
      self.place(plan, state)
      return
    for slot in self.local_slots:
      prog, dev = self.program(slot), self.device(slot)
      self.params[slot] = prog.initial_params(dev)
      self.opt_state[slot] = prog.init_opt_state(self.params[slot], dev)
    if replicas:
      self.refresh_replicas()

  # ---------------------------------------------------------------- layout

  def _set_plan(self, plan: Plan) -> None:
    self.plan = plan
    self.step_program: StepProgram = step_program(plan)
    self.local_slots: list[Slot] = [
      s for s, p in sorted(self.step_program.slots.items()) if self.transport.is_local(p.node)
    ]
    self.groups = self._reduction_groups()
    for slot in self.local_slots:  # each stage program, once built, loads on its replicas ahead
      for program in self.program(slot).compiled_programs():
        program.expect(self.device(slot))
    self.dispatch_lists: dict[Slot, DispatchList] = local_dispatch_lists(self, self.local_slots)
    # Each name's reduced gradient is the same on all its holders: its first holder counts it
    # into the global norm.
    owned: dict[Slot, list[str]] = {}
    for g in self.groups:
      owned.setdefault(g.holders[0], []).extend(g.names)
    self.owned: dict[Slot, dict[str, jax.Array]] = {
      s: self.program(s).norm_weights(owned.get(s, ()), self.device(s)) for s in self.local_slots
    }
    self.owned_apart: dict[Slot, tuple[str, ...]] = {
      s: self.program(s).owned_apart(owned.get(s, ())) for s in self.local_slots}
    """Per slot, the names it counts into the norm apart from its OPT (`owned_apart`)."""

  def loss_seed(self, where: Where) -> jax.Array:
    """The loss's own gradient, 1, at `where` (the last stage's backward starts from it); made
    once per device, not per micro-batch."""
    if where not in self._loss_seeds:
      self._loss_seeds[where] = jax.device_put(np.float32(1.0), where)
    return self._loss_seeds[where]

  def programs(self, split: tuple[LayerRange, ...]) -> Sequence[StagePrograms]:
    return self._programs_for(split)

  def program(self, slot: Slot, sp: StepProgram | None = None) -> StagePrograms:
    p = (sp or self.step_program).slots[slot]
    return self.programs(p.split)[p.stage]

  def op_program(self, slot: Slot, op: Op) -> StagePrograms:
    """The programs `op` runs on `slot`: its stage's, or for a piece of a micro-batch
    (`core.Piece`) the same stage's built for the piece's samples (another batch dimension:
    the loss stays weighted over the global batch, so a piece's loss and gradients are its
    rows' share). Those are built and compiled on the first op of a plan with pieces, i.e. in
    the first attempt after the failure that split a micro-batch (`programs_for` keeps them)."""
    if not isinstance(op, Piece):
      return self.program(slot)
    p = self.step_program.slots[slot]
    rows = op.hi - op.lo
    key = (p.split, p.stage, rows)
    prog = self._piece_programs.get(key)
    if prog is None:
      prog = self._programs_for(p.split, rows)[p.stage]
      whole = self.program(slot)
      crossing = [("input", prog.input_spec, whole.input_spec)] if p.stage > 0 else []
      if not p.last:
        crossing.append(("output", prog.output_spec, whole.output_spec))
      for name, a, b in crossing:
        if a.shape[:1] != (rows,) or a.shape[1:] != b.shape[1:]:
          raise ValueError(f"stage {p.stage}'s {name} {b.shape} does not carry the batch in "
                           "its leading dimension: its micro-batches cannot run in pieces")
      self._piece_programs[key] = prog
    return prog

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

  def _reduction_groups(self) -> list[ReductionGroup]:
    """Every parameter name's holders, grouped; in one global order (every process the same)."""
    holders: dict[str, list[Slot]] = {}
    for slot in sorted(self.step_program.slots):
      for n in self.program(slot).param_names:
        holders.setdefault(n, []).append(slot)
    by_holders: dict[tuple[Slot, ...], list[str]] = {}
    for n, hs in holders.items():
      by_holders.setdefault(tuple(hs), []).append(n)
    ordered = sorted(by_holders.items())
    return [ReductionGroup(i, hs, tuple(sorted(ns)),
                           all(len(self.program(h).param_names) == len(ns) for h in hs))
            for i, (hs, ns) in enumerate(ordered)]

  # ---------------------------------------------------------------- state

  def sources(self, dead_nodes: set[int] = frozenset()) -> list[Source]:
    """Every state held on a live local node: the slots' own and the replicas."""
    out: list[Source] = []
    for slot in self.local_slots:
      if self.node(slot) in dead_nodes:
        continue
      dev = self.device(slot)
      out.append((dev, self.params[slot], self.program(slot).opt_entries(self.opt_state[slot])))
      if slot in self.replicas:
        params, opt = self.replicas[slot]
        p = self.step_program.slots[slot]
        out.append((dev, params, self.programs(p.split)[p.replica].opt_entries(opt)))
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
    entries: dict[Slot, dict[str, Any]] = {}
    copies: list[tuple[dict[str, Any], str, Any, Where]] = []  # (into, key, value, where)
    copied = 0

    def pick(key: str, dev: Where, table: int, prog: StagePrograms, into: dict) -> None:
      nonlocal copied
      held = [src for src in sources if key in src[table]]
      if not held:
        what = "parameter" if table == 1 else "optimizer entry"
        raise KeyError(f"{what} {key!r} has no surviving replica")
      local = next((src for src in held if src[0] == dev), None)
      if local is not None:
        into[key] = local[table][key]
        return
      value = held[0][table][key]
      if held[0][0] is not None:
        copied += value.nbytes
      copies.append((into, key, value, prog.param_sharding(key, dev) if table == 1 else
                     prog.opt_entry_sharding(key, value.shape, dev)))

    whole: dict[Slot, tuple[Any, Any]] = {}
    for slot in self.local_slots:
      prog, dev = self.program(slot), self.device(slot)
      if prog.packed:  # a holder of the same layout: its buffers, copied whole if at all
        same = [src for src in sources if same_layout(src, prog)]
        src = next((x for x in same if x[0] == dev), same[0] if same else None)
        if src is not None:
          if src[0] is not None and src[0] != dev:
            copied += sum(b.nbytes for b in jax.tree.leaves((src[1], dict(src[2]))))
          whole[slot] = prog.state_from(src[1], src[2], dev)
          continue
      params[slot] = dict.fromkeys(prog.param_names)
      for n in prog.param_names:
        pick(n, dev, 1, prog, params[slot])
      entries[slot] = dict.fromkeys(prog.opt_keys)
      for k in entries[slot]:
        pick(k, dev, 2, prog, entries[slot])
    # Every copy in one call: a call per array cost tens of microseconds each (a stage's
    # parameters and optimizer state are hundreds to thousands of arrays).
    placed = jax.device_put([c[2] for c in copies], [c[3] for c in copies]) if copies else []
    for (into, key, _, _), value in zip(copies, placed, strict=True):
      into[key] = value
    self.params, self.opt_state = {}, {}
    for slot in self.local_slots:
      prog = self.program(slot)
      if slot in whole:
        self.params[slot], self.opt_state[slot] = whole[slot]
      elif prog.packed:
        self.params[slot], self.opt_state[slot] = prog.state_from(
          params[slot], entries[slot], self.device(slot))
      else:
        self.params[slot] = params[slot]
        self.opt_state[slot] = universal.unflatten_state(prog.opt_template, entries[slot],
                                                         what="optimizer state")
    self.refresh_replicas(tag, channel=1)
    return copied

  def refresh_replicas(self, tag: tuple[int, int] = (0, 0), channel: int = 2) -> None:
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
        specs.update(self._state_specs(p.split, p.replica))
        remote.append((src_node, p.node, sorted(self._keys(p.split, p.replica, whole=True))))
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
      self.replicas[slot] = prog.state_from(params, entries, dev) if prog.packed else (
        {n: params[n] for n in prog.param_names},
        universal.unflatten_state(prog.opt_template, entries, what="replica state"),
      )

  def export_state(self, slots: Sequence[Slot] | None = None,
                   params_of: Mapping[Slot, Params] | None = None,
                   opt_of: Mapping[Slot, Any] | None = None,
                   ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """This process's parameters by global name and optimizer entries (universal layout), one
    holder each; arrays stay on their devices. `slots`, `params_of`, `opt_of` (each slot's
    optimizer entries, `StagePrograms.opt_entries`): a state noted earlier
    (`training/local_copies.py`), instead of the current one."""
    from resilient_jax.checkpoint import universal

    slots = self.local_slots if slots is None else slots
    params_of = self.params if params_of is None else params_of
    if opt_of is None:
      opt_of = {s: self.program(s).opt_entries(self.opt_state[s]) for s in slots}
    params: dict[str, jax.Array] = {}
    opt: list[dict[str, Any]] = []
    for slot in slots:
      held = params_of[slot]
      params.update({k: held[k] for k in held if k not in params})
      opt.append(dict(opt_of[slot]))
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
      batch = {k: zeros(s) for k, s in prog.batch_specs.items()}
      seeds = zeros(jax.ShapeDtypeStruct((prog.microbatch, 2), jnp.int32)) \
        if prog.uses_rng else None
      x = None if prog.input_spec is None else zeros(prog.input_spec)
      _, res, saved = prog.forward(self.params[slot], x, batch, seeds)
      scalar = jax.ShapeDtypeStruct((), jnp.float32)
      g = zeros(scalar if prog.info.last else prog.output_spec)
      _, taps = prog.backward_input(res, g)
      params = self.params[slot]
      outs.append(prog.backward_weight(params, saved, taps, prog.zero_grads(params, dev)))
      if everything:
        _, grads = prog.backward_fused(res, saved, params, g, prog.zero_grads(params, dev))
        outs.append(prog.optimizer_step(params, self.opt_state[slot], grads, self.owned[slot]))
        if self.owned_apart[slot]:
          outs.append(prog.sumsq_of(grads, self.owned_apart[slot]))
        for group in self.groups:  # the gradient all-reduce's own programs
          members = tuple(sorted({self.device(h) for h in group.holders}, key=where_key))
          if slot in group.holders and len(members) > 1:
            zero = prog.zero_grads(params, dev)
            outs += self.transport.prepare_reduce({dev: group.part(zero)}, members)
    self.transport.wait(outs, "the warm-up of the split backward")

  # ---------------------------------------------------------------- one step

  def run_step(
    self,
    batch: dict[str, np.ndarray],
    *,
    step: int = 0,
    attempt: int = 0,
    profile: bool = False,
    after_op: AfterOp | None = None,
    seeds: np.ndarray | None = None,
  ) -> StepResult:
    """Runs one attempt at a step of the current plan.

    Args:
      batch: the step's samples, every entry `[num_microbatches, microbatch_size, ...]`, by
        global micro-batch id (`recipe.step_data`).
      step, attempt: name the transfers and agreements of a multi-process job.
      profile: wait for every op to record its duration (serialises the devices).
      after_op: see `AfterOp`.
      seeds: `(step, sample id)` of every sample `[num_microbatches, microbatch_size, 2]`, for
        models that draw random numbers (dropout); see `recipe.sample_seeds`.

    Returns:
      The outcome; in a multi-process job it may be uncommitted, naming the nodes lost.
    """
    run = StepRun(self, batch, step=step, attempt=attempt, profile=profile,
                  after_op=after_op, seeds=seeds)
    run.begin()
    dispatch(run)
    return run.conclude()

  def run_forward(
    self,
    batch: dict[str, np.ndarray],
    *,
    step: int,
    attempt: int,
    after_op: AfterOp | None = None,
    seeds: np.ndarray | None = None,
  ) -> StepResult:
    """Runs one forward-only attempt (an evaluation) on the current plan: every slot's F ops
    of `run_step`, through the same routes and transfers, each micro-batch's loss on its last
    stage, agreed like a step's; no backward, reduction or optimizer step, and no state
    changes. Arguments and outcome as `run_step`'s (`loss`: the batch's mean loss)."""
    forward = self._forward
    if forward is None or forward.source is not self.step_program:
      forward = self._forward = ForwardOnly(self)  # once per plan, as `dispatch_lists`
    run = StepRun(forward, batch, step=step, attempt=attempt, profile=False,
                  after_op=after_op, seeds=seeds)
    run.begin()
    dispatch(run)
    return run.conclude()


class ForwardOnly:
  """`interp` as an attempt that runs only its plan's forward ops sees it
  (`StepProgram.forward_only`, `Interpreter.run_forward`): the same state, programs, devices
  and transport, no reduction, and nothing to refresh, since nothing steps."""

  def __init__(self, interp: Holder):
    self._interp = interp
    self.source = interp.step_program
    self.step_program = interp.step_program.forward_only()
    self.groups: list[ReductionGroup] = []
    self.dispatch_lists = local_dispatch_lists(self, interp.local_slots)

  def __getattr__(self, name: str) -> Any:  # the rest of `Holder` is the interpreter's
    return getattr(self._interp, name)

  def refresh_replicas(self, tag: tuple[int, int] = (0, 0)) -> None:
    """The replicas stand: no state changed."""
