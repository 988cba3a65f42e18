"""What a run trains, built from its config: the model, the optimizer, the data and each
step's micro-batches. Shared by the training loop and the single-device reference it must match.
"""

from __future__ import annotations

import numpy as np
import optax
from flax import nnx

from resilient_jax import data as data_lib
from resilient_jax.config import RunConfig
from resilient_jax.runtime.interpreter import StepResult
from resilient_jax.schedule.plan import GridPlan, Plan


def make_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
  """AdamW with linear warmup and cosine decay; weight decay on matrices only."""
  t = cfg.train
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=t.learning_rate,
    warmup_steps=t.warmup_steps,
    decay_steps=max(t.steps, t.warmup_steps + 1),
    end_value=t.learning_rate * t.min_lr_ratio,
  )
  return optax.adamw(
    schedule,
    b1=t.b1,
    b2=t.b2,
    weight_decay=t.weight_decay,
    mask=lambda params: {k: v.ndim >= 2 for k, v in params.items()},
  )


def make_model(cfg: RunConfig) -> nnx.Module:
  """The configured model family's model, initialised from `train.seed`."""
  return cfg.model.build(cfg.train.seed)


def make_data(cfg: RunConfig) -> tuple[data_lib.DataSource, data_lib.BatchPlan]:
  t = cfg.train
  source = data_lib.make_source(
    t.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len, seed=t.seed
  )
  return source, data_lib.BatchPlan(source.num_samples, t.global_batch, t.seed)


def num_microbatches(plan: Plan) -> int:
  """Micro-batches of one step under `plan` (the global batch is always the same)."""
  if isinstance(plan, GridPlan):
    return plan.schedule.num_microbatches
  return plan.num_microbatches


def step_batch(
  cfg: RunConfig, source: data_lib.DataSource, plan: data_lib.BatchPlan, step: int,
  microbatches: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Sample ids per micro-batch `[n, microbatch]`, and inputs and targets of 1-based `step` as
  `[n, microbatch, seq_len]` arrays; n defaults to the configured grid's `dp * m`."""
  ids = plan.ids_for_step(step - 1)
  n = microbatches or cfg.mesh.dp * cfg.pipeline.microbatches
  mbs = data_lib.split_microbatches(ids, 1, n)
  inputs, targets = source.get(mbs.reshape(-1))
  shape = (*mbs.shape, cfg.model.seq_len)
  return mbs, inputs.reshape(shape), targets.reshape(shape)


def sample_seeds(step: int, mb_ids: np.ndarray) -> np.ndarray:
  """`(step, sample id)` of every sample, `[*mb_ids.shape, 2]` int32: what a model that draws
  random numbers folds into its RNG streams (`model.staging.Binder.apply`)."""
  ids = np.asarray(mb_ids, np.int64) % (2**31 - 1)
  return np.stack([np.full(ids.shape, step, np.int64), ids], axis=-1).astype(np.int32)


def processed_ids(mb_ids: np.ndarray, result: StepResult) -> np.ndarray:
  """The sample ids the step actually trained on, from the micro-batches it ran.

  Raises:
    RuntimeError: a micro-batch was skipped or run twice: the step's global batch changed.
  """
  done = sorted(result.processed)
  if done != list(range(len(mb_ids))):
    raise RuntimeError(
      f"step processed micro-batches {done}, expected each of 0..{len(mb_ids) - 1} once"
    )
  return mb_ids[np.asarray(done)].reshape(-1)
