"""Executes this process's part of a `Schedule` in a multi-process job (one worker per process).

Every process runs the same loop on the same schedule (derived deterministically from the agreed
set of failed workers) and executes only its own worker's op list, in order:

* `F` of stage s > 0 pulls the activation from the worker that ran stage s-1 of that
  micro-batch (`schedule.route`), `B` of stage s < last pulls the activation gradient from
  stage s+1; outputs are offered to the consumer under an id derived from
  (step, attempt, micro-batch, stage, kind), so a stale attempt's data can never be mistaken
  for the current one's.
* `AR` first waits for this worker's gradients, then agrees with the other members of the
  stage whether to run the collective, and sums over the stage with it; parameters held by
  several stages (a tied embedding) are summed over the union of their workers.
* `OPT` computes the new state, which is installed only when the attempt commits.

**An attempt either commits everywhere or nowhere.** A live process always runs its whole op
list, even after a peer died: data from a dead peer arrives as an error array (or zeros, if the
peer could not be reached), which flows on as data, so no live peer ever waits for data that
will not come. Decisions go through the key-value store, first writer wins
(`Cluster.decide`), under `step/{step}/{attempt}/`, and every process follows the stored
decision, never its own proposal:

* Before a collective, each member writes `{name}/{pid}` (ready), then follows
  `{name}/decision`: "run" is proposed once every member is ready; "skip" once a member that
  is not ready is proven dead (`Cluster.dead`: its port refuses connections, or its heartbeat
  stopped), or once the attempt has failed. So either every member enters the collective or
  none does (a member that dies inside it makes the others' collective fail, not hang), and
  nobody waits for a heartbeat timeout to learn of a crash.
* At the end, each process writes `end/{pid}` (its status: ok, or why not, and its losses),
  then follows `end/outcome`: `{"commit": true}` is proposed once every participant reported
  success, `{"lost": [pids]}` once a participant is proven dead. On commit every process
  installs its new state; on a loss every survivor drops the attempt, replans without the lost
  processes and re-runs the step with the same samples. A process that finds itself in `lost`
  (after a false heartbeat verdict) exits with `EXIT_DECLARED_DEAD`.

Each directory is read whole in one call, and a waiter blocks on its decision key between
reads, so it follows a decision as soon as it is written. Every wait has the
`distributed.wait_timeout_s` deadline of `Cluster.poll`.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resilient_jax.runtime.cluster import Cluster
from resilient_jax.runtime.executor import GroupSum, Params, shared_params
from resilient_jax.schedule.core import AR, BW, OPT, B, F, Schedule, W, Worker
from resilient_jax.stages import StagePrograms

ACT, GRAD, STATE = 0, 1, 2

PauseHook = Callable[[int, str], None]
"""Called with (step, where) at points a test may kill this process: "start" before a step,
the op's text (e.g. "F1") after an op is dispatched, "AR" inside the all-reduce."""


def transfer_id(step: int, attempt: int, mb: int, stage: int, kind: int) -> int:
  """A unique id per (step, attempt mod 64, micro-batch, stage, kind), below 2**60.

  Raises:
    ValueError: a field outside its range (2**22 steps, 2**16 micro-batches, 2**10 stages).
  """
  if not (0 <= step < 1 << 22 and 0 <= mb < 1 << 16 and 0 <= stage < 1 << 10):
    raise ValueError(f"transfer id out of range: step {step}, micro-batch {mb}, stage {stage}")
  return (((step * 64 + attempt % 64) * 65536 + mb) * 1024 + stage) * 4 + kind


@dataclasses.dataclass
class Attempt:
  """The outcome of one attempt at a step, identical in every surviving process."""

  committed: bool
  lost: set[int]
  """Process ids that died during the attempt (empty when committed)."""
  microbatch_losses: dict[int, float]
  """Every micro-batch's loss (from all last-stage processes) when committed."""
  step_time_s: float
  detected_at: float = 0.0
  """`time.time()` when this process read the agreed outcome."""


class ProcessExecutor:
  """Holds this process's worker state and runs its ops of each step.

  Args:
    programs: one `StagePrograms` per stage (only this worker's stage is compiled).
    cluster: the joined job.
    process_of: the process of every worker of the full grid.
  """

  def __init__(
    self, programs: Sequence[StagePrograms], cluster: Cluster, process_of: Mapping[Worker, int]
  ):
    self.programs = list(programs)
    self.cluster = cluster
    self.process_of = dict(process_of)
    self.worker = next(w for w, p in self.process_of.items() if p == cluster.process_id)
    self.device = cluster.device
    prog = self.programs[self.worker[1]]
    self.params: Params = prog.initial_params(self.device)
    self.opt_state: Any = prog.init_opt_state(self.params, self.device)
    self.shared = shared_params(self.programs)
    self._group_sum = GroupSum()
    # Any worker of a neighbouring stage may become this one's producer or consumer.
    s = self.worker[1]
    cluster.connect(p for w, p in self.process_of.items() if abs(w[1] - s) == 1)

  def warm_up(self) -> None:
    """Compiles the split backward (`B`, `W`) by running it once on zeros.

    Fault-free schedules may use only the fused backward; the replanned schedule after a
    failure splits it, and compiling then would add to the recovery time.
    """
    prog, dev = self.programs[self.stage], self.device
    zeros = lambda spec: jax.device_put(jnp.zeros(spec.shape, spec.dtype), dev)  # noqa: E731
    tgt = zeros(prog.target_spec) if prog.info.last else None
    _, res, saved = prog.forward(self.params, zeros(prog.input_spec), tgt)
    g = zeros(jax.ShapeDtypeStruct((), jnp.float32)) if prog.info.last else zeros(prog.output_spec)
    _, taps = prog.backward_input(res, g)
    acc = prog.backward_weight(self.params, saved, taps, prog.zero_grads(self.params, dev))
    self.cluster.wait(acc, "the warm-up of the split backward")

  @property
  def stage(self) -> int:
    return self.worker[1]

  # ---------------------------------------------------------------- one attempt

  def run_attempt(
    self,
    schedule: Schedule,
    inputs: np.ndarray,
    targets: np.ndarray,
    step: int,
    attempt: int,
    pause: PauseHook | None = None,
  ) -> Attempt:
    """Runs this worker's ops of `step`, then agrees with every participant on the outcome."""
    t0 = time.perf_counter()
    cl, w = self.cluster, self.worker
    d, s = w
    if w not in schedule.ops:
      raise RuntimeError(f"process {cl.process_id} (worker {w}) is not in the schedule")
    prog, dev = self.programs[s], self.device
    last = schedule.pp - 1
    participants = sorted(self.process_of[p] for p in schedule.workers)
    residuals: dict[int, Any] = {}
    saved: dict[int, Any] = {}
    taps: dict[int, Any] = {}
    losses: dict[int, jax.Array] = {}
    doomed: list[str] = []
    acc = prog.zero_grads(self.params, dev)
    new_state: tuple[Params, Any] | None = None

    def tid(mb: int, stage: int, kind: int) -> int:
      return transfer_id(step, attempt, mb, stage, kind)

    def pull(worker: Worker, uid: int, spec: jax.ShapeDtypeStruct) -> jax.Array:
      got = cl.pull(self.process_of[worker], uid, [spec])
      if got is None:
        doomed.append(f"worker {worker} unreachable")
        return jax.device_put(jnp.zeros(spec.shape, spec.dtype), dev)
      return got[0]

    def producer(mb: int, stage: int) -> Worker:
      return (schedule.route[mb][stage], stage)

    def reduce(group: list[Worker], grads: Params, what: str) -> Params:
      """Sums `grads` over `group` if its members agree to; else marks the attempt doomed."""
      if len(group) == 1:
        return grads
      procs = [self.process_of[g] for g in group]
      skipped = self._agree_collective(step, attempt, what, procs)
      if pause is not None:
        pause(step, "AR")
      if skipped is not None:
        doomed.append(f"{what} skipped: {skipped}")
        return grads
      group_devices = tuple(_device_of(p) for p in procs)
      try:
        out = self._group_sum(group_devices, {dev: grads})[dev]
      except Exception as e:  # a peer died inside the collective
        doomed.append(f"{what}: {str(e).splitlines()[0][:120]}")
        return grads
      err = cl.wait(out, what)
      if err is not None:
        doomed.append(f"{what}: {str(err).splitlines()[0][:120]}")
        return grads
      return out

    if pause is not None:
      pause(step, "start")
    for op in schedule.ops[w]:
      mb = op.mb
      if op.kind == F:
        if s == 0:
          x = jax.device_put(inputs[mb], dev)
        else:
          x = pull(producer(mb, s - 1), tid(mb, s - 1, ACT), prog.input_spec)
        tgt = jax.device_put(targets[mb], dev) if s == last else None
        out, residuals[mb], saved[mb] = prog.forward(self.params, x, tgt)
        if s == last:
          losses[mb] = out
        else:
          cl.offer(tid(mb, s, ACT), [out])
      elif op.kind in (B, BW):
        if s == last:
          g = jax.device_put(jnp.float32(1.0), dev)
        else:
          g = pull(producer(mb, s + 1), tid(mb, s + 1, GRAD), prog.output_spec)
        if op.kind == B:
          dx, taps[mb] = prog.backward_input(residuals.pop(mb), g)
        else:
          dx, acc = prog.backward_fused(residuals.pop(mb), saved.pop(mb), self.params, g, acc)
        if s > 0:
          cl.offer(tid(mb, s, GRAD), [dx])
      elif op.kind == W:
        acc = prog.backward_weight(self.params, saved.pop(mb), taps.pop(mb), acc)
      elif op.kind == AR:
        err = cl.wait(acc, "this worker's gradients")
        if err is not None:  # computed from a lost peer's data: the attempt cannot commit
          doomed.append(f"gradients: {str(err).splitlines()[0][:120]}")
          acc = prog.zero_grads(self.params, dev)
        own = {n: v for n, v in acc.items() if n not in self.shared}
        acc = {**acc, **reduce(list(schedule.stage_workers(s)), own, f"stage {s} all-reduce")}
        mine = {n: v for n, v in acc.items() if n in self.shared}
        if mine:
          holders = sorted({t for n in mine for t in self.shared[n]})
          group = sorted(x for x in schedule.workers if x[1] in holders)
          acc = {**acc, **reduce(group, mine, "tied-parameter all-reduce")}
      elif op.kind == OPT:
        new_state = prog.optimizer_step(self.params, self.opt_state, acc)
      else:
        raise ValueError(f"cannot execute {op}")
      if pause is not None and op.kind in (F, B, W, BW):
        pause(step, str(op))

    err = cl.wait((new_state, losses), "the step's results")
    if err is not None:
      doomed.append(f"results: {str(err).splitlines()[0][:120]}")
    status = {
      "ok": not doomed,
      "why": doomed[:3],
      "losses": {} if doomed else {str(k): float(v) for k, v in losses.items()},
    }
    base = _attempt_key(step, attempt)
    cl.kv_set(f"{base}/end/{cl.process_id}", status)
    decision, statuses = self._agree_outcome(base, participants, f"step {step}, attempt {attempt}")
    detected = time.time()
    elapsed = time.perf_counter() - t0
    if "lost" in decision:
      cl.declared_dead(decision["lost"], f"step {step}, attempt {attempt}")
      return Attempt(False, set(decision["lost"]), {}, elapsed, detected)
    if new_state is None:
      raise RuntimeError(f"worker {w}'s op list has no OPT")
    self.params, self.opt_state = new_state
    mb_losses = {int(k): v for st in statuses.values() for k, v in st["losses"].items()}
    return Attempt(True, set(), mb_losses, elapsed, detected)

  # ---------------------------------------------------------------- agreement

  def _agree_collective(self, step: int, attempt: int, what: str, procs: list[int]) -> str | None:
    """Agrees with the other members whether the collective `what` runs: None if it does, else
    why not. Either every member enters it or none does.

    Each member writes `{name}/{pid}` (ready), then follows `{name}/decision`, proposing "run"
    once every member is ready, or "skip" once a member that is not ready is proven dead (also
    proposing that dead set as the attempt's outcome) or the attempt's outcome is already
    decided (it can only be a loss: this member has not reported its status yet).
    """
    cl = self.cluster
    base = _attempt_key(step, attempt)
    directory = f"{base}/" + re.sub(r"[^\w-]+", "-", what)
    key = f"{directory}/decision"
    cl.kv_set(f"{directory}/{cl.process_id}", True)

    def check() -> dict | None:
      decided, ready = _split(cl.kv_dir(directory), "decision")
      if decided is not None:
        return decided
      missing = set(procs) - set(ready)
      if not missing:
        return cl.decide(key, {"run": True})
      if cl.kv_try_get(f"{base}/end/outcome") is not None:
        return cl.decide(key, {"run": False, "why": "the attempt already failed"})
      dead = cl.dead(missing)
      if dead:
        cl.decide(f"{base}/end/outcome", {"lost": sorted(dead)})
        return cl.decide(key, {"run": False, "why": f"processes {sorted(dead)} died"})
      return None

    decided = cl.poll(f"the members of the {what} ({procs})", check, wake_key=key)
    return None if decided["run"] else decided["why"]

  def _agree_outcome(
    self, base: str, participants: list[int], what: str
  ) -> tuple[dict, dict[int, dict]]:
    """The agreed outcome of an attempt whose statuses are under `base`/end, and the statuses
    (all of them if it committed).

    Follows `end/outcome`, proposing `{"commit": true}` once every participant reported
    success, or `{"lost": [...]}` once a participant is proven dead: one that has not
    reported, or any if every status is in and some failed (a failure comes from a dead
    peer's data). A participant that reported success and then died may still be committed
    (its part was complete); the next attempt finds its death.

    Raises:
      RuntimeError: some status failed while every participant stayed alive for longer than
        the heartbeat timeout (a bug, not a failure).
    """
    cl = self.cluster
    directory = f"{base}/end"
    key = f"{directory}/outcome"
    others = [p for p in participants if p != cl.process_id]
    statuses: dict[int, dict] = {}
    failed_since: list[float] = []

    def check() -> dict | None:
      decided, got = _split(cl.kv_dir(directory), "outcome")
      statuses.clear()
      statuses.update(got)
      if decided is not None:
        return decided
      missing = [p for p in participants if p not in statuses]
      if not missing and all(st["ok"] for st in statuses.values()):
        return cl.decide(key, {"commit": True})
      dead = cl.dead(missing or others)
      if dead:
        return cl.decide(key, {"lost": sorted(dead)})
      if not missing:
        failed_since[:] = failed_since or [time.monotonic()]
        if time.monotonic() - failed_since[0] > cl.cfg.heartbeat_timeout_s + 2:
          bad = {p: st["why"] for p, st in statuses.items() if not st["ok"]}
          raise RuntimeError(f"{what} failed with every process alive: {bad}")
      return None

    decided = cl.poll(f"the outcome of {what}", check, wake_key=key)
    if "commit" in decided and set(statuses) != set(participants):
      statuses.clear()
      statuses.update(_split(cl.kv_dir(directory), "outcome")[1])
      if set(statuses) != set(participants):
        raise RuntimeError(f"{what} committed without every participant's status")
    return decided, statuses

  # ---------------------------------------------------------------- checkpoints

  def offer_state(self, step: int) -> None:
    """Offers this worker's parameters and optimizer entries (universal layout) to process 0."""
    from resilient_jax.checkpoint import universal

    entries = {"p/" + k: v for k, v in self.params.items()}
    entries.update({"o/" + k: v for k, v in universal.flatten_state(self.opt_state).items()})
    names = sorted(entries)
    self.cluster.kv_set(
      f"state/{step}/{self.stage}",
      [[n, list(entries[n].shape), str(entries[n].dtype)] for n in names],
    )
    self.cluster.offer(transfer_id(step, 63, 0, self.stage, STATE), [entries[n] for n in names])

  def gather_state(
    self, step: int, holders: Mapping[int, Worker]
  ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Process 0: every stage's state from `holders[stage]`, in the universal layout.

    Returns None if a holder died before handing its state over.
    """
    from resilient_jax.checkpoint import universal

    params: dict[str, Any] = {}
    opt: list[dict[str, Any]] = []
    for stage, holder in sorted(holders.items()):
      if holder == self.worker:
        params.update(self.params)
        opt.append(universal.flatten_state(self.opt_state))
        continue
      spec = self.cluster.await_key(
        f"state/{step}/{stage}", self.process_of[holder], f"stage {stage}'s state"
      )
      if spec is None:  # the holder died first
        return None
      specs = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dt)) for _, shape, dt in spec]
      got = self.cluster.pull(
        self.process_of[holder], transfer_id(step, 63, 0, stage, STATE), specs
      )
      if got is None or self.cluster.wait(got, f"stage {stage}'s state") is not None:
        return None
      values = dict(zip([n for n, _, _ in spec], got, strict=True))
      params.update({n[2:]: v for n, v in values.items() if n.startswith("p/")})
      opt.append({n[2:]: v for n, v in values.items() if n.startswith("o/")})
    return params, universal.merge(opt)

  def import_state(self, params: Mapping[str, Any], opt_entries: Mapping[str, Any]) -> None:
    """Loads universal-layout state into this worker."""
    from resilient_jax.checkpoint import universal

    prog = self.programs[self.stage]
    missing = [n for n in prog.param_names if n not in params]
    if missing:
      raise KeyError(f"parameter {missing[0]!r} is missing from the checkpoint")
    self.params = {n: jax.device_put(params[n], self.device) for n in prog.param_names}
    state = universal.unflatten_state(self.opt_state, opt_entries, what="optimizer state")
    self.opt_state = jax.device_put(state, self.device)


def _split(entries: Mapping[str, Any], decision: str) -> tuple[Any | None, dict[int, Any]]:
  """A directory of per-process entries and one decision -> (decision or None, {pid: entry})."""
  return entries.get(decision), {int(k): v for k, v in entries.items() if k != decision}


def _attempt_key(step: int, attempt: int) -> str:
  """Where an attempt's statuses and decisions live in the key-value store."""
  return f"step/{step}/{attempt}"


def _device_of(process: int) -> jax.Device:
  """The (single) device of `process`."""
  return next(d for d in jax.devices() if d.process_index == process)
