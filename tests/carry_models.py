"""Models whose own loop carries values across blocks outside the blocks' results, written the
way papers publish them, each with non-degenerate initial values (gates not zero, weights not
the identity): cutting the Python at the blocks would train a different network; cutting the
traced program trains this one (issue #48).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, D = 64, 16


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.fc = nnx.Linear(D, 2 * D, rngs=rngs)
    self.out = nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.gelu(self.fc(self.norm(x))))


class _Base(nnx.Module):
  def __init__(self, num_blocks: int = 4, seed: int = 0):
    rngs = nnx.Rngs(params=seed)
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([Block(rngs) for _ in range(num_blocks)])
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)


class ReZero(_Base):
  """ReZero-style gates in the model's loop, `x = x + g[i] * block(x)` (here initialised to
  0.5, not 0, so that a wrong carry shows from the first step)."""

  def __init__(self, num_blocks: int = 4, seed: int = 0):
    super().__init__(num_blocks, seed)
    self.gates = nnx.Param(jnp.full((num_blocks,), 0.5))

  def __call__(self, tokens):
    x = self.embed(tokens)
    for i, block in enumerate(self.blocks):
      x = x + self.gates[i] * block(x)
    return self.head(x)


class DenseFormer(_Base):
  """DenseFormer-style depth-weighted averaging: after block i, the input to the next is a
  learned weighted average of the embedding and every block output so far (weights start
  uneven, not at the identity)."""

  def __init__(self, num_blocks: int = 4, seed: int = 0):
    super().__init__(num_blocks, seed)
    self.alphas = nnx.List([nnx.Param(jnp.linspace(0.2, 1.0, i + 2)) for i in range(num_blocks)])

  def __call__(self, tokens):
    outs = [self.embed(tokens)]
    x = outs[0]
    for i, block in enumerate(self.blocks):
      outs.append(x + block(x))
      x = sum(a * o for a, o in zip(self.alphas[i][...], outs, strict=True))
    return self.head(x)


class LayerDrop(_Base):
  """LayerDrop decided in the model's loop, from a stream of its own: each block is skipped for
  a sample with probability 0.3 while training (`jnp.where`, so the step stays one program)."""

  def __init__(self, num_blocks: int = 4, seed: int = 0):
    super().__init__(num_blocks, seed)
    self.drop_rngs = nnx.Rngs(layerdrop=seed + 7)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      keep = jax.random.bernoulli(self.drop_rngs.layerdrop(), 0.7, (x.shape[0], 1, 1))
      x = jnp.where(keep, x + block(x), x)
    return self.head(x)


class EarlyLate(_Base):
  """A value computed before the blocks and read after them: the embedding, mixed back in
  by a learned gate before the head (and a sequence summary from the first block's input)."""

  def __init__(self, num_blocks: int = 4, seed: int = 0):
    super().__init__(num_blocks, seed)
    self.mix = nnx.Param(jnp.full((D,), 0.3))

  def __call__(self, tokens):
    first = self.embed(tokens)
    summary = first.mean(axis=1, keepdims=True)
    x = first
    for block in self.blocks:
      x = x + block(x)
    return self.head(x + self.mix[...] * first + summary)


class TiedScanned(nnx.Module):
  """Blocks as one module with stacked parameters run by `nnx.scan`: refused by name."""

  def __init__(self, num_blocks: int = 4, seed: int = 0):
    rngs = nnx.Rngs(params=seed)
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)

    @nnx.split_rngs(splits=num_blocks)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)

    self.stack = make(rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return x + block(x)

    x = run(x, self.stack)
    return self.embed.attend(x)


CARRIES = {"rezero": ReZero, "denseformer": DenseFormer, "layerdrop": LayerDrop,
           "early_late": EarlyLate}


def build_model(seed: int = 0) -> ReZero:
  """What `--config.model.module=tests.carry_models:build_model` builds."""
  return ReZero(seed=seed)


def loss_fn(model, batch):
  """A user's loss, named by `--config.train.loss_fn=tests.carry_models:loss_fn`: per-token
  cross-entropy of the model's logits, averaged."""
  import optax

  logits = model(batch["tokens"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
