"""What a run trains, built from its config: the model, the optimizer, the data and each
step's micro-batches. Shared by the training loop and the single-device reference it must match.
"""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np
import optax
from flax import nnx

from resilient_jax import data as data_lib
from resilient_jax.config import ConfigError, RunConfig
from resilient_jax.observe.records import StepResult
from resilient_jax.programs.compiled import RUN_ONCE, OnEachDevice, default_device
from resilient_jax.schedule.plan import GridPlan, Plan


def learning_rate(cfg: RunConfig) -> optax.Schedule:
  """The configured learning-rate schedule over `train.steps`."""
  o, steps = cfg.optimizer, cfg.train.steps
  peak, end = o.learning_rate, o.learning_rate * o.min_lr_ratio
  if o.schedule == "constant":
    return optax.constant_schedule(peak)
  decay = max(steps, o.warmup_steps + 1)
  if o.schedule == "linear":
    return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, o.warmup_steps),
       optax.linear_schedule(peak, end, decay - o.warmup_steps)], [o.warmup_steps])
  return optax.warmup_cosine_decay_schedule(0.0, peak, o.warmup_steps, decay, end)


def decay_mask(cfg: RunConfig):
  """Which parameters decay: matrices (not biases and norms), embeddings as configured."""
  embeddings = cfg.optimizer.decay_embeddings

  def mask(params: dict) -> dict:
    return {k: v.ndim >= 2 and (embeddings or not k.endswith("embedding"))
            for k, v in params.items()}

  return mask


def make_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
  """The per-stage optimizer of `optimizer.*`, without clipping: a stage cannot see the global
  norm, so the runtime applies the clip factor itself (`Interpreter`), and the single-device
  reference chains `optax.clip_by_global_norm` in front (`reference_optimizer`)."""
  o, lr, mask = cfg.optimizer, learning_rate(cfg), decay_mask(cfg)
  if o.name == "adamw":
    return optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask)
  if o.name == "lion":
    return optax.lion(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=mask)
  if o.name == "adafactor":
    return optax.adafactor(lr, eps=o.eps, weight_decay_rate=o.weight_decay or None,
                           weight_decay_mask=mask)
  inner = (optax.adam(lr, b1=o.b1, b2=o.b2, eps=o.eps) if o.name == "adam"
           else optax.sgd(lr, momentum=o.momentum or None))
  return optax.chain(optax.add_decayed_weights(o.weight_decay, mask), inner)


def optimizer_key(cfg: RunConfig) -> tuple:
  """Everything `make_optimizer(cfg)` computes with, hashable: two configs with the same key
  build optimizers that compile to the same programs (`shared.build_stage_programs` shares
  them). The learning-rate schedule reads `train.steps` only through its decay length."""
  o = cfg.optimizer
  return o, (None if o.schedule == "constant" else max(cfg.train.steps, o.warmup_steps + 1))


def reference_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
  """What one device runs: `make_optimizer` behind global-norm clipping when configured."""
  clip = cfg.optimizer.clip_global_norm
  inner = make_optimizer(cfg)
  return optax.chain(optax.clip_by_global_norm(clip), inner) if clip else inner


def make_model(cfg: RunConfig) -> nnx.Module:
  """The configured model family's model, initialised from `train.seed`.

  Initialised by one compiled program rather than op by op: eagerly, every initializer is a
  program of its own (a few dozen), compiled in every process of a job, since JAX's persistent
  cache is written by process 0 only and keyed by device; `compiled.OnEachDevice` keeps the one
  program on disk by module, so every process loads it. It runs once, so XLA compiles it
  without optimizing (`compiled.RUN_ONCE`): values equal to the last bit or two of float32 of
  an optimized compile, and a few times faster to build. The seed's key is the program's argument,
  and the program is kept per model config (`_initializer`): a process that builds the same
  model again, whatever its seed (a test suite, a sweep, the single-device reference), only
  runs it. A family whose `build` cannot be traced is built eagerly."""
  graphdef, init = _initializer(cfg.model)
  if init is not None:
    try:
      key = jax.device_put(jax.random.key(cfg.train.seed), default_device())
      return nnx.merge(graphdef, init(key))
    except _UNTRACEABLE as err:
      logging.getLogger(__name__).info("building the model eagerly: %s", err)
  return cfg.model.build(cfg.train.seed)


_UNTRACEABLE = (jax.errors.JAXTypeError, jax.errors.JAXIndexError, TypeError)
"""What tracing a `build` that needs concrete values raises."""


@functools.lru_cache(maxsize=4)
def _initializer(model_cfg) -> tuple[nnx.GraphDef | None, OnEachDevice | None]:
  """The model's structure and the program that computes its state from a seed's PRNG key
  (`jax.random.key(seed)`), or `(None, None)` where `build` cannot be traced."""
  try:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: model_cfg.build(0)))
    # `nnx.Rngs` takes an int seed's key as it takes the int itself (`ModelConfig.build`).
    init = OnEachDevice(lambda key: nnx.state(model_cfg.build(key)), compiler_options=RUN_ONCE)
  except _UNTRACEABLE as err:
    logging.getLogger(__name__).info("building the model eagerly: %s", err)
    return None, None
  return graphdef, init


def make_data(cfg: RunConfig, data: object = None
              ) -> tuple[data_lib.Batched, data_lib.BatchPlan]:
  """The run's samples and which of them each step reads: `data`, the user's random-access
  source (`data.RecordSource`), or the configured token source (`train.data`)."""
  t = cfg.train
  try:
    if data is not None:
      source = data if isinstance(data, data_lib.RecordSource) else data_lib.RecordSource(data)
    else:
      source = data_lib.make_source(
        t.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len, seed=t.seed,
        path=t.data_path, dtype=t.data_dtype,
      )
  except ValueError as e:  # a missing or malformed data file is the config's to fix
    raise ConfigError(str(e)) from None
  try:
    trained, _ = data_lib.held_out(source.num_samples, eval_samples(cfg))
  except ValueError as e:
    raise ConfigError(f"train.eval_batches={t.eval_batches}: {e}") from None
  return source, data_lib.BatchPlan(trained, cfg.step_batch, t.seed)


def eval_samples(cfg: RunConfig) -> int:
  """Samples an evaluation runs (`train.eval_batches` steps' worth); 0 with evaluation off."""
  return cfg.train.eval_batches * cfg.step_batch if cfg.train.eval_every else 0


def num_microbatches(plan: Plan) -> int:
  """Micro-batches of one step under `plan` (the global batch is always the same)."""
  if isinstance(plan, GridPlan):
    return plan.schedule.num_microbatches
  return plan.num_microbatches


def step_data(
  cfg: RunConfig, source: data_lib.Batched, plan: data_lib.BatchPlan, step: int,
  microbatches: int | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Sample ids per micro-batch `[n, microbatch]`, and the batch of 1-based `step`: every
  entry `[n, microbatch, ...]`; n defaults to the configured grid's `dp * m`."""
  return _microbatches(cfg, source, plan.ids_for_step(step - 1), microbatches)


def step_batch(
  cfg: RunConfig, source: data_lib.Batched, plan: data_lib.BatchPlan, step: int,
  microbatches: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`step_data` of a token source as `(ids, inputs, targets)`, each `[n, microbatch, ...]`."""
  ids, batch = step_data(cfg, source, plan, step, microbatches)
  return ids, batch["tokens"], batch["targets"]


def eval_data(
  cfg: RunConfig, source: data_lib.Batched, batch: int, microbatches: int | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """`step_data`'s arrays for 0-based held-out batch `batch` of an evaluation (one step's
  number of samples, `data.held_out`'s ids in order)."""
  _, ids = data_lib.held_out(source.num_samples, eval_samples(cfg))
  n = cfg.step_batch
  return _microbatches(cfg, source, ids[batch * n:(batch + 1) * n], microbatches)


def _microbatches(cfg: RunConfig, source: data_lib.Batched, ids: np.ndarray,
                  microbatches: int | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  n = microbatches or cfg.mesh.dp * cfg.step_microbatches
  mbs = data_lib.split_microbatches(ids, 1, n)
  batch = source.batch(mbs.reshape(-1))
  return mbs, {k: v.reshape(*mbs.shape, *v.shape[1:]) for k, v in batch.items()}


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
