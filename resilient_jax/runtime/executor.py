"""Executes a `Schedule` on local devices: one device per worker `(dp, stage)`.

The host walks every worker's op list and dispatches an op as soon as the ops it depends on
have been dispatched; JAX's asynchronous dispatch then overlaps work on different devices, so
the host never waits on a device except when a step ends (or, in profile mode, after each op to
time it). Activations and activation gradients move with `jax.device_put` when the consuming op
is dispatched. Each stage's weight gradients are summed over its live data-parallel workers by a
real collective (`psum` in a `shard_map` over a mesh of exactly those devices), so a smaller
group after a failure is just another mesh.

Parameters that more than one stage holds (a tied embedding/head) get the sum of those stages'
reduced gradients before either stage's optimizer step, which keeps the copies identical.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from resilient_jax.schedule.core import AR, BW, OPT, B, F, Op, Schedule, W, Worker, dependencies
from resilient_jax.stages import StagePrograms

Params = dict[str, jax.Array]


@dataclasses.dataclass
class OpRecord:
  """One executed op; times are host wall-clock seconds from the step start."""

  worker: Worker
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
  """Micro-batch ids whose loss was computed, in dispatch order (each exactly once)."""
  dispatch_time_s: float = 0.0
  """Host time until every op was dispatched, before waiting for the devices (benchmarks)."""


class WorkerLost(Exception):
  """Raised by a fault hook when a worker dies in the middle of a step."""

  def __init__(self, worker: Worker):
    super().__init__(f"worker {worker} failed")
    self.worker = worker


def shared_params(programs: Sequence[StagePrograms]) -> dict[str, tuple[int, ...]]:
  """Parameter name -> the stages holding it, for names held by more than one stage (a tied
  embedding/head); their gradients are summed over all holders."""
  names = [set(p.param_names) for p in programs]
  return {
    n: holders
    for ns in names
    for n in ns
    if len(holders := tuple(t for t, other in enumerate(names) if n in other)) > 1
  }


class GroupSum:
  """Sums dicts of arrays over a group of devices with one `psum` collective.

  The group is a mesh of exactly those devices, so a smaller group after a failure is just
  another mesh; one compiled program per group. Works within a process and across processes
  (each process passes its own devices' dicts).
  """

  def __init__(self):
    self._programs: dict[tuple[jax.Device, ...], tuple[Callable, NamedSharding]] = {}

  def _program(self, devices: tuple[jax.Device, ...]) -> tuple[Callable, NamedSharding]:
    if devices not in self._programs:
      mesh = Mesh(np.array(devices), ("dp",))
      spec = PartitionSpec("dp")
      summed = jax.shard_map(
        lambda tree: jax.tree.map(lambda x: jax.lax.psum(x, "dp"), tree),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
      )
      self._programs[devices] = (jax.jit(summed), NamedSharding(mesh, spec))
    return self._programs[devices]

  def __call__(
    self, devices: tuple[jax.Device, ...], local: Mapping[jax.Device, Params]
  ) -> dict[jax.Device, Params]:
    """`local` holds the dicts of the group's devices this process owns; returns their sums."""
    fn, sharding = self._program(devices)
    names = sorted(next(iter(local.values())))
    stacked = {}
    for n in names:
      shards = [local[d][n] for d in devices if d in local]
      shape = (shards[0].shape[0] * len(devices), *shards[0].shape[1:])
      stacked[n] = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    out = fn(stacked)
    result: dict[jax.Device, Params] = {d: {} for d in local}
    for n in names:
      for shard in out[n].addressable_shards:
        result[shard.device][n] = shard.data
    return result


class Executor:
  """Holds every live worker's parameters and optimizer state and runs steps.

  Args:
    programs: one `StagePrograms` per stage.
    devices: the device of every worker of the full grid (failed ones included).
  """

  def __init__(self, programs: Sequence[StagePrograms], devices: Mapping[Worker, jax.Device]):
    self.programs = list(programs)
    self.devices = dict(devices)
    self.params: dict[Worker, Params] = {}
    self.opt_state: dict[Worker, Any] = {}
    for w, dev in sorted(self.devices.items()):
      prog = self.programs[w[1]]
      self.params[w] = prog.initial_params(dev)
      self.opt_state[w] = prog.init_opt_state(self.params[w], dev)
    self._group_sum = GroupSum()
    self.shared = shared_params(self.programs)

  # ---------------------------------------------------------------- state management

  def drop_worker(self, worker: Worker) -> None:
    """Forgets a failed worker's state: its peers of the same stage hold identical copies."""
    self.params.pop(worker, None)
    self.opt_state.pop(worker, None)

  def stage_params(self, stage: int) -> Params:
    """Parameters of `stage` from any live worker (all replicas are identical)."""
    for w in sorted(self.params):
      if w[1] == stage:
        return self.params[w]
    raise KeyError(f"no live worker holds stage {stage}")

  def all_params(self) -> dict[str, np.ndarray]:
    """Every parameter by global name, fetched to the host."""
    out: dict[str, np.ndarray] = {}
    for s in range(len(self.programs)):
      out.update({k: np.asarray(v) for k, v in self.stage_params(s).items()})
    return out

  def export_state(self) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """Parameters by global name and optimizer entries by state key (universal layout), from
    one live replica of each stage; arrays stay on their devices."""
    from resilient_jax.checkpoint import universal

    params: dict[str, jax.Array] = {}
    opt: list[dict[str, Any]] = []
    for s in range(len(self.programs)):
      w = next(w for w in sorted(self.params) if w[1] == s)
      params.update({k: v for k, v in self.params[w].items() if k not in params})
      opt.append(universal.flatten_state(self.opt_state[w]))
    return params, universal.merge(opt)

  def import_state(self, params: Mapping[str, Any], opt_entries: Mapping[str, Any]) -> None:
    """Loads universal-layout state into every live worker (any pipeline layout).

    Raises:
      KeyError: the state lacks a parameter or optimizer entry some stage needs.
    """
    from resilient_jax.checkpoint import universal

    for w in sorted(self.params):
      prog, dev = self.programs[w[1]], self.devices[w]
      missing = [n for n in prog.param_names if n not in params]
      if missing:
        raise KeyError(f"parameter {missing[0]!r} is missing from the checkpoint")
      self.params[w] = {n: jax.device_put(params[n], dev) for n in prog.param_names}
      template = self.opt_state[w]
      state = universal.unflatten_state(template, opt_entries, what="optimizer state")
      self.opt_state[w] = jax.device_put(state, dev)

  # ---------------------------------------------------------------- collectives

  def _all_reduce(self, stage: int, group: tuple[Worker, ...], grads: dict[Worker, Params]):
    """Sums the gradient dicts of `group` with one collective; returns one dict per worker."""
    if len(group) == 1:
      return {group[0]: grads[group[0]]}
    devices = tuple(self.devices[w] for w in group)
    by_device = self._group_sum(devices, {self.devices[w]: grads[w] for w in group})
    return {w: by_device[self.devices[w]] for w in group}

  # ---------------------------------------------------------------- one step

  def run_step(
    self,
    schedule: Schedule,
    inputs: np.ndarray,
    targets: np.ndarray,
    *,
    profile: bool = False,
    after_op: Callable[[Worker, Op], None] | None = None,
  ) -> StepResult:
    """Runs one training step: forward/backward of every micro-batch, reduce, optimizer step.

    Args:
      schedule: ops per live worker; its workers must be a subset of this executor's.
      inputs: token ids, `[num_microbatches, microbatch_size, seq_len]`, indexed by mb id.
      targets: next-token targets, same shape.
      profile: wait for every op to record its duration (serialises the devices).
      after_op: called after each op is dispatched; may raise `WorkerLost` to inject a
        mid-step failure (the caller replans and re-runs the step).

    Returns:
      The step's global mean loss and, in profile mode, per-op records.
    """
    missing = [w for w in schedule.workers if w not in self.params]
    if missing:
      raise ValueError(f"schedule uses workers without state: {missing}")
    last = schedule.pp - 1
    acts: dict[tuple[int, int], jax.Array] = {}
    grads_in: dict[tuple[int, int], jax.Array] = {}
    residuals: dict[tuple[int, int], Any] = {}
    saved: dict[tuple[int, int], Any] = {}
    taps: dict[tuple[int, int], Any] = {}
    losses: dict[int, jax.Array] = {}
    processed: list[int] = []
    acc: dict[Worker, Params] = {}
    reduced: dict[int, Params] = {}  # per stage, one replica's reduced grads (pre tie-sum)
    new_state: dict[Worker, tuple[Params, Any]] = {}
    records: list[OpRecord] = []

    def grads_of(w: Worker) -> Params:
      if w not in acc:
        acc[w] = self.programs[w[1]].zero_grads(self.params[w], self.devices[w])
      return acc[w]

    def run_compute(w: Worker, op: Op) -> list[jax.Array]:
      d, s = w
      prog, dev, key = self.programs[s], self.devices[w], (op.mb, s)
      if op.kind == F:
        x = (
          jax.device_put(inputs[op.mb], dev)
          if s == 0
          else jax.device_put(acts[(op.mb, s - 1)], dev)
        )
        tgt = jax.device_put(targets[op.mb], dev) if s == last else None
        out, residuals[key], saved[key] = prog.forward(self.params[w], x, tgt)
        if s == last:
          losses[op.mb] = out
          processed.append(op.mb)
        else:
          acts[key] = out
        return [out]
      if op.kind == W:
        acc[w] = prog.backward_weight(self.params[w], saved.pop(key), taps.pop(key), grads_of(w))
        return list(acc[w].values())[:1]
      g = (
        jax.device_put(jnp.float32(1.0), dev)
        if s == last
        else jax.device_put(grads_in.pop((op.mb, s + 1)), dev)
      )
      if op.kind == B:
        dx, taps[key] = prog.backward_input(residuals.pop(key), g)
        acts.pop((op.mb, s - 1), None)
        if dx is not None:
          grads_in[key] = dx
        return [dx] if dx is not None else list(jax.tree.leaves(taps[key]))[:1]
      if op.kind == BW:
        dx, acc[w] = prog.backward_fused(
          residuals.pop(key), saved.pop(key), self.params[w], g, grads_of(w)
        )
        if dx is not None:
          grads_in[key] = dx
        return [dx] if dx is not None else list(acc[w].values())[:1]
      raise ValueError(f"not a compute op: {op}")

    def run_opt(w: Worker) -> list[jax.Array]:
      s = w[1]
      g = dict(acc[w])
      for n, holders in self.shared.items():
        if s in holders:
          g[n] = sum(jax.device_put(reduced[t][n], self.devices[w]) for t in holders)
      params, opt_state = self.programs[s].optimizer_step(self.params[w], self.opt_state[w], g)
      new_state[w] = (params, opt_state)
      return list(params.values())[:1]

    pos = {w: 0 for w in schedule.workers}
    done: set[tuple[Worker, Op]] = set()
    t0 = time.perf_counter()

    def timed(w: Worker, op: Op, fn: Callable[[], list[jax.Array]]) -> None:
      start = time.perf_counter() - t0
      outs = fn()
      if profile:
        jax.block_until_ready(outs)
        records.append(OpRecord(w, op, start, time.perf_counter() - t0))
      done.add((w, op))
      pos[w] += 1
      if after_op is not None:
        after_op(w, op)

    def ready(w: Worker, op: Op) -> bool:
      if not all(dep in done for dep in dependencies(schedule, w, op)):
        return False
      if op.kind == OPT:
        holders = {t for n, hs in self.shared.items() if w[1] in hs for t in hs}
        return all(t in reduced for t in holders)
      return True

    remaining = sum(len(ops) for ops in schedule.ops.values())
    while remaining:
      progressed = False
      for w in schedule.workers:
        ops = schedule.ops[w]
        while pos[w] < len(ops) and ready(w, ops[pos[w]]):
          op = ops[pos[w]]
          if op.kind == AR:
            group = tuple(schedule.stage_workers(w[1]))
            heads_ready = all(
              pos[p] < len(schedule.ops[p])
              and schedule.ops[p][pos[p]].kind == AR
              and ready(p, schedule.ops[p][pos[p]])
              for p in group
            )
            if not heads_ready:
              break
            start = time.perf_counter() - t0
            result = self._all_reduce(w[1], group, {p: grads_of(p) for p in group})
            acc.update(result)
            reduced[w[1]] = result[group[0]]
            if profile:
              jax.block_until_ready(result)
            for p in group:
              if profile:
                records.append(OpRecord(p, Op(AR), start, time.perf_counter() - t0))
              done.add((p, Op(AR)))
              pos[p] += 1
              remaining -= 1
            for p in group:
              if after_op is not None:
                after_op(p, Op(AR))
            progressed = True
            continue
          if op.kind == OPT:
            timed(w, op, lambda w=w: run_opt(w))
          else:
            timed(w, op, lambda w=w, op=op: run_compute(w, op))
          remaining -= 1
          progressed = True
      if not progressed:
        heads = {
          w: str(schedule.ops[w][pos[w]]) for w in schedule.workers if pos[w] < len(schedule.ops[w])
        }
        raise RuntimeError(f"schedule cannot make progress; stuck at {heads}")
    dispatch_time = time.perf_counter() - t0

    for w, (params, opt_state) in new_state.items():
      self.params[w], self.opt_state[w] = params, opt_state
    loss_values = jax.device_get(losses)
    jax.block_until_ready([p for p, _ in new_state.values()])
    step_time = time.perf_counter() - t0
    mb_losses = {mb: float(v) for mb, v in loss_values.items()}
    return StepResult(
      loss=float(sum(mb_losses[mb] for mb in sorted(mb_losses))),
      microbatch_losses=mb_losses,
      step_time_s=step_time,
      records=records,
      processed=processed,
      dispatch_time_s=dispatch_time,
    )
