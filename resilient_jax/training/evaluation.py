"""Held-out evaluation, a hook of the loop: the mean loss of the held-out samples under the
committed parameters, every `train.eval_every` steps and after the last.

It runs on the pipeline, not on one device: the parameters live split over the workers (and
processes) of the plan in force, and gathering them would cost a checkpoint's transfer per
evaluation and a device that holds the whole model. So an evaluation is the step's own forward
(`Interpreter.run_forward`): the plan's F ops only (`StepProgram.forward_only`), with the stage
programs, routes and transfers a step uses and the last stage's loss of every micro-batch. Its
loss is the training loss's definition and nothing is compiled for it; nothing is reduced,
stepped or changed.

The samples are `data.held_out`'s (a reserved id range of the synthetic source, the tail of a
token or text file), which training never reads, the same on every layout and policy. Each
batch holds one step's number of samples, split into micro-batches as a step's are, so the
evaluation's loss, the mean of its batches' mean losses, is the mean per-token loss over every
held-out sample: what one device computes (`reference.eval_reference`).

Failures: an attempt that loses nodes (in one process a `FaultEvent(evaluation=True)`, in a
job a process that died) commits nothing; the policy decides as for a step (`Failures.fail`)
and the batch runs again on its new plan, or a checkpoint is restored (the hook returns
`Rollback`: the loop goes on after the restored step). In a job every process runs the
hook (its slots' ops, the agreement on each batch's outcome) and process 0 writes. Recovery
events of these failures are not in `recovery.json`, which records failures inside a step;
`goodput.json` has them.

A model that draws random numbers (dropout) is evaluated with the training forward, its draws
folded with `(0, sample id)` (step 0 is no training step's): no eval-mode program is built.

Costs: per evaluation `train.eval_batches` forward passes of a step's samples (a step's F ops,
about a third of its compute; no all-reduce, no optimizer step), and in a job one agreement on
the outcome per batch; no compile.
"""

from __future__ import annotations

import math
import time

import numpy as np

from resilient_jax import recipe
from resilient_jax.observe.records import StepResult, WorkerLost
from resilient_jax.runtime.step_run import AfterOp
from resilient_jax.training.failures import Failures
from resilient_jax.training.hooks import Rollback, StepInfo
from resilient_jax.training.run import Run


def perplexity(loss: float) -> float:
  """`exp(loss)`, infinite where that overflows a float."""
  return math.exp(loss) if loss < math.log(np.finfo(np.float64).max) else math.inf


class Evaluation:
  """The hook: adds `eval_loss` and `eval_ppl` to the step's row (so to `metrics.jsonl` and
  its log line) and writes them to TensorBoard as `eval/loss` and `eval/ppl`."""

  def __init__(self, run: Run, failures: Failures):
    self.run, self.failures = run, failures

  def __call__(self, info: StepInfo) -> dict | Rollback:
    loss = self.evaluate(info.step)
    if isinstance(loss, Rollback):
      return loss
    ppl = perplexity(loss)
    self.run.board.scalars(info.step, "eval/", {"loss": loss, "ppl": ppl})
    return {"eval_loss": loss, "eval_ppl": ppl}

  def evaluate(self, step: int) -> float | Rollback:
    """The held-out loss under the parameters of committed `step`, or `Rollback` when a failure
    during it made the policy restore a checkpoint."""
    hook = self.failures.op_hook(step, evaluation=True)
    # Each batch's mean, weighted by its loss elements' weight (1 / its loss factor: equal
    # batches but for a weighted loss), so the result is the mean over every held-out token.
    means = []
    for b in range(self.run.cfg.train.eval_batches):
      mean = self._batch(step, b, hook)
      if isinstance(mean, Rollback):
        return mean
      means.append(mean)
    return float(np.average([m for m, _ in means], weights=[1.0 / f for _, f in means]))

  def _batch(self, step: int, batch: int, hook: AfterOp | None
             ) -> tuple[float, float] | Rollback:
    """Held-out batch `batch`'s mean loss and loss factor, attempted until an attempt
    commits (or a failure restores a checkpoint)."""
    run = self.run
    attempt = 0
    while True:
      n = recipe.num_microbatches(run.coordinator.plan)
      mb_ids, data = recipe.eval_data(run.cfg, run.source, batch, n)
      result = self._attempt(step, data, mb_ids, hook)
      if result.committed:
        recipe.processed_ids(mb_ids, result)  # every micro-batch once, or it raises
        return result.loss, result.loss_factor
      _, detect_s = self.failures.lost_in(result, step, attempt)
      restored = self.failures.fail(set(result.lost), step, mid_step=True, detect_s=detect_s,
                                    detected_at=result.detected_at, evaluation=True)
      if restored is not None:
        return Rollback(restored)
      run.log(f"  the evaluation after step {step} runs again on the new plan")
      attempt += 1

  def _attempt(self, step: int, data: dict[str, np.ndarray], mb_ids: np.ndarray,
               hook: AfterOp | None) -> StepResult:
    run = self.run
    run.attempts += 1  # its transfers and agreements are named apart from every step's
    try:
      return run.interpreter.run_forward(data, step=step, attempt=run.attempts,
                                         after_op=hook, seeds=recipe.sample_seeds(0, mb_ids))
    except WorkerLost as lost:
      return StepResult(0.0, {}, 0.0, [], [], committed=False, lost=frozenset({lost.node}),
                        detected_at=time.time())
