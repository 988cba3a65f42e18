"""A decoder-only GPT in Flax NNX that can be cut into pipeline stages.

Staging protocol (`StageableModel`): a model has `num_layers` blocks; `make_stage(layers,
first, last)` returns a module sharing this model's submodules that maps the stage input to its
output. The first stage owns the embeddings and takes token ids, the last owns the final norm
and the head and returns logits, the others map hidden states to hidden states. With a tied head
the last stage shares the token embedding layer (same parameter name `wte.embedding`); the
runtime sums the gradients of a parameter that several stages hold, as Megatron does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import Dense, Embed, LayerNorm

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 256
  seq_len: int = 32
  num_layers: int = 4
  num_heads: int = 2
  d_model: int = 64
  mlp_ratio: int = 4
  tied_head: bool = False

  def __post_init__(self):
    for key in ("vocab_size", "seq_len", "num_layers", "num_heads", "d_model", "mlp_ratio"):
      if getattr(self, key) <= 0:
        raise ValueError(f"model.{key} must be positive, got {getattr(self, key)}")
    if self.d_model % self.num_heads:
      raise ValueError(
        f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}"
      )

  @property
  def num_params(self) -> int:
    d, v, t, f = self.d_model, self.vocab_size, self.seq_len, self.mlp_ratio * self.d_model
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    head = 0 if self.tied_head else d * v + v
    return v * d + t * d + self.num_layers * block + 2 * d + head


class Attention(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, name: str, rngs: nnx.Rngs):
    self.num_heads = cfg.num_heads
    self.qkv = Dense(cfg.d_model, 3 * cfg.d_model, name=f"{name}.qkv", rngs=rngs)
    # GPT-2's residual-projection scaling keeps the residual stream's variance depth-independent.
    out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
    self.proj = Dense(cfg.d_model, cfg.d_model, name=f"{name}.proj", rngs=rngs, std=out_std)

  def __call__(self, x: Array) -> Array:
    b, t, d = x.shape
    h = self.num_heads
    q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
    q, k, v = (a.reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for a in (q, k, v))
    scores = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.float32(d // h))
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    out = jax.nn.softmax(scores, axis=-1) @ v
    return self.proj(out.transpose(0, 2, 1, 3).reshape(b, t, d))


class MLP(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, name: str, rngs: nnx.Rngs):
    hidden = cfg.mlp_ratio * cfg.d_model
    out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
    self.fc = Dense(cfg.d_model, hidden, name=f"{name}.fc", rngs=rngs)
    self.proj = Dense(hidden, cfg.d_model, name=f"{name}.proj", rngs=rngs, std=out_std)

  def __call__(self, x: Array) -> Array:
    return self.proj(jax.nn.gelu(self.fc(x)))


class Block(nnx.Module):
  """Pre-LN transformer block."""

  def __init__(self, cfg: GPTConfig, index: int, *, rngs: nnx.Rngs):
    name = f"blocks.{index}"
    self.ln1 = LayerNorm(cfg.d_model, name=f"{name}.ln1")
    self.attn = Attention(cfg, name=f"{name}.attn", rngs=rngs)
    self.ln2 = LayerNorm(cfg.d_model, name=f"{name}.ln2")
    self.mlp = MLP(cfg, name=f"{name}.mlp", rngs=rngs)

  def __call__(self, x: Array) -> Array:
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class GPTStage(nnx.Module):
  """A contiguous slice of a GPT; the whole model is the stage that is both first and last."""

  def __init__(
    self,
    blocks: Sequence[Block],
    *,
    wte: Embed | None,
    wpe: Embed | None,
    ln_f: LayerNorm | None,
    head: Dense | Embed | None,
  ):
    self.first = wpe is not None
    self.last = ln_f is not None
    self.wte = wte
    self.wpe = wpe
    self.blocks = nnx.List(list(blocks))
    self.ln_f = ln_f
    self.head = head

  def __call__(self, x: Array) -> Array:
    if self.first:
      positions = jnp.arange(x.shape[-1])
      x = self.wte(x) + self.wpe(positions)[None]
    for block in self.blocks:
      x = block(x)
    if self.last:
      x = self.ln_f(x)
      x = self.head.attend(x) if isinstance(self.head, Embed) else self.head(x)
    return x


class StageableModel(Protocol):
  """What the pipeline runtime needs from a model."""

  num_layers: int

  def make_stage(self, layers: range, *, first: bool, last: bool) -> nnx.Module: ...

  def loss(self, outputs: Array, targets: Array) -> Array:
    """Per-token losses of the last stage's outputs (summed by the caller)."""
    ...


class GPT(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.num_layers = cfg.num_layers
    self.wte = Embed(cfg.vocab_size, cfg.d_model, name="wte", rngs=rngs)
    self.wpe = Embed(cfg.seq_len, cfg.d_model, name="wpe", rngs=rngs, std=0.01)
    self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
    self.ln_f = LayerNorm(cfg.d_model, name="ln_f")
    self.head = (
      None if cfg.tied_head else Dense(cfg.d_model, cfg.vocab_size, name="head", rngs=rngs)
    )

  def make_stage(self, layers: range, *, first: bool, last: bool) -> GPTStage:
    return GPTStage(
      [self.blocks[i] for i in layers],
      wte=self.wte if (first or (last and self.cfg.tied_head)) else None,
      wpe=self.wpe if first else None,
      ln_f=self.ln_f if last else None,
      head=(self.wte if self.cfg.tied_head else self.head) if last else None,
    )

  def loss(self, outputs: Array, targets: Array) -> Array:
    logz = jax.nn.logsumexp(outputs, axis=-1)
    picked = jnp.take_along_axis(outputs, targets[..., None], axis=-1)[..., 0]
    return logz - picked

  def __call__(self, tokens: Array) -> Array:
    return self.make_stage(range(self.num_layers), first=True, last=True)(tokens)


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
      raise ValueError(f"mesh.pp={num_stages} is more stages than model.num_layers={num_layers}")
    base, extra = divmod(num_layers, num_stages)
    counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
  counts = list(counts)
  if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 0:
    raise ValueError(
      f"pipeline.partition={counts} must be {num_stages} non-negative layer counts "
      f"summing to model.num_layers={num_layers}"
    )
  starts = [sum(counts[:s]) for s in range(num_stages)]
  return [range(a, a + c) for a, c in zip(starts, counts, strict=True)]
