"""One attempt at a step: its state and each of its ops (`Interpreter.run_step`).

A `StepRun` holds what lives only for one attempt (activations, residuals, gradient
accumulators, the optimistic new state) and dispatches single ops of this process's slots.
Ops are dispatched as soon as the ops they depend on have been (JAX's asynchronous dispatch then
overlaps the devices); the dependencies of every op are resolved once per plan
(`Interpreter.dispatch_lists`), not per op. When each op goes, and the rules that keep a step
reproducible, are `runtime/dispatch.py`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import TraceAnnotation

from resilient_jax.model.sharding import Where, where_key
from resilient_jax.observe.records import OpRecord, StepResult
from resilient_jax.programs.compiled import OnEachDevice
from resilient_jax.programs.packing import Packed
from resilient_jax.programs.stages import StagePrograms
from resilient_jax.runtime.inbox import expect_inputs, transfer_in
from resilient_jax.runtime.transport import ACT, GRAD, Key, Outcome, Transport
from resilient_jax.schedule.core import AR, BW, FR, OPT, B, F, Op, Piece, W
from resilient_jax.schedule.plan import Slot, StepProgram
from resilient_jax.spec.faults import Slowdown, slowdowns_at

Params = dict[str, jax.Array]
AfterOp = Callable[[int, Op], None]
"""Called with (node, op with its global micro-batch id) after each op is dispatched, and with
`Op(AR)` per slot inside its reduction; may raise `WorkerLost` to inject a failure."""
DispatchList = tuple[tuple[Op, tuple[tuple[Slot, Op], ...]], ...]
"""A slot's ops in order, each with the ops of local slots it waits for."""


class Holder(Protocol):
  """What an attempt reads of the state it runs on (`runtime.interpreter.Interpreter`, which
  imports this module): the committed state per local slot, the plan's programs, reductions
  and dispatch lists, and the transport."""

  params: dict[Slot, Params]
  opt_state: dict[Slot, Any]
  replicas: dict[Slot, tuple[Params, Any]]
  owned: dict[Slot, dict[str, jax.Array]]
  owned_apart: dict[Slot, tuple[str, ...]]
  groups: list[ReductionGroup]
  local_slots: list[Slot]
  dispatch_lists: dict[Slot, DispatchList]
  step_program: StepProgram
  transport: Transport
  clip_global_norm: float
  nonfinite: frozenset[tuple[int, int]]
  slowdowns: tuple[Slowdown, ...]

  def programs(self, split: tuple[tuple[int, int], ...]) -> Sequence[StagePrograms]: ...
  def program(self, slot: Slot) -> StagePrograms: ...
  def op_program(self, slot: Slot, op: Op) -> StagePrograms: ...
  def device(self, slot: Slot) -> Where: ...
  def loss_seed(self, where: Where) -> jax.Array: ...
  def refresh_replicas(self, tag: tuple[int, int] = (0, 0)) -> None: ...

@dataclasses.dataclass(frozen=True)
class ReductionGroup:
  """One reduction: the names `names`, summed over `holders`."""

  index: int
  holders: tuple[Slot, ...]
  names: tuple[str, ...]
  whole: bool = False
  """Whether `names` are all of every holder's parameters: its gradients are then reduced as
  they are held (packed: `programs.packing`), not sliced out by name and written back."""

  def part(self, grads: Any) -> Any:
    """This group's share of a holder's gradients (of packed ones, sliced out in one program)."""
    if self.whole:
      return grads
    if isinstance(grads, Packed):
      return _select(self.names)(grads)
    return {n: grads[n] for n in self.names}

  def merged(self, grads: Any, reduced: Any) -> Any:
    """A holder's gradients with this group's share replaced by `reduced`."""
    if self.whole:
      return reduced
    return _merge(grads, reduced) if isinstance(grads, Packed) else {**grads, **reduced}


@functools.cache
def _select(names: tuple[str, ...]) -> OnEachDevice:
  return OnEachDevice(lambda g: {n: g[n] for n in names})


_merge = OnEachDevice(lambda grads, reduced: grads.replace(reduced))
"""Packed gradients with some names' reduced values written in (one program a layout)."""


class StepRun:
  """One attempt at a step of `interp`'s current plan (see `Interpreter.run_step`)."""

  def __init__(
    self,
    interp: Holder,
    batch: dict[str, np.ndarray],
    *,
    step: int,
    attempt: int,
    profile: bool,
    after_op: AfterOp | None,
    seeds: np.ndarray | None,
  ):
    self.ip = interp
    self.sp = interp.step_program
    self.tp = interp.transport
    self.batch, self.seeds = batch, seeds
    self.step, self.attempt, self.profile, self.after_op = step, attempt, profile, after_op
    self.residuals: dict[tuple[Slot, int], Any] = {}
    self.saved: dict[tuple[Slot, int], Any] = {}
    self.taps: dict[tuple[Slot, int], Any] = {}
    self.fr_in: dict[tuple[Slot, int], jax.Array] = {}
    self.losses: dict[int, list[jax.Array]] = {}
    """Every micro-batch's loss on the last stage: one, or one per piece in dispatch order."""
    self.processed: list[int] = []
    self.acc: dict[Slot, Params] = {}
    self.new_state: dict[Slot, tuple[Params, Any]] = {}
    self.sumsq: list[jax.Array] = []
    self.records: list[OpRecord] = []
    self.slow = slowdowns_at(interp.slowdowns, step)
    self.local = set(interp.local_slots)
    self.slot_groups = {s: [g for g in interp.groups if s in g.holders] for s in self.local}
    self.group_done: set[int] = set()
    self.arrived: set[Slot] = set()
    self.ar_start: dict[Slot, float] = {}
    self.done: set[tuple[Slot, Op]] = set()
    self.remote_in: dict[tuple[Slot, Op], tuple[Key, ...]] = {}
    """The transfer keys of every local op's inputs from other processes (`runtime.inbox`)."""
    self.t0 = 0.0
    self.dispatch_cpu_s = 0.0
    self._cpu0 = 0.0
    self._placed: dict[tuple[Slot, int], dict[int, dict[str, jax.Array]]] = {}
    self._factor: float | None = None
    self._seeds: dict[Where, jax.Array] = {}

  # ------------------------------------------------------------ the ops

  def grads_of(self, slot: Slot) -> Params:
    if slot not in self.acc:
      self.acc[slot] = self.ip.program(slot).zero_grads(self.ip.params[slot], self.ip.device(slot))
    return self.acc[slot]

  def data(self, slot: Slot, stage: int) -> dict[int, dict[str, jax.Array]]:
    """The batch entries stage `stage`'s forward reads (`StagePrograms.batch_keys`) of every
    micro-batch `slot` runs that forward on (F of its own stage; FR of the stage a Bamboo
    replica runs), on its device: placed in one call at its first use (a call per micro-batch
    cost more host time than the op that reads it). A piece's are its rows."""
    key = (slot, stage)
    if key not in self._placed:
      p = self.sp.slots[slot]
      keys = self.ip.programs(p.split)[stage].batch_keys
      kind = F if stage == p.stage else FR
      ops = sorted({op.mb: op for op in p.ops if op.kind == kind}.items())
      rows = [{k: self.batch[k][mb][_rows(op)] for k in keys} for mb, op in ops]
      self._placed[key] = dict(zip([mb for mb, _ in ops],
                                   jax.device_put(rows, self.ip.device(slot)), strict=True))
    return self._placed[key]

  def loss_factor(self) -> float:
    """The step's `StagePrograms.loss_factor` (1 but for a weighted loss), once per attempt."""
    if self._factor is None:
      split = next(iter(self.sp.slots.values())).split
      self._factor = self.ip.programs(split)[-1].loss_factor(self.batch, self.seeds)
    return self._factor

  def loss_seed(self, dev: Where) -> jax.Array:
    """The loss's own gradient at `dev`: 1, or the weighted loss's factor of this step."""
    factor = self.loss_factor()
    if factor == 1.0:
      return self.ip.loss_seed(dev)
    if dev not in self._seeds:
      self._seeds[dev] = jax.device_put(np.float32(factor), dev)
    return self._seeds[dev]

  def seeds_of(self, prog: StagePrograms, op: Op, dev: Where) -> jax.Array | None:
    if not prog.uses_rng:
      return None
    if self.seeds is None:
      raise ValueError("the model draws random numbers: run_step needs per-sample seeds")
    return jax.device_put(self.seeds[op.mb][_rows(op)], dev)

  def receive(self, slot: Slot, op: Op, dev: Where) -> jax.Array | None:
    """What `op` reads from other slots, on `dev`: one transfer, or the rows of a micro-batch
    gathered from its pieces in row order; None if it reads nothing."""
    incoming = transfer_in(self.sp, self.ip.program(slot), slot, op)
    if not incoming:
      return None
    parts = [self.tp.recv(*transfer, dev) for transfer in incoming]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

  def send(self, slot: Slot, op: Op, stage: int, kind: int, value: jax.Array) -> None:
    """Sends `value`, what `op` on `slot` made of its rows, to the slots that read it: the
    next stage's (ACT, `stage` this one) or the previous stage's (GRAD, `stage` that one),
    each its rows (`StepProgram.links`)."""
    sp, mb = self.sp, op.mb
    if not sp.pieces:  # the common case, kept to one lookup
      to = sp.route[mb][stage + 1] if kind == ACT else sp.route[mb][stage]
      self.tp.send((mb, stage if kind == ACT else stage + 1, kind, 0), value,
                   sp.slots[to].node)
      return
    side = 0 if kind == ACT else 1
    lo0, hi0 = _bounds(op, sp.samples)
    for link in sp.links(mb, stage):
      if link[side] == slot:
        lo, hi = link[2], link[3]
        rows = value if (lo, hi) == (lo0, hi0) else value[lo - lo0:hi - lo0]
        self.tp.send((mb, stage if kind == ACT else stage + 1, kind, lo), rows,
                     sp.slots[link[1 - side]].node)

  def compute(self, slot: Slot, op: Op) -> list[jax.Array]:
    """Dispatches a compute op (F, FR, B, W, BW) on a micro-batch or its piece (that many
    rows, the programs of that size: `Holder.program`); returns an output to wait on."""
    sp, ip = self.sp, self.ip
    p = sp.slots[slot]
    progs = ip.programs(p.split)
    prog, dev, s, mb, key = ip.op_program(slot, op), ip.device(slot), p.stage, op.mb, (slot, op.mb)
    if op.kind == F:
      x = self.receive(slot, op, dev)
      out, self.residuals[key], self.saved[key] = prog.forward(
        ip.params[slot], x, self.data(slot, s)[mb], self.seeds_of(prog, op, dev))
      if p.last:
        self.losses.setdefault(mb, []).append(out)  # a piece's loss: its rows' share
        if _bounds(op, sp.samples)[0] == 0:
          self.processed.append(mb)
      else:
        self.send(slot, op, s, ACT, out)
        if p.replica is not None:
          self.fr_in[key] = out
      return [out]
    if op.kind == FR:
      if slot not in ip.replicas:  # its refresh lost the source (`Interpreter.refresh_replicas`)
        return []
      r = p.replica
      x = None if p.last else self.fr_in.pop(key)
      rep = progs[r]
      return [rep.forward(ip.replicas[slot][0], x, self.data(slot, r)[mb],
                          self.seeds_of(rep, op, dev))[0]]  # unread
    if op.kind == W:
      self.acc[slot] = prog.backward_weight(ip.params[slot], self.saved.pop(key),
                                            self.taps.pop(key), self.grads_of(slot))
      return jax.tree.leaves(self.acc[slot])[:1]
    if op.kind not in (B, BW):
      raise ValueError(f"not a compute op: {op}")
    g = self.receive(slot, op, dev)
    if g is None:  # the last stage: the loss's own gradient, placed from the host
      g = self.loss_seed(dev)
    if op.kind == B:
      dx, self.taps[key] = prog.backward_input(self.residuals.pop(key), g)
    else:
      dx, self.acc[slot] = prog.backward_fused(self.residuals.pop(key), self.saved.pop(key),
                                               ip.params[slot], g, self.grads_of(slot))
    if dx is not None:
      self.send(slot, op, s - 1, GRAD, dx)
      return [dx]
    if op.kind == B:
      return list(jax.tree.leaves(self.taps[key]))[:1]
    return jax.tree.leaves(self.acc[slot])[:1]

  def optimize(self, slot: Slot) -> tuple[Params, jax.Array]:
    """The slot's optimistic optimizer step: unclipped, checked against the global norm when
    the step concludes."""
    ip = self.ip
    grads = self.grads_of(slot)
    if (self.step, self.sp.slots[slot].stage) in ip.nonfinite:
      grads = _make_nan(grads)
    prog = ip.program(slot)
    stepped, opt_state, share = prog.optimizer_step(
      ip.params[slot], ip.opt_state[slot], grads, ip.owned[slot])
    self.new_state[slot] = (stepped, opt_state)
    self.sumsq.append(share)
    if ip.owned_apart[slot]:  # names of buffers it owns in part (`StagePrograms.owned_apart`)
      self.sumsq.append(prog.sumsq_of(grads, ip.owned_apart[slot]))
    return stepped, share

  def run_op(self, slot: Slot, op: Op) -> None:
    """Dispatches one op of `slot` (not AR) and records it done."""
    start = time.perf_counter() - self.t0
    with TraceAnnotation(str(op), stage=self.sp.slots[slot].stage, mb=op.mb, pipeline=slot[0]):
      outs = self.optimize(slot) if op.kind == OPT else self.compute(slot, op)
      factor = self.slow.get(slot)
      if factor:
        _stretch(outs, self.t0 + start, factor)
      self.finish(slot, op, start, outs)
    if op.kind != OPT:
      self.after(slot, op)

  def after(self, slot: Slot, op: Op) -> None:
    if self.after_op is not None:
      self.after_op(self.sp.slots[slot].node, op)

  def finish(self, slot: Slot, op: Op, start: float, outs: Any) -> None:
    if self.profile:
      _settle(outs)
      self.records.append(OpRecord(slot, op, start, time.perf_counter() - self.t0))
    self.done.add((slot, op))

  # ------------------------------------------------------------ reductions

  def reduce(self, group: ReductionGroup) -> None:
    """Sums `group`'s names over its holders: on-device first, then one collective."""
    ip, sp = self.ip, self.sp
    began = time.perf_counter() - self.t0
    for h in group.holders:
      self.ar_start.setdefault(h, began)  # an AR's record starts with its first collective
    per_dev: dict[Where, Any] = {}
    for h in group.holders:
      if h in ip.params:
        dev, part = ip.device(h), group.part(self.grads_of(h))
        per_dev[dev] = jax.tree.map(jnp.add, per_dev[dev], part) if dev in per_dev else part
    devices = tuple(sorted({ip.device(h) for h in group.holders}, key=where_key))
    nodes = sorted({sp.slots[h].node for h in group.holders})
    if len(devices) > 1:
      per_dev = self.tp.reduce(group.index, nodes, devices, per_dev)
    for h in group.holders:
      if h in ip.params:
        self.acc[h] = group.merged(self.grads_of(h), per_dev[ip.device(h)])

  def complete(self, g: ReductionGroup) -> list[Slot]:
    """Finishes the AR of every local holder of `g` whose groups are now all reduced (at
    once, so that a profiled AR ends when its collective does); returns those slots."""
    finished = []
    for h in g.holders:
      if h in self.arrived and (h, Op(AR)) not in self.done and all(
        x.index in self.group_done for x in self.slot_groups[h]
      ):
        self.finish(h, Op(AR), self.ar_start[h], [self.acc.get(h)])
        finished.append(h)
        self.after(h, Op(AR))
    return finished

  def complete_alone(self, slot: Slot) -> None:
    """Finishes the AR of a slot that holds no parameter (a stage of no layers): it arrived,
    and no group waits for it."""
    now = time.perf_counter() - self.t0
    self.finish(slot, Op(AR), now, [])
    self.after(slot, Op(AR))

  def next_groups(self, blocking_ok: bool) -> list[ReductionGroup]:
    """The groups that may run now: every group whose local holders have all arrived at their
    AR; one with holders on other processes only when `blocking_ok`, and only in the global
    group order (a later group waits for an earlier one), so no two processes wait on each
    other."""
    ready = []
    for g in self.ip.groups:
      if g.index in self.group_done or not any(h in self.local for h in g.holders):
        continue
      if not all(h in self.arrived for h in g.holders if h in self.local):
        if self.tp.remote_collectives:
          return ready  # keep the global order
        continue
      if any(h not in self.local for h in g.holders) and not blocking_ok:
        return ready
      ready.append(g)
      if self.tp.remote_collectives:
        return ready  # one at a time: the next may wait on this one's outcome elsewhere
    return ready

  def run_group(self, g: ReductionGroup) -> list[Slot]:
    with TraceAnnotation("AR", group=g.index, stage=self.sp.slots[g.holders[0]].stage):
      self.reduce(g)
    self.group_done.add(g.index)
    return self.complete(g)

  # ------------------------------------------------------------ dispatch

  def begin(self) -> None:
    """Starts the attempt: its clock, its transfers, and the pulls of every array a local op
    reads from another process (each op is dispatched once its data arrived, `runtime.inbox`
    says why); `runtime.dispatch.dispatch` then runs the ops, and `conclude` ends it."""
    self.t0 = time.perf_counter()
    self._cpu0 = time.thread_time()
    self.tp.begin(self.step, self.attempt, self.sp.nodes)
    self.remote_in = expect_inputs(self.sp, self.ip.program, self.ip.device, self.tp,
                                   self.ip.local_slots)

  def conclude(self) -> StepResult:
    """Agrees on the attempt's outcome (across processes) and commits its state, or not."""
    dispatch_time = time.perf_counter() - self.t0
    self.dispatch_cpu_s = time.thread_time() - self._cpu0
    ip, tp, t0 = self.ip, self.tp, self.t0
    new_state = self.new_state
    outcome: Outcome = tp.conclude(_whole_losses(self.losses), [p for p, _ in new_state.values()],
                                   self.sumsq)
    if not outcome.committed:
      return StepResult(0.0, {}, time.perf_counter() - t0, self.records, [], dispatch_time,
                        self.dispatch_cpu_s, committed=False, lost=frozenset(outcome.lost),
                        detected_at=outcome.detected_at)
    norm = math.sqrt(outcome.grad_sumsq) if outcome.grad_sumsq >= 0 else math.nan
    skipped = not math.isfinite(norm)
    clipped = not skipped and 0 < ip.clip_global_norm < norm
    if clipped:
      # Post-validation: every process knows the same global norm, so every stage redoes its
      # step with the same factor, from the committed state (the optimistic one is dropped).
      scale = jnp.float32(ip.clip_global_norm / norm)
      for slot in new_state:
        new_state[slot] = ip.program(slot).optimizer_step(
          ip.params[slot], ip.opt_state[slot], self.acc[slot], ip.owned[slot],
          jax.device_put(scale, ip.device(slot)))[:2]
    if not skipped:
      for slot, (params, opt_state) in new_state.items():
        ip.params[slot], ip.opt_state[slot] = params, opt_state
      ip.refresh_replicas((self.step, self.attempt))
    elapsed = time.perf_counter() - t0
    factor = self.loss_factor()
    mb_losses = outcome.losses if factor == 1.0 else {
      mb: loss * factor for mb, loss in outcome.losses.items()}
    return StepResult(
      loss=float(sum(mb_losses[mb] for mb in sorted(mb_losses))),
      microbatch_losses=mb_losses,
      step_time_s=elapsed,
      records=self.records,
      processed=sorted(mb_losses) if outcome.remote else self.processed,
      dispatch_time_s=dispatch_time,
      dispatch_cpu_s=self.dispatch_cpu_s,
      detected_at=outcome.detected_at,
      grad_norm=norm,
      skipped=skipped,
      clipped=clipped,
      stop=outcome.stop,
      net_bytes=outcome.net_bytes,
      device_bytes=outcome.device_bytes,
      loss_factor=factor,
    )


def local_dispatch_lists(interp: Holder, slots: Sequence[Slot]) -> dict[Slot, DispatchList]:
  """Every local slot's ops with the ops of local slots each waits for, resolved once per plan
  (ops of other processes' slots arrive through the transport)."""
  sp = interp.step_program
  local = set(slots)
  return {
    s: tuple((op, tuple(d for d in sp.dependencies(s, op) if d[0] in local))
             for op in sp.slots[s].ops)
    for s in slots
  }


def _rows(op: Op) -> slice:
  """The rows of a micro-batch's batch entries `op` runs on: all, or its piece's."""
  return slice(op.lo, op.hi) if isinstance(op, Piece) else slice(None)


def _bounds(op: Op, samples: int) -> tuple[int, int]:
  return (op.lo, op.hi) if isinstance(op, Piece) else (0, samples)


def _whole_losses(losses: dict[int, list[jax.Array]]) -> dict[int, jax.Array]:
  """Every micro-batch's loss: its pieces' summed on the first piece's device (the loss is
  weighted over the global batch, so a piece's is its rows' share: `StagePrograms.loss_scale`)."""
  out = {}
  for mb, parts in losses.items():
    if len(parts) == 1:
      out[mb] = parts[0]
    else:
      where = parts[0].sharding
      out[mb] = functools.reduce(jnp.add, [jax.device_put(x, where) for x in parts])
  return out


def _stretch(outs: Any, began: float, factor: float) -> None:
  """`faults.slow`'s injection: waits for the op, then sleeps `factor - 1` times as long as it
  took, so that its device is taken for `factor` times its time (what a profiled step records,
  and what the host waits in any step). A real slow device would not hold the host's dispatch
  of other devices' ops meanwhile; this one does, which only makes an unmitigated straggler
  cost more wall time."""
  _settle(outs)
  time.sleep((factor - 1) * (time.perf_counter() - began))


def _settle(outs: Any) -> None:
  """Waits for an op's outputs (a profiled step's, a slowed worker's). In a job, one computed
  from a lost process's data fails as it settles (that data arrived as an error array, which
  flows on as data: `runtime/multiprocess.py`); the attempt's end finds it
  (`Transport.conclude`) and does not commit, so it is not raised here, where it would end
  the process instead."""
  try:
    jax.block_until_ready(outs)
  except jax.errors.JaxRuntimeError:
    pass


_make_nan = OnEachDevice(lambda grads: jax.tree.map(lambda g: g * jnp.nan, grads))
"""`faults.nonfinite`'s injection: a stage's gradients, all NaN."""
