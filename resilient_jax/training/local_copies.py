"""The training loop's local copies (`checkpoint/local.py`): what a process writes as process 0
is lost, and the resume from them when the job is relaunched.

Writing: each committed step's state is noted (`note`, from `Checkpoints.if_due`, which every
committed step reaches, and after each restore: references to the arrays the interpreter holds,
which are not donated, so nothing is copied; a step's arrays outlive it until the note after
the next step's hooks, old and new state together as inside every step, so the peak is the
step's own);
when the coordination service is found gone, `Cluster` calls `write` (the process's last words,
bounded by `distributed.wait_timeout_s`) before it exits 5. A process writes only its own
stages, so a job's copies cost each process its own state's bytes, whatever the job's size.

Resuming (`resume`, before a job's first step): process 0 publishes the lease token of the job
that held the workdir before (copies of any other job are refused), the steps of the shared
checkpoints and the last step `metrics.jsonl` holds (the optimizer's schedule counts its rows:
a step without its row is not resumed from); every process lists the steps at which the copies
it can read and the shared checkpoints hold every entry of its own stages (`local.covered_steps`);
process 0 picks the newest step all processes have (`local.newest_common_step`); every process
reads its stages at that step, verifying each entry's CRC32 as it reads (an entry damaged in
one replica's copy is taken from another's); if any process could not, the next older common
step is tried. Local copies are used only for a step newer than the newest shared checkpoint;
otherwise the resume is the shared checkpoint's, as before, with one line saying why.

Costs of a resume: two small agreements and a gather per round (one round unless a copy is
damaged); each process reads every copy's metadata and its own stages' bytes once.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from resilient_jax.checkpoint import local
from resilient_jax.checkpoint.lease import LEASE_FILE, read_lease
from resilient_jax.checkpoint.run_meta import checkpoint_meta
from resilient_jax.checkpoint.store import Loaded, committed_steps
from resilient_jax.files import read_jsonl
from resilient_jax.training.run import Run

ROUNDS = 3
"""Steps tried before the resume gives up on the local copies (each damaged somewhere)."""


def local_dir(run: Run) -> Path:
  """`checkpoint.local_dir`, or `WORKDIR/local` by default."""
  return Path(run.cfg.checkpoint.local_dir or run.workdir / "local")


class LocalCopies:
  """One run's local copies: the state noted at each commit, its write, and the resume."""

  def __init__(self, run: Run):
    self.run = run
    self.dir = local_dir(run)
    self.token: str | None = None
    """The lease token of this job (what its copies record); None: this run writes none."""
    self._noted: tuple[int, dict, dict, list] | None = None
    self._lock = threading.Lock()
    self.cluster = getattr(run.group, "cluster", None)
    if self.cluster is not None:
      self.cluster.last_words = self.write

  # ---------------------------------------------------------------- writing

  def begin(self, token: str | None) -> None:
    """Copies are written from now on (in a job), recording `token`: the workdir lease of this
    job, which process 0 took at the start (None elsewhere: they follow its agreement)."""
    if self.cluster is not None:
      self.token = self.run.group.agree("local/token", lambda: token)

  def note(self, step: int) -> None:
    """`step` committed: its state is what a write would copy (references, no copy)."""
    if self.token is None and self.cluster is not None and self.run.group.relaunched:
      self.token = self.cluster.kv_try_get("local/token")  # a joiner: the job's own
    if self.token is None:
      return
    ip = self.run.interpreter
    with self._lock:
      self._noted = (step, dict(ip.params),
                     {s: ip.program(s).opt_entries(ip.opt_state[s]) for s in ip.local_slots},
                     list(ip.local_slots))

  def forget(self) -> None:
    """The state no longer is the noted step's (a restore is under way)."""
    with self._lock:
      self._noted = None

  def write(self) -> str:
    """Writes this process's stages at the last committed step to its local folder (the last
    words of a process whose coordination service is gone; never raises). Returns where the
    copy went, or why there is none, for the process's exit line."""
    import jax

    run = self.run
    with self._lock:
      noted = self._noted
    if noted is None:
      return "no local copy: no step was committed yet"
    step, params, opt, slots = noted
    t0 = time.perf_counter()
    me = self.cluster.process_id
    try:
      state = run.interpreter.export_state(slots, params, opt)
      host = jax.device_get({"params": state[0], "opt_state": state[1]})
      meta = {"token": self.token, **checkpoint_meta(run.cfg, run.coordinator.plan, step)}
      path = local.write_copy(self.dir, me, step, host, meta)
    except Exception as e:  # the process is ending anyway: say why there is no copy
      why = f"no local copy of step {step} ({type(e).__name__}: {' '.join(str(e).split())})"
      self.cluster.log(f"process {me}: {why}")
      return why
    size = sum(a.nbytes for g in host.values() for a in g.values())
    self.cluster.log(f"process {me}: wrote its stages' state of step {step} to {path} "
                     f"({size / 2**20:.2f} MiB in {time.perf_counter() - t0:.2f}s)")
    return f"its stages' state of step {step} is in {path}"

  # ---------------------------------------------------------------- resuming

  def resume(self) -> Loaded | None:
    """The state of this process's stages at the newest step every stage can be read at from
    the local copies, if that is newer than the newest shared checkpoint; else None (the
    caller restores the shared checkpoint). Every process of a job calls it."""
    run, group = self.run, self.run.group
    start = group.agree("local/start", self._start_info)
    if start["token"] is None:
      return None  # the workdir's first job: nobody wrote a copy for it
    # Every process goes through every agreement below, whatever it found (a process that left
    # the protocol early would leave the others waiting for it).
    copies = local.scan(self.dir, lambda meta: local.refusal(meta, start["token"], run.cfg),
                        run.log if run.chief else lambda _: None)
    params, opt = run.interpreter.export_state()
    needs = {("params", n) for n in params} | {("opt_state", k) for k in opt}
    everything = needs | {n for c in copies for n in c.names}
    holdings = [(c.step, c.names) for c in copies] + [(s, everything) for s in start["shared"]]
    processes = range(group.processes or 1)
    found = group.gather("local/covered", {
      "covered": sorted(local.covered_steps(needs, holdings)),
      "copies": sorted({c.step for c in copies})}, processes)
    newest_shared = max(start["shared"], default=0)
    tried: set[int] = set()
    for attempt in range(ROUNDS):
      step = group.agree(f"local/pick/{attempt}", lambda: self._pick(
        found, newest_shared, start["rows"], tried))
      if step is None:
        return None
      tried.add(step)
      got = local.read_step(copies, needs, step, self.cluster.log if self.cluster else run.log)
      ok = group.gather(f"local/read/{attempt}", got is not None, processes)
      if group.agree(f"local/ok/{attempt}", lambda ok=ok, step=step: self._verdict(ok, step)):
        assert got is not None
        meta = next(c.meta for c in copies if c.step == step)
        if run.chief:
          shared = f"step {newest_shared}'s" if newest_shared else "none"
          run.log(f"resuming after step {step}, the newest step every stage can be read at: "
                  "the local copies the survivors wrote when process 0 was lost, read and "
                  f"CRC-verified (the newest shared checkpoint is {shared}: "
                  f"{step - newest_shared} step(s) fewer to redo)")
        return Loaded(step, got[0], got[1], meta, self.dir)
    return None

  def _start_info(self) -> dict[str, Any]:
    """Process 0's facts for the resume: the previous job's lease token, the shared
    checkpoints' steps, the last step `metrics.jsonl` holds."""
    run = self.run
    lease = read_lease(run.workdir / LEASE_FILE)
    rows = read_jsonl(run.workdir / "metrics.jsonl") if (run.workdir / "metrics.jsonl"
                                                          ).exists() else []
    steps = [r["step"] for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]
    return {"token": lease["token"] if lease else None, "shared": committed_steps(run.ckpt_dir),
            "rows": max(steps, default=0)}

  def _pick(self, found: dict[int, dict[str, list[int]]] | None, newest_shared: int, rows: int,
            tried: set[int]) -> int | None:
    """Process 0: the step to resume from the local copies, or None (with a line saying why,
    where any process found a copy)."""
    assert found is not None
    step, why = local.pick_resume({p: set(f["covered"]) - tried for p, f in found.items()},
                                  newest_shared, rows)
    held = sorted({s for f in found.values() for s in f["copies"]})
    if step is not None or not held:
      return step
    shared = f"step {newest_shared}" if newest_shared else "none"
    self.run.log(f"resuming from the shared checkpoints (the newest: {shared}), not from the "
                 f"local copies of step(s) {held} in {self.dir}: {why}")
    return None

  def _verdict(self, ok: dict[int, bool] | None, step: int) -> bool:
    assert ok is not None
    bad = sorted(p for p, good in ok.items() if not good)
    if bad:
      self.run.log(f"the local copies of step {step} did not read back whole for the stages of "
                   f"process(es) {bad} (CRC32): trying an older step")
    return not bad

