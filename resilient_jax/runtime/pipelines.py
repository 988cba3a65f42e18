"""Executes a `PipelineSet` (the Oobleck and Bamboo policies) on local devices.

Each pipeline has its own split of the layers, so state is kept per *slot* `(pipeline, stage)`,
each slot on its node's device, with programs compiled once per distinct split. A step:

1. every pipeline's compute ops are dispatched in dependency order (its schedule has local
   micro-batch ids; the data are those of the global ids it owns). JAX's asynchronous dispatch
   overlaps the pipelines. `FR` (Bamboo) runs the successor stage's forward on the slot's
   replica of that stage; its output is not used.
2. one all-reduce, keyed by parameter name: every parameter's gradient is summed over every slot
   that holds it, whatever stage that is in its pipeline (a tied embedding/head is just a name
   held by two slots of each pipeline). Names with the same set of holding devices share one
   `psum` collective; slots on the same device (a Bamboo node running two stages) are added on
   the device first.
3. every slot's optimizer step; the new state is installed only when the whole step was
   dispatched, so a failure in the middle leaves the committed state untouched and the step is
   re-run on the new plan with the same samples. Replicas (Bamboo) are then refreshed from
   their stage's new state, device to device.

`place` moves to a new plan after failures (Oobleck's re-instantiation, Bamboo's failover):
every slot takes each parameter and optimizer entry from a surviving holder on its own device
when there is one, else copies it from another device, and reports the bytes copied.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resilient_jax.checkpoint import universal
from resilient_jax.runtime.executor import GroupSum, Params, StepResult
from resilient_jax.schedule.core import AR, BW, FR, OPT, B, F, Op, Schedule, W, Worker, dependencies
from resilient_jax.schedule.pipelines import LayerRange, PipelineSet
from resilient_jax.stages import StagePrograms

Slot = tuple[int, int]
"""`(pipeline, stage)` of a `PipelineSet`."""
ProgramsFor = Callable[[tuple[LayerRange, ...]], Sequence[StagePrograms]]
Source = tuple[jax.Device, Params, dict[str, Any]]
"""State that survives a failure: its device, parameters and flat optimizer entries."""


def dispatch_order(schedule: Schedule) -> list[tuple[Worker, Op]]:
  """The compute ops of `schedule` in an order that respects every dependency."""
  ops = {w: [op for op in schedule.ops[w] if op.kind not in (AR, OPT)] for w in schedule.workers}
  pos = {w: 0 for w in ops}
  done: set[tuple[Worker, Op]] = set()
  out: list[tuple[Worker, Op]] = []
  total = sum(len(v) for v in ops.values())
  while len(out) < total:
    progressed = False
    for w, lst in ops.items():
      while pos[w] < len(lst) and all(d in done for d in dependencies(schedule, w, lst[pos[w]])):
        done.add((w, lst[pos[w]]))
        out.append((w, lst[pos[w]]))
        pos[w] += 1
        progressed = True
    if not progressed:
      raise RuntimeError(f"schedule {schedule.name} cannot make progress")
  return out


class PipelineSetExecutor:
  """Holds every slot's state and runs steps of a `PipelineSet`.

  Args:
    programs_for: the stage programs of a split of the layers (cached by the caller: it is
      called on every lookup).
    devices: the device of every node.
    plan: the set to run.
    state: where the state comes from (`place`); default the model's initial parameters.
  """

  def __init__(
    self,
    programs_for: ProgramsFor,
    devices: Mapping[int, jax.Device],
    plan: PipelineSet,
    state: Sequence[Source] | None = None,
  ):
    self._programs_for = programs_for
    self._orders: dict[int, list[tuple[Worker, Op]]] = {}
    self.devices = dict(devices)
    self.plan = plan
    self.params: dict[Slot, Params] = {}
    self.opt_state: dict[Slot, Any] = {}
    self.replicas: dict[Slot, tuple[Params, Any]] = {}
    self._group_sum = GroupSum()
    if state is not None:
      self.place(plan, state)
      return
    for slot in plan.slots:
      prog, dev = self.program(slot), self.device(slot)
      self.params[slot] = prog.initial_params(dev)
      self.opt_state[slot] = prog.init_opt_state(self.params[slot], dev)
    self._refresh_replicas()

  # ---------------------------------------------------------------- layout

  def programs(self, stages: tuple[LayerRange, ...]) -> Sequence[StagePrograms]:
    return self._programs_for(stages)

  def program(self, slot: Slot, plan: PipelineSet | None = None) -> StagePrograms:
    p, s = slot
    return self.programs((plan or self.plan).pipelines[p].stages)[s]

  def device(self, slot: Slot, plan: PipelineSet | None = None) -> jax.Device:
    p, s = slot
    return self.devices[(plan or self.plan).pipelines[p].nodes[s]]

  def node_slots(self, node: int) -> list[Slot]:
    return [(p, s) for p, s in self.plan.slots if self.plan.pipelines[p].nodes[s] == node]

  def sources(self, dead_nodes: set[int] = frozenset()) -> list[Source]:
    """Every state held on a live node: the slots' own and the replicas."""
    out = []
    for slot in self.plan.slots:
      if self.plan.pipelines[slot[0]].nodes[slot[1]] in dead_nodes:
        continue
      dev = self.device(slot)
      out.append((dev, self.params[slot], universal.flatten_state(self.opt_state[slot])))
      if slot in self.replicas:
        params, opt = self.replicas[slot]
        out.append((dev, params, universal.flatten_state(opt)))
    return out

  def place(self, plan: PipelineSet, sources: Sequence[Source]) -> int:
    """Switches to `plan`, taking every slot's state from `sources`; returns bytes copied.

    A slot uses an array already on its device when one exists, else copies one from another
    device. Raises KeyError if no source holds a parameter or optimizer entry it needs.
    """
    params: dict[Slot, Params] = {}
    opt: dict[Slot, Any] = {}
    copied = 0

    def pick(key: str, dev: jax.Device, table: int) -> jax.Array:
      nonlocal copied
      held = [src for src in sources if key in src[table]]
      if not held:
        what = "parameter" if table == 1 else "optimizer entry"
        raise KeyError(f"{what} {key!r} has no surviving replica")
      local = next((src for src in held if src[0] == dev), None)
      if local is not None:
        return local[table][key]
      value = held[0][table][key]
      copied += value.nbytes
      return jax.device_put(value, dev)

    for slot in plan.slots:
      prog, dev = self.program(slot, plan), self.device(slot, plan)
      params[slot] = {n: pick(n, dev, 1) for n in prog.param_names}
      template = jax.eval_shape(prog.optimizer.init, prog.abstract_params())
      entries = {k: pick(k, dev, 2) for k in universal.flatten_state(template)}
      opt[slot] = universal.unflatten_state(template, entries, what="optimizer state")
    self.plan, self.params, self.opt_state = plan, params, opt
    self._refresh_replicas()
    return copied

  def _refresh_replicas(self) -> None:
    """Every slot that runs FR gets a copy of its successor stage's current state."""
    self.replicas = {}
    for p, s in self.plan.slots:
      r = self.plan.pipelines[p].replica_of(s)
      if r is not None:
        dev = self.device((p, s))
        self.replicas[(p, s)] = jax.device_put((self.params[(p, r)], self.opt_state[(p, r)]), dev)

  # ---------------------------------------------------------------- state export

  def export_state(self) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """Parameters by global name and optimizer entries (universal layout), one holder each."""
    params: dict[str, jax.Array] = {}
    opt: list[dict[str, Any]] = []
    for slot in self.plan.slots:
      params.update({k: v for k, v in self.params[slot].items() if k not in params})
      opt.append(universal.flatten_state(self.opt_state[slot]))
    return params, universal.merge(opt)

  def import_state(self, params: Mapping[str, Any], opt_entries: Mapping[str, Any]) -> None:
    """Loads universal-layout state (a checkpoint) into every slot."""
    source = (None, dict(params), dict(opt_entries))
    self.place(self.plan, [source])

  def all_params(self) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in self.export_state()[0].items()}

  # ---------------------------------------------------------------- one step

  def _order(self, p: int) -> list[tuple[Worker, Op]]:
    sched = self.plan.pipelines[p].schedule
    key = id(sched)
    if key not in self._orders:
      self._orders[key] = dispatch_order(sched)
    return self._orders[key]

  def _all_reduce(self, grads: dict[Slot, Params]) -> dict[Slot, Params]:
    """Every parameter summed over every slot holding it; one collective per holder set."""
    holders: dict[str, list[Slot]] = {}
    for slot in sorted(grads):
      for n in grads[slot]:
        holders.setdefault(n, []).append(slot)
    groups: dict[tuple[jax.Device, ...], dict[jax.Device, Params]] = {}
    for n, slots in holders.items():
      per_dev: dict[jax.Device, jax.Array] = {}
      for slot in slots:  # slots on one device are added there first
        dev = self.device(slot)
        per_dev[dev] = per_dev[dev] + grads[slot][n] if dev in per_dev else grads[slot][n]
      key = tuple(sorted(per_dev, key=lambda d: d.id))
      group = groups.setdefault(key, {d: {} for d in key})
      for dev, g in per_dev.items():
        group[dev][n] = g
    summed: dict[jax.Device, Params] = {}
    for key, local in groups.items():
      out = local if len(key) == 1 else self._group_sum(key, local)
      for dev, tree in out.items():
        summed.setdefault(dev, {}).update(tree)
    return {slot: {n: summed[self.device(slot)][n] for n in grads[slot]} for slot in grads}

  def run_step(
    self,
    inputs: np.ndarray,
    targets: np.ndarray,
    *,
    after_op: Callable[[int, Op], None] | None = None,
  ) -> StepResult:
    """Runs one step of the current plan.

    Args:
      inputs: token ids `[num_microbatches, microbatch_size, seq_len]`, by global id.
      targets: next-token targets, same shape.
      after_op: called with (node, op with the global micro-batch id) after each op is
        dispatched (and with `Op(AR)` per node after the all-reduce); may raise `WorkerLost`
        to inject a failure, which leaves the committed state untouched.
    """
    t0 = time.perf_counter()
    acts: dict[tuple[int, int, int], jax.Array] = {}
    fr_in: dict[tuple[int, int, int], jax.Array] = {}
    grads_in: dict[tuple[int, int, int], jax.Array] = {}
    residuals: dict[tuple[int, int, int], Any] = {}
    saved: dict[tuple[int, int, int], Any] = {}
    taps: dict[tuple[int, int, int], Any] = {}
    losses: dict[int, jax.Array] = {}
    processed: list[int] = []
    acc: dict[Slot, Params] = {}

    def grads_of(slot: Slot) -> Params:
      if slot not in acc:
        acc[slot] = self.program(slot).zero_grads(self.params[slot], self.device(slot))
      return acc[slot]

    for p, pipe in enumerate(self.plan.pipelines):
      progs = self.programs(pipe.stages)
      last = pipe.num_stages - 1
      for (_, s), op in self._order(p):
        slot, prog, dev = (p, s), progs[s], self.device((p, s))
        mb = op.mb
        g_mb = pipe.microbatches[mb]
        key = (p, mb, s)
        if op.kind == F:
          x = inputs[g_mb] if s == 0 else acts.pop((p, mb, s - 1))
          x = jax.device_put(x, dev)
          tgt = jax.device_put(targets[g_mb], dev) if s == last else None
          out, residuals[key], saved[key] = prog.forward(self.params[slot], x, tgt)
          if s == last:
            losses[g_mb] = out
            processed.append(g_mb)
          else:
            acts[key] = out
          if slot in self.replicas and s < last:
            fr_in[key] = out
        elif op.kind == FR:
          r = (s + 1) % pipe.num_stages
          x = jax.device_put(inputs[g_mb], dev) if s == last else fr_in.pop(key)
          tgt = jax.device_put(targets[g_mb], dev) if r == last else None
          progs[r].forward(self.replicas[slot][0], x, tgt)  # a warm copy; nothing reads it
        elif op.kind == W:
          acc[slot] = prog.backward_weight(
            self.params[slot], saved.pop(key), taps.pop(key), grads_of(slot)
          )
        elif op.kind in (B, BW):
          g = jnp.float32(1.0) if s == last else grads_in.pop((p, mb, s + 1))
          g = jax.device_put(g, dev)
          if op.kind == B:
            dx, taps[key] = prog.backward_input(residuals.pop(key), g)
          else:
            dx, acc[slot] = prog.backward_fused(
              residuals.pop(key), saved.pop(key), self.params[slot], g, grads_of(slot)
            )
          if dx is not None:
            grads_in[key] = dx
        else:
          raise ValueError(f"cannot execute {op}")
        if after_op is not None:
          after_op(pipe.nodes[s], Op(op.kind, g_mb))

    reduced = self._all_reduce({slot: grads_of(slot) for slot in self.plan.slots})
    if after_op is not None:
      for node in self.plan.nodes:
        after_op(node, Op(AR))
    new_state = {
      slot: self.program(slot).optimizer_step(self.params[slot], self.opt_state[slot], g)
      for slot, g in reduced.items()
    }
    dispatch_time = time.perf_counter() - t0
    for slot, (params, opt_state) in new_state.items():
      self.params[slot], self.opt_state[slot] = params, opt_state
    self._refresh_replicas()
    loss_values = jax.device_get(losses)
    jax.block_until_ready([p for p, _ in new_state.values()])
    mb_losses = {mb: float(v) for mb, v in loss_values.items()}
    return StepResult(
      loss=float(sum(mb_losses[mb] for mb in sorted(mb_losses))),
      microbatch_losses=mb_losses,
      step_time_s=time.perf_counter() - t0,
      records=[],
      processed=processed,
      dispatch_time_s=dispatch_time,
    )
