"""A decoder-only GPT-2-style model from stock Flax NNX layers, in the library's model protocol
(`embed`, `blocks`, `head`; see `resilient_jax.model`).

With `tied_head` the head projects onto the token embedding (`Embed.attend`): the first and
last stages then hold the same weight under one name (`embed.wte.embedding`), and the runtime
sums its two gradients, as Megatron does.

Every matrix names its axes (`logical`, Flax NNX sharding metadata) so a stage on a sub-mesh
(`mesh.tp > 1`, `resilient_jax.model.sharding`) splits the blocks Megatron-style: the fused
QKV and the MLP's first layer by columns (`heads`, `mlp`), the attention and MLP output
projections by rows. The fused QKV's columns are `[q | k | v]`, so a split of them is not
aligned with heads: the partitioner moves q, k and v between the devices once per block (a
model with separate Q, K and V projections, `models/llama.py`, splits along heads exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .configs import GPTConfig  # its config section, in a module free of JAX

Array = jax.Array


def tokens(layer: Callable[[Array], Array], x: Array) -> Array:
  """`layer(x)` on `x` `[..., features]` with the leading dimensions flattened into one.

  The values are those of `layer(x)`; the form is for speed. XLA:CPU runs the backward of a
  dense layer on 3-D activations (`x @ kernel`, x `[batch, seq, d]`) 1.6-1.8x slower than on a
  2-D `[batch * seq, d]` matrix: the weight gradient contracts two axes, and XLA copies a
  transposed operand first. On GPU XLA folds that transpose into the GEMM, so this only keeps
  the CPU figures (the library's and the plain baselines', which share the model) honest.
  """
  y = layer(x.reshape(-1, x.shape[-1]))
  return y.reshape(*x.shape[:-1], y.shape[-1])


def logical(init: Callable, *axes: str | None) -> Callable:
  """`init` with the parameter's logical axis names as metadata (placed nowhere when built)."""
  return nnx.with_partitioning(init, axes, eager_sharding=False)


def _dense(cfg: GPTConfig, din: int, dout: int, rngs: nnx.Rngs, std: float = 0.02,
           axes: tuple[str | None, str | None] = ("embed", "embed")) -> nnx.Linear:
  return nnx.Linear(din, dout, kernel_init=logical(nnx.initializers.normal(std), *axes),
                    bias_init=logical(nnx.initializers.zeros_init(), axes[1]), rngs=rngs,
                    **cfg.precision)


class Attention(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.num_heads = cfg.num_heads
    self.qkv = _dense(cfg, cfg.d_model, 3 * cfg.d_model, rngs, axes=("embed", "heads"))
    # GPT-2's residual-projection scaling keeps the residual stream's variance depth-independent.
    self.proj = _dense(cfg, cfg.d_model, cfg.d_model, rngs, std=0.02 / (2 * cfg.num_layers) ** 0.5,
                       axes=("heads", "embed"))

  def __call__(self, x: Array) -> Array:
    b, t, d = x.shape
    h = self.num_heads
    q, k, v = jnp.split(tokens(self.qkv, x), 3, axis=-1)
    q, k, v = (a.reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for a in (q, k, v))
    scores = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.float32(d // h))
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    # Softmax in float32 whatever the compute dtype.
    out = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype) @ v
    return tokens(self.proj, out.transpose(0, 2, 1, 3).reshape(b, t, d))


class MLP(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    hidden = cfg.mlp_ratio * cfg.d_model
    self.fc = _dense(cfg, cfg.d_model, hidden, rngs, axes=("embed", "mlp"))
    self.proj = _dense(cfg, hidden, cfg.d_model, rngs, std=0.02 / (2 * cfg.num_layers) ** 0.5,
                       axes=("mlp", "embed"))

  def __call__(self, x: Array) -> Array:
    return tokens(self.proj, jax.nn.gelu(tokens(self.fc, x)))


class Block(nnx.Module):
  """Pre-LN transformer block."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(cfg.d_model, epsilon=1e-5, rngs=rngs, **cfg.precision)
    self.attn = Attention(cfg, rngs=rngs)
    self.ln2 = nnx.LayerNorm(cfg.d_model, epsilon=1e-5, rngs=rngs, **cfg.precision)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x: Array) -> Array:
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class Embedding(nnx.Module):
  """Token plus learned position embeddings."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model,
                         embedding_init=nnx.initializers.normal(0.02), rngs=rngs, **cfg.precision)
    self.wpe = nnx.Embed(cfg.seq_len, cfg.d_model,
                         embedding_init=nnx.initializers.normal(0.01), rngs=rngs, **cfg.precision)

  def __call__(self, ids: Array) -> Array:
    return self.wte(ids) + self.wpe(jnp.arange(ids.shape[-1]))[None]


class Head(nnx.Module):
  """Final LayerNorm and the LM head (or the tied token embedding)."""

  def __init__(self, cfg: GPTConfig, wte: nnx.Embed, *, rngs: nnx.Rngs):
    self.ln_f = nnx.LayerNorm(cfg.d_model, epsilon=1e-5, rngs=rngs, **cfg.precision)
    self.tied = wte if cfg.tied_head else None
    self.proj = None if cfg.tied_head else _dense(cfg, cfg.d_model, cfg.vocab_size, rngs,
                                                  axes=("embed", "vocab"))

  def __call__(self, h: Array) -> Array:
    h = self.ln_f(h)
    return tokens(self.tied.attend if self.tied is not None else self.proj, h)


class GPT(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = Embedding(cfg, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.head = Head(cfg, self.embed.wte, rngs=rngs)

  def __call__(self, tokens: Array) -> Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def from_config(cfg: GPTConfig, seed: Any) -> GPT:
  """The model of `cfg` (`GPTConfig.build`), its parameters drawn from `seed`."""
  return GPT(cfg, rngs=nnx.Rngs(params=seed))
