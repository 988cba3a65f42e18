"""What a run does after each committed step besides training, as hooks (Levanter's
`add_hook`): the metrics file, TensorBoard, the step's log line, timelines, the policy's step
times and the key-value store's clean-up. A benchmark or a notebook adds its own
(`Trainer.add_hook(fn, every=N)`) instead of copying the loop.

A hook receives the step's `StepInfo`, a read-only view (the metrics row as a mapping, the
parameters as a copy on request); it may return entries to add to the step's metrics row (the
evaluation's loss, the replica check's verdict), or `Rollback` when a failure inside it made the
policy restore a checkpoint (the evaluation's forward passes can lose nodes too): the hooks
after it do not run for that step and the loop goes on after the restored one. Hooks run in the
order they were added, after the step committed; the checkpoint is the last of them. A hook that
needs more of the run than the view (the library's own) is built with it. An end hook receives
the `Run` and every step's metrics row once the last step is done.

Costs: each standard hook is O(1) per step on process 0 (one line appended to a file, one
TensorBoard event, three key deletions in a job), except a profiled step's timeline drawing
(O(ops of the step)), which only the drawn steps pay, and the evaluation's forward passes
(`evaluation.py`), every `train.eval_every` steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from resilient_jax import data as data_lib
from resilient_jax.exit_codes import EXIT_NONFINITE
from resilient_jax.files import read_jsonl, write_text_atomic
from resilient_jax.observe.profiling import RunTimelines, costs_from_records, write_step_timeline
from resilient_jax.observe.records import StepResult
from resilient_jax.observe.utilization import mfu
from resilient_jax.schedule.cost import Timeline
from resilient_jax.schedule.plan import GridPlan
from resilient_jax.training.run import Run
from resilient_jax.training.stragglers import stragglers


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """A committed step, as hooks see it (read-only)."""

  step: int
  last: bool
  """The run's last step (`train.steps`, or `train.stop_after`)."""
  result: StepResult
  row: Mapping[str, Any]
  """Its line of `metrics.jsonl`, with what the hooks before this one added."""
  replayed: Timeline | None
  """A profiled step replayed with one core per worker (`profiling.replay_records`)."""
  compiles: int
  """XLA compilations during the step."""
  params: Callable[[], dict] = dataclasses.field(default=lambda: {}, repr=False)
  """The parameters after the step by name, gathered to the host (a copy)."""


@dataclasses.dataclass(frozen=True)
class Rollback:
  """What a hook returns when a failure inside it made the policy restore the checkpoint of
  `step`: the run goes on after that step."""

  step: int


def metrics_row(run: Run, step: int, result: StepResult, ids: np.ndarray, lr: float) -> dict:
  """A committed step's line of `metrics.jsonl` (`ids`: the sample ids it trained on; `lr`:
  the learning rate its optimizer step used)."""
  row = {
    "step": step, "loss": result.loss, "samples": int(len(ids)),
    "sample_digest": data_lib.sample_digest(ids), "live_workers": run.coordinator.live_count,
    "step_time_s": round(result.step_time_s, 6),
    "samples_per_s": round(len(ids) / result.step_time_s, 3),
    "tokens_per_s": round(len(ids) * run.cfg.model.seq_len / result.step_time_s, 1),
    "compile_s": round(result.built.seconds, 3), "schedule": run.coordinator.plan_name,
    "grad_norm": result.grad_norm, "lr": lr,
  }
  utilization = mfu(run.cfg, row["tokens_per_s"], run.device_kind)
  if utilization is not None:
    row["mfu"] = round(utilization, 4)
  row.update({k: True for k in ("skipped", "clipped") if getattr(result, k)})
  if any(result.device_bytes):
    row["device_bytes_out"], row["device_bytes_in"] = result.device_bytes
  row.update(run.group.row(result))
  return row


StepHook = Callable[[StepInfo], Mapping[str, Any] | Rollback | None]
EndHook = Callable[[Run, list[dict]], None]


class Hooks:
  """Hooks run after committed steps (`every` N steps, and the last) and at the run's end."""

  def __init__(self) -> None:
    self._steps: list[tuple[StepHook, int]] = []
    self._final: list[tuple[StepHook, int]] = []
    self._end: list[EndHook] = []

  def add(self, fn: StepHook, every: int = 1, *, final: bool = False) -> None:
    """Adds `fn`, run every `every` committed steps and the last; `final`: after every hook
    that is not (the run's stops and its checkpoint)."""
    if every < 1:
      raise ValueError(f"a hook runs every N >= 1 steps, not {every}")
    (self._final if final else self._steps).append((fn, every))

  def add_end(self, fn: EndHook) -> None:
    self._end.append(fn)

  def after_step(self, step: int, last: bool, result: StepResult, row: dict, **view: Any
                 ) -> Rollback | None:
    """Runs the hooks due after committed `step` over a read-only `StepInfo` (the `view`'s other
    fields); what they return is added to `row`. Returns the first `Rollback`, after which no
    hook runs for this step."""
    info = StepInfo(step, last, result, types.MappingProxyType(row), **view)
    for fn, every in self._steps + self._final:
      if step % every == 0 or last:
        out = fn(info)
        if isinstance(out, Rollback):
          return out
        if isinstance(out, Mapping):  # what else a hook returns is not the row's
          row.update(out)
    return None

  def at_end(self, run: Run, metrics: list[dict]) -> None:
    for fn in self._end:
      fn(run, metrics)


_NUMBERS = ("loss", "step_time_s", "samples_per_s", "tokens_per_s", "compile_s", "lr")


def is_metrics_row(row: object) -> bool:
  """Whether a line read back from `metrics.jsonl` is a row the resumed run can use: an object
  with an integer `step` >= 1 and a numeric `loss`, and numbers where a row has them (the
  end-of-run report sums and prints them)."""
  def number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)

  return (isinstance(row, dict) and isinstance(row.get("step"), int)
          and not isinstance(row["step"], bool) and row["step"] >= 1 and "loss" in row
          and all(number(row[k]) for k in _NUMBERS if k in row))


class MetricsFile:
  """`metrics.jsonl`: one line per committed step, on process 0 (`enabled`)."""

  def __init__(self, path: Path, enabled: bool):
    self.path, self.enabled = path, enabled

  def resume(self, start: int, log: Callable[[str], None], why_none: Callable[[], str]
             ) -> list[dict]:
    """The rows of the steps before `start` (an earlier run's), the file rewritten to them."""
    if not self.enabled:
      return []
    # Damaged lines are set aside (`metrics.jsonl.damaged`, one log line); the rewind below
    # then leaves only whole rows in the file.
    earlier = read_jsonl(self.path, log=log, valid=is_metrics_row, set_aside=True)
    if start == 1 and earlier:
      log(f"no checkpoint to resume from in {self.path.parent / 'checkpoints'} ({why_none()}): "
          f"starting from step 1; the {len(earlier)} step(s) metrics.jsonl holds from an "
          "earlier run are lost and will be redone")
    return self.rewind([r for r in earlier if r["step"] < start])

  def rewind(self, rows: list[dict]) -> list[dict]:
    """Keeps `rows` only (a restore redoes the steps after them)."""
    if self.enabled:
      write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows

  def __call__(self, info: StepInfo) -> None:
    if self.enabled:
      with self.path.open("a") as f:
        f.write(json.dumps(dict(info.row)) + "\n")


class NonFiniteSteps(RuntimeError):
  """`train.max_nonfinite_steps` steps in a row had non-finite gradients."""

  exit_code = EXIT_NONFINITE


class NonFiniteStreak:
  """The skipped (non-finite) steps in a row, and the stop after `train.max_nonfinite_steps`.

  A resume counts on from the rows `metrics.jsonl` holds just before its first step, so a run
  stopped with exit 8 gets no fresh allowance by resuming. Process 0 holds the file, so it
  decides for the job; a process relaunched into a live job starts at 0.
  """

  def __init__(self, run: Run):
    self.run = run
    self.limit = run.cfg.train.max_nonfinite_steps
    self.count = 0

  def resume(self, start: int, metrics: list[dict]) -> None:
    """Counts on from the rows before `start` (`metrics`)."""
    run = self.run

    def before() -> int:
      n = 0
      for row in reversed(metrics):
        if not row.get("skipped") or row["step"] != start - 1 - n:
          break
        n += 1
      return n

    resumed = start > 1 and not run.group.relaunched
    self.count = run.group.agree("nonfinite/start", before) if resumed else 0
    if self.count:
      run.log(f"{_steps(start - self.count, start - 1)} had non-finite gradients (skipped): "
              f"{self.count} of train.max_nonfinite_steps={self.limit} in a row count on")

  def __call__(self, info: StepInfo) -> None:
    """Counts committed `info.step`; raises `NonFiniteSteps` when the streak reaches the
    limit."""
    step, skipped = info.step, info.result.skipped
    self.count = self.count + 1 if skipped else 0
    if self.count >= self.limit:
      raise NonFiniteSteps(f"{self.count} steps in a row had non-finite gradients "
                           f"({_steps(step - self.count + 1, step)}); stopping "
                           "(train.max_nonfinite_steps)")


def _steps(first: int, last: int) -> str:
  return f"step {last}" if first == last else f"steps {first}-{last}"


def step_line(run: Run, info: StepInfo) -> None:
  """The step's progress line."""
  r, row = info.result, info.row
  run.log(
    f"step {info.step:4d}/{run.cfg.train.steps}  loss {r.loss:.4f}  "
    f"grad_norm {r.grad_norm:.3g}  lr {row['lr']:.2e}  "
    f"samples/s {row['samples_per_s']:9.1f}  tokens/s {row['tokens_per_s']:9.0f}  "
    + (f"mfu {row['mfu']:.1%}  " if "mfu" in row else "")
    + f"step_time {r.step_time_s:.3f}s  "
    f"workers {row['live_workers']}  schedule {row['schedule']}"
    + (f"  eval_loss {row['eval_loss']:.4f}  eval_ppl {row['eval_ppl']:.4g}"
       if "eval_loss" in row else "")
    + ("  SKIPPED: non-finite gradients, no stage stepped" if r.skipped else "")
    + (f"  (+{r.built.seconds:.1f}s building {r.built.describe()})" if r.built.programs()
       else ""))


def step_times(run: Run, info: StepInfo) -> None:
  """The step's time to the policy's report of a failure (after the step's line: a failure's
  report names this step)."""
  coord, records = run.coordinator, info.result.records
  measured = None
  if info.replayed is not None and isinstance(coord.plan, GridPlan):
    measured = (coord.plan.schedule, costs_from_records(records, coord.grid.pp))
  coord.record_step_time(
    info.step, info.result.step_time_s, profiled=bool(records),
    replayed_s=info.replayed.makespan if info.replayed else None, measured=measured)


def forget_old_agreements(run: Run, info: StepInfo) -> None:
  """Drops the agreements of the step `distributed.kv_keep_steps` back (a job's process 0)."""
  keep = run.cfg.distributed.kv_keep_steps
  if run.chief and info.step > keep:
    run.group.forget(info.step - keep)


class Schedules:
  """Every schedule the run used, written to `schedule.txt` at the end (process 0)."""

  def __init__(self, run: Run) -> None:
    self.run = run
    self.seen: list[str] = []
    self._plan: object = None

  def __call__(self, info: StepInfo) -> None:
    # A plan's text holds every worker's op list (O(dp * pp * m)): made once per plan the
    # coordinator puts in force, not once per step.
    plan = self.run.coordinator.plan
    if plan is self._plan:
      return
    self._plan = plan
    text = plan.to_text()
    if not self.seen or self.seen[-1] != text:
      self.seen.append(text)

  def write(self, run: Run, metrics: list[dict]) -> None:
    if run.chief:
      write_text_atomic(run.workdir / "schedule.txt", "\n\n".join(self.seen) + "\n")


class Timelines:
  """Draws the profiled steps `RunTimelines` picks: `timeline_step<N>.*` around failures and
  `timeline.*` for the last step."""

  def __init__(self, run: Run, timelines: RunTimelines):
    self.run, self.timelines = run, timelines
    self.stepped = False  # a step of this run committed

  def __call__(self, info: StepInfo) -> None:
    self.stepped = True
    if info.replayed is None:
      return
    kind = self.timelines.kind(info.step, bool(self.run.coordinator.failed))
    for drawing in ([kind] if kind else []) + ([None] if info.last else []):
      self._draw(info, drawing)

  def _draw(self, info: StepInfo, kind: str | None) -> None:
    coord = self.run.coordinator
    plan = coord.plan
    at = {}
    for fstep, node in coord.failed:
      if node not in coord.live:  # a rejoined node runs again
        at.setdefault(node, fstep)
    failed = {w: at[n] for w, n in plan.nodes.items() if n in at}
    tl = self.timelines
    stem = f"timeline_step{info.step}" if kind else "timeline"
    title = tl.title(info.step, kind, failed, [f for f, _ in coord.failed], info.compiles)
    write_step_timeline(plan.schedule, info.result.records, self.run.workdir, title=title,
                        stem=stem, failed=failed, replayed=info.replayed,
                        metadata={"step": info.step, "drawn_as": kind or "last step",
                                  "xla_compiles_in_step": info.compiles})
    tl.written += [f"{stem}.png", f"{stem}.json"]

  def explain_none(self, run: Run, metrics: list[dict]) -> None:
    """Says why there is no timeline of the last step, where there is none."""
    if run.chief and self.stepped and "timeline.png" not in self.timelines.written:
      why = ("a multi-process job's processes time only their own workers" if not
             run.group.profiles else
             f"timelines replay grid schedules, and {run.coordinator.plan_name} runs pipeline "
             "sets")
      run.log(f"no timeline of the last step: {why}")


def summary(run: Run, metrics: list[dict]) -> None:
  """The run's closing lines on process 0: the policy's summary, goodput, and the key-value
  store's kept steps."""
  if not run.chief:
    return
  if run.coordinator.failed:
    for line in run.coordinator.summary():
      run.log(line)
  if run.goodput.events:
    g = run.goodput.write(run.workdir / "goodput.json", metrics)["run"]
    run.log(f"goodput: effective training time {g['effective_fraction']:.1%} of the wall time "
            f"({g['failures']} failure(s), {g['rejoins']} rejoin(s), {g['steps_rerun']} step(s) "
            f"re-run; {g['startup_s']:.1f}s of it starting up): {run.workdir / 'goodput.json'}")


def kept_agreements(run: Run, metrics: list[dict]) -> None:
  kept = run.group.kept_keys() if run.chief else None
  if kept is not None:
    run.log(f"coordination service: keys of step(s) {', '.join(map(str, kept))} kept "
            f"(distributed.kv_keep_steps={run.cfg.distributed.kv_keep_steps})")


def standard_hooks(run: Run, timelines: RunTimelines, metrics_file: MetricsFile,
                   evaluation: StepHook | None = None, integrity: StepHook | None = None,
                   ) -> Hooks:
  """The hooks every run has, in their order; `evaluation` every `train.eval_every` steps (and
  the last) when that is set, and `integrity` (the replica check, `integrity.py`) and the
  straggler watch (`resilience.straggler_every`, `stragglers.py`) after every step, all before
  the step's row is written anywhere, so that what they add goes with it."""
  hooks = Hooks()
  drawings, schedules = Timelines(run, timelines), Schedules(run)
  hooks.add(drawings)
  hooks.add(schedules)
  if evaluation is not None and run.cfg.train.eval_every:
    hooks.add(evaluation, run.cfg.train.eval_every)
  for check in (integrity, stragglers(run.cfg, run, timelines)):
    if check is not None:
      hooks.add(check)
  hooks.add(metrics_file)
  hooks.add(lambda info: run.board.step(dict(info.row)))
  for fn in (forget_old_agreements, step_line, step_times):
    hooks.add(functools.partial(fn, run))
  hooks.add_end(summary)
  hooks.add_end(schedules.write)
  hooks.add_end(drawings.explain_none)
  hooks.add_end(kept_agreements)
  return hooks
