"""Language models written the way people publish them for Flax NNX, with no knowledge of the
pipeline, and the training code their authors pair them with: the library traces the user's
`loss_fn(model, batch)` and cuts it at the blocks (issues #33, #48).

- `GemmaStyle`, after the Gemma transformer of Flax's examples: `__call__(last_tokens,
  positions, cache, attention_mask)` returning `(logits, cache)`, the positions and the mask
  made by the training code (`gemma_loss_fn`) from the batch, blocks taking `(x, positions,
  cache, mask)` and returning `(cache, x)`, RoPE, QK-norm, alternating local (sliding-window)
  and global attention, an embedding scaled by sqrt(d) and tied to the output (`attend`), a
  final norm and a logit soft-cap, **one `nnx.Rngs` shared by every block** for dropout; the
  loss is the cross-entropy of every target but padding.
- `Qwen3Style`, after a Qwen3 of a public collection of JAX models: `__call__(x, *,
  segment_ids, cache)` (keyword-only), packed sequences whose attention stays within a
  segment, grouped-query attention, and sharding constraints on its activations under the mesh
  it is built for (`jax.lax.with_sharding_constraint(x, P("data", ...))`).
- `TutorialGPT`, after the "train a miniGPT" tutorial: learned positions added in `__call__`,
  blocks in a list named `transformer_blocks`, dropout per layer, a final norm in `__call__`,
  and layers whose weights say how they shard over the tutorial's `("batch", "model")` mesh
  (the tutorial builds the model under `jax.set_mesh`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

VOCAB, D, HEADS = 256, 32, 2
PAD = 0


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
  """Rotary position embedding of `x` [batch, seq, heads, dim] at `positions` [batch, seq]."""
  half = x.shape[-1] // 2
  freq = 1.0 / (10_000 ** (jnp.arange(half) / half))
  angle = positions[..., None, None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  a, b = x[..., :half], x[..., half:]
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class GemmaBlock(nnx.Module):
  def __init__(self, window: int | None, dropout_rngs: nnx.Rngs, *, rngs: nnx.Rngs):
    hd = D // HEADS
    self.window = window
    self.pre_attention_norm = nnx.RMSNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
    self.q_norm = nnx.RMSNorm(hd, rngs=rngs)
    self.k_norm = nnx.RMSNorm(hd, rngs=rngs)
    self.attn_out = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.pre_ffw_norm = nnx.RMSNorm(D, rngs=rngs)
    self.gate = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.dropout = nnx.Dropout(0.1)
    self.rngs = dropout_rngs  # the one stream every block draws from

  def __call__(self, x, positions, cache, attn_mask):
    b, t, _ = x.shape
    q, k, v = jnp.split(self.qkv(self.pre_attention_norm(x)).reshape(b, t, 3 * HEADS, -1), 3,
                        axis=2)
    q, k = rope(self.q_norm(q), positions), rope(self.k_norm(k), positions)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    mask = attn_mask
    if self.window is not None:
      i = jnp.arange(t)
      mask = mask & (jnp.abs(i[:, None] - i[None, :]) < self.window)[None]
    probs = jax.nn.softmax(jnp.where(mask[:, None], logits, -1e30), axis=-1)
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, D)
    x = x + self.dropout(self.attn_out(attn), rngs=self.rngs)
    g, u = jnp.split(self.gate(self.pre_ffw_norm(x)), 2, axis=-1)
    return cache, x + self.down(jax.nn.gelu(g) * u)


class GemmaStyle(nnx.Module):
  def __init__(self, num_layers: int = 4, seed: int = 0, cap: float = 30.0, pad: int = PAD):
    self.pad = pad
    rngs = nnx.Rngs(params=seed)
    self.dropout_rngs = nnx.Rngs(dropout=seed + 1)
    self.embedder = nnx.Embed(VOCAB, D, rngs=rngs)
    self.layers = nnx.List([GemmaBlock(4 if i % 2 == 0 else None, self.dropout_rngs, rngs=rngs)
                            for i in range(num_layers)])
    self.final_norm = nnx.RMSNorm(D, rngs=rngs)
    self.cap = cap

  def __call__(self, last_tokens, positions, cache, attention_mask):
    x = self.embedder(last_tokens) * jnp.sqrt(D).astype(jnp.float32)
    new_cache = None if cache is None else {}
    for i, layer in enumerate(self.layers):
      layer_cache, x = layer(x, positions, None if cache is None else cache[f"layer_{i}"],
                             attention_mask)
      if cache is not None:
        new_cache[f"layer_{i}"] = layer_cache
    logits = self.embedder.attend(self.final_norm(x))
    return jnp.tanh(logits / self.cap) * self.cap, new_cache


def gemma_loss_fn(model, batch, pad=PAD):
  """Gemma's training code: positions and a padding-aware causal mask from the input tokens,
  no cache, and the cross-entropy of every target but padding."""
  tokens, targets = batch["tokens"], batch["targets"]
  valid = tokens != pad
  positions = jnp.maximum(jnp.cumsum(valid, axis=-1) - 1, 0)
  t = tokens.shape[-1]
  mask = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
  logits, _ = model(tokens, positions, None, mask)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  return losses, targets != pad


class QwenBlock(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.input_layernorm = nnx.RMSNorm(D, rngs=rngs)
    self.q_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.k_proj = nnx.Linear(D, D // 2, use_bias=False, rngs=rngs)  # 2 query heads per kv head
    self.v_proj = nnx.Linear(D, D // 2, use_bias=False, rngs=rngs)
    self.q_norm = nnx.RMSNorm(D // 4, rngs=rngs)
    self.k_norm = nnx.RMSNorm(D // 4, rngs=rngs)
    self.o_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.post_attention_layernorm = nnx.RMSNorm(D, rngs=rngs)
    self.up = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
    self.gate = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)

  def __call__(self, x, *, segment_ids, positions, cache):
    b, t, _ = x.shape
    h = self.input_layernorm(x)
    q = self.q_norm(self.q_proj(h).reshape(b, t, 4, -1))
    k = self.k_norm(self.k_proj(h).reshape(b, t, 2, -1))
    v = self.v_proj(h).reshape(b, t, 2, -1)
    q, k = rope(q, positions), rope(k, positions)
    k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = same & jnp.tril(jnp.ones((t, t), bool))[None]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e30), axis=-1)
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, D)
    x = x + self.o_proj(attn)
    x = jax.lax.with_sharding_constraint(x, P("data", None, None))
    h = self.post_attention_layernorm(x)
    return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h)), cache


class Qwen3Style(nnx.Module):
  def __init__(self, num_layers: int = 4, seed: int = 0):
    rngs = nnx.Rngs(params=seed)
    self.embedder = nnx.Embed(VOCAB, D, rngs=rngs)
    self.layers = nnx.List([QwenBlock(rngs=rngs) for _ in range(num_layers)])
    self.final_norm = nnx.RMSNorm(D, rngs=rngs)
    self.lm_head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, x, *, segment_ids, cache):
    positions = segment_positions(segment_ids)
    h = jax.lax.with_sharding_constraint(self.embedder(x), P("data", None, None))
    for layer in self.layers:
      h, cache = layer(h, segment_ids=segment_ids, positions=positions, cache=cache)
    return self.lm_head(self.final_norm(h)), cache


def segment_positions(segment_ids):
  """Each token's position within its segment (packed sequences start again at 0)."""
  t = segment_ids.shape[-1]
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  idx = jnp.arange(t)[None]
  return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def qwen_loss_fn(model, batch):
  """The collection's training step: logits of the packed inputs, the cross-entropy of every
  target whose loss weight is not 0, averaged over the weights."""
  logits, _ = model(batch["inputs"], segment_ids=batch["segment_ids"], cache=None)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           batch["targets"])
  return losses, batch["weights"]


def _init(axes: tuple, sharded: bool) -> nnx.Initializer:
  """The tutorial's kernel init, annotated with how it shards when built under its mesh."""
  init = nnx.initializers.xavier_uniform()
  return nnx.with_partitioning(init, axes) if sharded else init


class TutorialBlock(nnx.Module):
  def __init__(self, sharded: bool, *, rngs: nnx.Rngs):
    self.layer_norm1 = nnx.LayerNorm(D, rngs=rngs)
    self.mha = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False,
                                      use_bias=False, rngs=rngs)
    self.dropout1 = nnx.Dropout(0.1, rngs=rngs)
    self.layer_norm2 = nnx.LayerNorm(D, rngs=rngs)
    self.linear1 = nnx.Linear(D, 2 * D, kernel_init=_init((None, "model"), sharded),
                              rngs=rngs)
    self.linear2 = nnx.Linear(2 * D, D, kernel_init=_init(("model", None), sharded), rngs=rngs)
    self.dropout2 = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(x[..., 0])
    x = x + self.dropout1(self.mha(self.layer_norm1(x), mask=mask))
    return x + self.dropout2(self.linear2(nnx.gelu(self.linear1(self.layer_norm2(x)))))


class TutorialGPT(nnx.Module):
  def __init__(self, num_blocks: int = 5, maxlen: int = 16, seed: int = 0, sharded: bool = False):
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    self.token_emb = nnx.Embed(VOCAB, D, rngs=rngs)
    self.pos_emb = nnx.Embed(maxlen, D, rngs=rngs)
    self.transformer_blocks = nnx.List([TutorialBlock(sharded, rngs=rngs)
                                             for _ in range(num_blocks)])
    self.norm_f = nnx.LayerNorm(D, rngs=rngs)
    self.output_layer = nnx.Linear(D, VOCAB, use_bias=False,
                                   kernel_init=_init((None, "model"), sharded), rngs=rngs)
    self.sharded = sharded

  def __call__(self, inputs):
    positions = jnp.arange(inputs.shape[1])[None]
    x = self.token_emb(inputs) + self.pos_emb(positions)
    for block in self.transformer_blocks:
      x = block(x)
    logits = self.output_layer(self.norm_f(x))
    if self.sharded:  # as the tutorial ends its forward under its explicit mesh
      logits = jax.sharding.reshard(logits, P("batch", None, "model"))
    return logits
