"""A model family's config section, and the one cost description every planner prices by.

`model.name` picks the family (`gpt`, `llama`: the example models in `models/`); each family
is a frozen dataclass with its own keys. A model passed to `train(model=...)` is described by a
`CustomModelConfig` measured from the model itself. None of this imports JAX, so the planners,
the policy layer and the simulator stay free of it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any

from resilient_jax.checks import require_ints

DTYPES = ("float32", "bfloat16", "float16")
"""Compute dtypes a model family's `model.dtype` may name."""

REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable",
         "everything_saveable", "checkpoint_dots", "checkpoint_dots_with_no_batch_dims")
"""What `model.remat` may name: `none`, `full` (`jax.checkpoint`: a block's forward keeps only
its inputs), or a `jax.checkpoint_policies` policy that takes no arguments (what else the
forward keeps). Listed here, not read from JAX, so that checking a config imports no JAX."""

FAMILIES = {"gpt": "resilient_jax.examples.configs:GPTConfig",
            "llama": "resilient_jax.examples.configs:LlamaConfig"}
"""Model families selectable with `model.name`, as `module:class` (imported when chosen): a
config class whose module imports no JAX, its `build` importing the model. The example models
are the checkout's `models/` folder, installed as `resilient_jax.examples` (`pyproject.toml`):
the one name they are imported by, so each class exists once in a process."""


@dataclasses.dataclass(frozen=True)
class ModelCosts:
  """What the planners need to know of a model: forward multiply-adds per sequence and
  parameter counts, of one block (every block costs the same), the embedding and the head, and
  the width of the hidden states a stage hands to the next (per token)."""

  block_flops: float
  head_flops: float
  embed_params: int
  block_params: int
  head_params: int
  hidden: int


class ModelConfig:
  """What every model family's config provides (a frozen dataclass with at least these keys)."""

  name: str
  vocab_size: int
  seq_len: int
  num_layers: int
  remat: str
  """How each block is rematerialised (`REMAT`; `staging.run_block`)."""

  def costs(self) -> ModelCosts:
    raise NotImplementedError

  def build(self, seed: Any):
    """The model (an `nnx.Module` following `resilient_jax.model`'s protocol), its parameters
    drawn from `seed`: an int, or that int's key `jax.random.key(seed)`, traced
    (`recipe.make_model` compiles one initializer per config, the key its argument). Passing
    it to `nnx.Rngs` serves both."""
    raise NotImplementedError

  def check_positive(self, *keys: str) -> None:
    require_ints("model.", {k: getattr(self, k) for k in keys})

  def check_remat(self) -> None:
    """For every family: `model.remat` is one of `REMAT` (`staging.run_block` applies it)."""
    if self.remat not in REMAT:
      raise ValueError(f"model.remat={self.remat!r} is not one of {', '.join(REMAT)}")

  def check_precision(self) -> None:
    """For families with `dtype` (compute) and `param_dtype` (stored parameters) keys."""
    for key in ("dtype", "param_dtype"):
      if getattr(self, key) not in DTYPES:
        raise ValueError(f"model.{key}={getattr(self, key)!r} is not one of {', '.join(DTYPES)}")
    if self.param_dtype != "float32":
      raise ValueError("model.param_dtype must be float32: the optimizer keeps float32 master "
                       "parameters (compute in lower precision with model.dtype)")

  @property
  def precision(self) -> dict[str, str]:
    """`dtype` and `param_dtype`, as keyword arguments of every nnx layer."""
    return {"dtype": self.dtype, "param_dtype": self.param_dtype}


def family(name: str) -> type:
  """The config class of model family `name`.

  Raises:
    ValueError: an unknown family.
  """
  if name not in FAMILIES:
    raise ValueError(f"model.name={name!r} is not one of {', '.join(FAMILIES)}")
  module, cls = FAMILIES[name].split(":")
  return getattr(importlib.import_module(module), cls)


@dataclasses.dataclass(frozen=True)
class CustomModelConfig(ModelConfig):
  """A user's model, passed to `train(model=...)`: measured once, when the run starts.

  Attributes:
    fingerprint: parameter names and shapes, hashed; a checkpoint resumes only the same model.
  """

  name: str = "custom"
  vocab_size: int = 256
  seq_len: int = 32
  num_layers: int = 1
  block_flops: float = 1.0
  head_flops: float = 0.0
  embed_params: int = 0
  block_params: int = 0
  head_params: int = 0
  hidden: int = 1
  fingerprint: str = ""
  remat: str = "none"
  """The config's `model.remat`: a user's model is rematerialised like a family's."""
  layers: str = ""
  """The config's `model.layers`: the dotted path of the model's blocks ("": found)."""
  module: str = ""
  """The config's `model.module`: `package.module:build` of the model ("": passed to
  `train(model=...)`)."""

  def __post_init__(self):
    self.check_remat()

  def costs(self) -> ModelCosts:
    return ModelCosts(self.block_flops, self.head_flops, self.embed_params, self.block_params,
                      self.head_params, self.hidden)

  def build(self, seed: int):
    raise ValueError("a custom model is passed to train(model=...), not built from the config")


def partition_layers(
  num_layers: int, num_stages: int, counts: Sequence[int] | None = None
) -> list[range]:
  """Blocks per stage: even split (earlier stages take the remainder) or explicit counts.

  Raises:
    ValueError: more stages than layers, or counts that do not cover the layers.
  """
  if num_stages <= 0:
    raise ValueError(f"mesh.pp must be positive, got {num_stages}")
  if counts is None or len(counts) == 0:
    if num_stages > num_layers:
      raise ValueError(f"mesh.pp={num_stages} is more stages than the model's {num_layers} "
                       "blocks")
    base, extra = divmod(num_layers, num_stages)
    counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
  counts = list(counts)
  if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 0:
    raise ValueError(
      f"pipeline.partition={counts} must be {num_stages} non-negative layer counts "
      f"summing to the model's {num_layers} blocks"
    )
  starts = [sum(counts[:s]) for s in range(num_stages)]
  return [range(a, a + c) for a, c in zip(starts, counts, strict=True)]
