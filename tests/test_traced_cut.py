"""The traced cut: a model's own loss, traced once and cut at its blocks, trains the network the
model defines, whatever it carries between its blocks; what it cannot carry it refuses by name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from resilient_jax import NotStageableError, check_stageable, run_config, train
from resilient_jax.model.check import token_batch
from resilient_jax.model.cut import LossCut
from resilient_jax.reference import train_reference
from tests.carry_models import CARRIES, VOCAB, Block, DenseFormer, EarlyLate, TiedScanned
from tests.helpers import LOSS_RTOL, PARAM_ATOL, expected_digests, quick_only, tiny_config

STEPS = 12


def one_device(cfg):
  """`cfg` on one device, the whole step's batch at once, no failure."""
  return dataclasses.replace(
    cfg, mesh=dataclasses.replace(cfg.mesh, dp=1, pp=1),
    faults=dataclasses.replace(cfg.faults, schedule=()),
    pipeline=dataclasses.replace(cfg.pipeline, partition=()),
    train=dataclasses.replace(cfg.train, global_batch=cfg.step_batch, accumulate_steps=1))


def assert_trains_as_one_device(result, cfg, model, loss_fn=None, data=None):
  losses, params = train_reference(one_device(cfg), model=model, loss_fn=loss_fn, data=data)
  got = [m["loss"] for m in result.metrics]
  assert np.ptp(got) > 0.05, got  # a loss that moves: a wrong carry would show
  np.testing.assert_allclose(got, losses, rtol=LOSS_RTOL)
  trained = result.interpreter.all_params()
  assert sorted(trained) == sorted(params)
  for name, value in params.items():
    np.testing.assert_allclose(trained[name], value, atol=PARAM_ATOL, err_msg=name)


LAYOUTS = {
  # dp=2 pp=2, worker (1, 1) lost at the start of step 4 and its micro-batches re-routed.
  "2x2-failure": dict(mesh__dp=2, mesh__pp=2, faults__schedule="4:1.1",
                      pipeline__schedule="zb-h1"),
  # pp=4 on an uneven split: cuts after blocks 0, 1 and 2 of 4... and one of them empty.
  "1x4-uneven": dict(mesh__dp=1, mesh__pp=4, pipeline__partition="2,1,0,1",
                     pipeline__schedule="1f1b"),
}
CELLS = [(name, layout) for name in CARRIES for layout in LAYOUTS]
QUICK = [("rezero", "2x2-failure"), ("denseformer", "1x4-uneven"), ("layerdrop", "2x2-failure"),
         ("early_late", "1x4-uneven")]


@pytest.mark.parametrize("name,layout", quick_only(CELLS, QUICK))
def test_a_value_carried_outside_the_blocks_trains_as_one_device(tmp_path, name, layout):
  """ReZero gates, DenseFormer averages, LayerDrop decisions and a value computed before the
  blocks and read after them: each travels across every cut it is live across, so the
  pipeline trains the model's own network, step after step, through a failure and on an
  uneven split."""
  model = CARRIES[name]()
  cfg = tiny_config(train__steps=STEPS, optimizer__learning_rate=1e-2, **LAYOUTS[layout])
  result = train(cfg, tmp_path, model=model, log=lambda _: None)
  cfg = run_config(cfg, model)
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  if "failure" in layout:
    assert any(m["live_workers"] < 4 for m in result.metrics)
  assert_trains_as_one_device(result, cfg, CARRIES[name]())


def test_what_crosses_a_cut_is_what_is_live_across_it():
  """DenseFormer's cut after block 1 carries the embedding and both block outputs (three
  values, packed into one array); a plain residual stack carries only its hidden state; and a
  value read only before and after the blocks travels through every middle stage."""
  batch = token_batch(8, 2)
  dense = LossCut(DenseFormer(), None, batch)
  segs = dense.segments([range(0, 2), range(2, 4)])
  hidden = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)
  assert segs[0].carry_out.specs[:3] == (hidden,) * 3
  assert segs[0].carry_out.spec.shape == (sum(np.prod(s.shape) for s in
                                              segs[0].carry_out.specs),)
  early = LossCut(EarlyLate(), None, batch).segments([range(0, 1), range(1, 3), range(3, 4)])
  # The running hidden state, the embedding (read by the head) and its summary.
  assert len(early[0].carry_out.specs) == len(early[1].carry_out.specs) == 3
  assert early[1].param_names == tuple(sorted(
    f"blocks.{i}.{p}" for i in (1, 2) for p in ("fc.bias", "fc.kernel", "norm.bias",
                                                  "norm.scale", "out.bias", "out.kernel")))


class Masked(nnx.Module):
  """Its forward builds positions and a padding-aware causal mask from the token ids and every
  block reads them: they are recomputed by each stage from the batch, not sent."""

  def __init__(self):
    rngs = nnx.Rngs(0)
    self.embed = nnx.Embed(VOCAB, 16, rngs=rngs)
    self.blocks = nnx.List([Attn(rngs) for _ in range(3)])
    self.head = nnx.Linear(16, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    valid = tokens != 0
    positions = jnp.maximum(jnp.cumsum(valid, axis=-1) - 1, 0)
    mask = jnp.tril(jnp.ones((tokens.shape[-1],) * 2, bool))[None] & valid[:, None, :]
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, positions, mask)
    return self.head(x)


class Attn(nnx.Module):
  def __init__(self, rngs):
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False,
                                       use_bias=False, rngs=rngs)

  def __call__(self, x, positions, mask):
    angle = positions[..., None] / 10_000 ** (jnp.arange(16) / 16)
    return x + self.attn(x + jnp.sin(angle), mask=mask[:, None])


def test_values_made_from_the_batch_alone_are_recomputed_not_sent():
  """Positions and a mask depend on the token ids only: a later stage rebuilds them from the
  ids (read from the batch) and receives only the hidden state."""
  segs = LossCut(Masked(), None, token_batch(8, 2)).segments([range(0, 1), range(1, 3)])
  assert segs[0].carry_out.specs == (jax.ShapeDtypeStruct((2, 8, 16), jnp.float32),)
  assert segs[1].batch_keys == ("targets", "tokens")


def test_a_scanned_layer_stack_is_refused_with_what_to_change():
  with pytest.raises(NotStageableError, match=r"stack of 4 layers with stacked parameters.*"
                                              r"nnx\.List"):
    check_stageable(TiedScanned(), seq_len=8)


class Printing(EarlyLate):
  def __call__(self, tokens):
    jax.debug.print("x {}", tokens[0, 0])
    return super().__call__(tokens)


class PythonIf(EarlyLate):
  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      if x.mean() > 0:  # a traced value read as a Python bool
        x = x + block(x)
    return self.head(x)


class Reused(EarlyLate):
  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = x + block(x)
    return self.head(x + self.blocks[0](x))


class Looped(EarlyLate):
  def __call__(self, tokens):
    x = self.embed(tokens)
    blocks = list(self.blocks)
    x = jax.lax.fori_loop(0, 1, lambda _, h: h + blocks[0](h), x)
    for block in blocks[1:]:
      x = x + block(x)
    return self.head(x)


def test_refusals_say_what_to_change_in_the_users_names():
  def refused(model, match, **kwargs):
    with pytest.raises(NotStageableError, match=match) as err:
      check_stageable(model, seq_len=8, **kwargs)
    assert "\n" not in str(err.value)

  refused(Printing(), r"side effect \(`debug_print`.*remove it")
  refused(PythonIf(), r"reads a traced value as a Python value.*jnp\.where")
  refused(Reused(), r"calls blocks\[0\] more than once")
  refused(Looped(), r"blocks\[\.\.\.\] runs inside a `(scan|while)`.*one after the other")
  refused(EarlyLate(), r"reads batch\['positions'\], which the data does not have",
          loss_fn=lambda m, b: m(b["tokens"] + b["positions"]).mean())
  refused(EarlyLate(), r"loss_fn returned a tuple of 3",
          loss_fn=lambda m, b: (m(b["tokens"]).mean(),) * 3)
  refused(EarlyLate(), r"weights .* depend on the model's parameters",
          loss_fn=lambda m, b: (m(b["tokens"]).mean(-1), m.mix[...].sum() * jnp.ones(8)))
  # A block whose own call fails is named with what it was given.
  bad = EarlyLate()
  bad.blocks[1].out = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
  refused(bad, r"its loss fails on .*TypeError|dot_general")
  assert isinstance(Block(nnx.Rngs(0)), nnx.Module)


def test_the_launcher_names_the_users_model_and_loss_by_module(tmp_path):
  """`--config.model.module=pkg.mod:build` and `--config.train.loss_fn=pkg.mod:fn`, parsed as
  the launcher parses them: `train` builds the model from the seed, traces the named loss, and
  trains as one device would; a name that cannot be imported is one line."""
  from launch.cli import parse_train_args
  from resilient_jax.config import ConfigError
  from resilient_jax.training.api import user_code
  from tests import carry_models

  flags = ["--config=configs/gpt_tiny.py:runlocal", f"--workdir={tmp_path / 'run'}",
           "--config.model.module=tests.carry_models:build_model",
           "--config.train.loss_fn=tests.carry_models:loss_fn", "--config.mesh.dp=1",
           "--config.train.steps=4", "--config.train.seed=3"]
  cfg, _ = parse_train_args(["launch.train", *flags])
  model, loss_fn, data = user_code(cfg)
  assert isinstance(model, carry_models.ReZero) and loss_fn is carry_models.loss_fn
  assert data is None
  result = train(cfg, tmp_path / "run", log=lambda _: None)
  described = run_config(cfg, carry_models.build_model(3), loss_fn=carry_models.loss_fn)
  assert described.model.module == "tests.carry_models:build_model"
  losses, _ = train_reference(one_device(described), model=carry_models.build_model(3),
                              loss_fn=carry_models.loss_fn)
  np.testing.assert_allclose([m["loss"] for m in result.metrics], losses, rtol=LOSS_RTOL)
  for bad, match in (("--config.model.module=tests.no_such_module:f",
                      r"model.module=.*importing tests.no_such_module failed"),
                     ("--config.train.loss_fn=tests.carry_models:nothing",
                      r"train.loss_fn=.*has no nothing")):
    cfg, _ = parse_train_args(["launch.train", *flags, bad])
    with pytest.raises(ConfigError, match=match):
      user_code(cfg)
  with pytest.raises(SystemExit) as end:  # refused as the flags are read: exit 2
    parse_train_args(["launch.train", *flags, "--config.train.loss_fn=not a name"])
  assert end.value.code == 2


def test_a_carry_of_mixed_dtypes_crosses_as_one_array_and_back():
  """Values of several dtypes (float32, bfloat16, int32, bool) cross a cut packed into one
  vector of the widest float and come back bit for bit; the cotangent of the packed vector is
  that of the float values (the integers have none)."""
  from resilient_jax.model.carry import Carry

  values = [jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(2, 3),
            jnp.asarray([0.5, -2.25], jnp.bfloat16),
            jnp.asarray([[7, -1 << 30], [1 << 24 | 1, 0]], jnp.int32),
            jnp.asarray([True, False, True])]
  carry = Carry(tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values))
  packed = jax.jit(carry.pack)(values)
  assert packed.dtype == jnp.float32 and packed.shape == (6 + 2 + 4 + 3,)
  for got, want in zip(jax.jit(carry.unpack)(packed), values, strict=True):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  grads = jax.grad(lambda p: sum(jnp.sum(v.astype(jnp.float32) * (i + 1)) for i, v in
                                 enumerate(carry.unpack(p)[:2])))(packed)
  np.testing.assert_array_equal(grads, np.r_[np.full(6, 1.0), np.full(2, 2.0), np.zeros(7)])
  assert Carry((values[0].shape and jax.ShapeDtypeStruct((2, 3), jnp.float32),)).spec.shape \
    == (2, 3)  # one value crosses as itself
