"""A Llama-style decoder from stock Flax NNX layers, in the library's model protocol.

RMSNorm, rotary position embeddings, a SwiGLU MLP, grouped-query attention and no biases. The
config keys GPT shares (`vocab_size`, `seq_len`, `num_layers`, `num_heads`, `d_model`,
`mlp_ratio`, `tied_head`) mean the same here, so `--config.model.name=llama` works on a GPT
config too.

Parameters name their logical axes (`models.gpt.logical`): Q, K and V split by heads and the
SwiGLU's gate and up by hidden units on a sub-mesh (`mesh.tp > 1`), the output projections by
rows (Megatron-LM's split; K/V stay whole where `tp` does not divide their heads).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .configs import LlamaConfig  # its config section, in a module free of JAX
from .gpt import logical, tokens

Array = jax.Array


def _linear(cfg: LlamaConfig, din: int, dout: int, rngs: nnx.Rngs, std: float = 0.02,
            axes: tuple[str | None, str | None] = ("embed", "embed")) -> nnx.Linear:
  return nnx.Linear(din, dout, use_bias=False,
                    kernel_init=logical(nnx.initializers.normal(std), *axes), rngs=rngs,
                    **cfg.precision)


def rotary(x: Array, theta: float) -> Array:
  """Rotary position embedding of `x` `[batch, seq, heads, head_dim]` (rotate-half form)."""
  t, half = x.shape[1], x.shape[-1] // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None]
  cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
  x1, x2 = x[..., :half], x[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Attention(nnx.Module):
  """Causal grouped-query attention with rotary embeddings."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, hd = cfg.d_model, cfg.head_dim
    self.q = _linear(cfg, d, cfg.num_heads * hd, rngs, axes=("embed", "heads"))
    self.k = _linear(cfg, d, cfg.num_kv_heads * hd, rngs, axes=("embed", "kv_heads"))
    self.v = _linear(cfg, d, cfg.num_kv_heads * hd, rngs, axes=("embed", "kv_heads"))
    self.o = _linear(cfg, cfg.num_heads * hd, d, rngs, std=0.02 / (2 * cfg.num_layers) ** 0.5,
                     axes=("heads", "embed"))

  def __call__(self, x: Array) -> Array:
    cfg = self.cfg
    b, t, _ = x.shape
    h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = rotary(tokens(self.q, x).reshape(b, t, h, hd), cfg.rope_theta)
    k = rotary(tokens(self.k, x).reshape(b, t, kvh, hd), cfg.rope_theta)
    v = tokens(self.v, x).reshape(b, t, kvh, hd)
    k, v = (jnp.repeat(a, h // kvh, axis=2) for a in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(hd))
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return tokens(self.o, out.reshape(b, t, h * hd))


class SwiGLU(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.gate = _linear(cfg, cfg.d_model, cfg.hidden, rngs, axes=("embed", "mlp"))
    self.up = _linear(cfg, cfg.d_model, cfg.hidden, rngs, axes=("embed", "mlp"))
    self.down = _linear(cfg, cfg.hidden, cfg.d_model, rngs, std=0.02 / (2 * cfg.num_layers) ** 0.5,
                        axes=("mlp", "embed"))

  def __call__(self, x: Array) -> Array:
    return tokens(self.down, jax.nn.silu(tokens(self.gate, x)) * tokens(self.up, x))


class Block(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs, **cfg.precision)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs, **cfg.precision)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x: Array) -> Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class Head(nnx.Module):
  def __init__(self, cfg: LlamaConfig, tok: nnx.Embed, *, rngs: nnx.Rngs):
    self.norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs, **cfg.precision)
    self.tied = tok if cfg.tied_head else None
    self.out = None if cfg.tied_head else _linear(cfg, cfg.d_model, cfg.vocab_size, rngs,
                                                  axes=("embed", "vocab"))

  def __call__(self, h: Array) -> Array:
    h = self.norm(h)
    return tokens(self.tied.attend if self.tied is not None else self.out, h)


class Llama(nnx.Module):
  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model,
                           embedding_init=nnx.initializers.normal(0.02), rngs=rngs,
                           **cfg.precision)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.head = Head(cfg, self.embed, rngs=rngs)

  def __call__(self, tokens: Array) -> Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def from_config(cfg: LlamaConfig, seed: Any) -> Llama:
  """The model of `cfg` (`LlamaConfig.build`), its parameters drawn from `seed`."""
  return Llama(cfg, rngs=nnx.Rngs(params=seed))
