"""Your own model: stock nnx layers (with dropout) and the Llama family train exactly what one
device would, under every schedule and with failures; `check_stageable` explains what is wrong."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from resilient_jax import NotStageableError, check_stageable, run_config, train
from resilient_jax.recipe import make_data, reference_optimizer, sample_seeds, step_batch
from tests.helpers import (
  LOSS_RTOL,
  PARAM_ATOL,
  assert_matches_reference,
  expected_digests,
  quick_only,
  tiny_config,
)
from tests.published_models import GemmaStyle, TutorialGPT

VOCAB, D = 256, 32


class Block(nnx.Module):
  # No attention biases: a key bias has a zero gradient (softmax ignores it), which Adam turns
  # into updates of float noise that no two summation orders agree on.
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, use_bias=False,
                                         rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.mlp = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    h = self.norm(x)
    x = x + self.drop(self.attn(h, mask=nnx.make_causal_mask(x[..., 0])))
    return x + jax.nn.gelu(self.mlp(x))


class Net(nnx.Module):
  """Stock layers only: no Tapped layers, no knowledge of the pipeline."""

  def __init__(self, num_blocks: int = 4, seed: int = 0):
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([Block(rngs) for _ in range(num_blocks)])
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)


def _composed(m, x):
  h = m.embed(x)
  for b in m.blocks:
    h = b(h)
  return m.head(h)


def reference(model: nnx.Module, cfg, steps: int, call=_composed):
  """One device, whole batch: `jax.value_and_grad` + optax on the model as NNX sees it (its
  `call(module, tokens)`: `embed -> blocks -> head` by default). Dropout follows the
  documented rule: sample i of step t draws from every stream's key folded with (t, i), its
  count reset (streams each block owns: those of `nnx.Dropout(rngs=...)`)."""
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  # The optimizer (weight decay on matrices) takes a flat {name: array} dict.
  order = [".".join(map(str, k)) for k, _ in nnx.to_flat_state(state)]
  leaves, treedef = jax.tree.flatten(state)
  params = dict(zip(order, leaves, strict=True))
  optimizer = reference_optimizer(cfg)
  opt_state = optimizer.init(params)
  source, plan = make_data(cfg)

  def forward(p, x, seed):
    keyed = jax.tree.map(
      lambda v: jax.random.fold_in(jax.random.fold_in(v, seed[0]), seed[1])
      if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else jnp.zeros_like(v), rest)
    m = nnx.merge(graphdef, jax.tree.unflatten(treedef, [p[n] for n in order]), keyed)
    return call(m, x[None])[0]

  def loss_fn(p, x, y, seeds):
    logits = jax.vmap(forward, in_axes=(None, 0, 0))(p, x, seeds)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def step(p, o, x, y, seeds):
    loss, g = jax.value_and_grad(loss_fn)(p, x, y, seeds)
    u, o = optimizer.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  losses = []
  for t in range(1, steps + 1):
    ids, x, y = step_batch(cfg, source, plan, t)
    s = sample_seeds(t, ids).reshape(-1, 2)
    params, opt_state, loss = step(params, opt_state, x.reshape(-1, x.shape[-1]),
                                   y.reshape(-1, y.shape[-1]), s)
    losses.append(float(loss))
  return losses, {k: np.asarray(v) for k, v in params.items()}


GRIDS = ((2, 2), (2, 4))
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
POLICIES = ("recycle", "naive", "oobleck", "bamboo", "restart", "auto")


def matrix(quick: list[tuple], offset: int) -> list:
  """A model's cells: every policy through a failure, each on its own (grid, schedule) pair.

  The 6 policies meet the 6 pairs of 2 grids x 3 schedules one to one, so the model runs every
  policy, and every schedule on both grids, in 6 cells; `offset` rotates the pairing. The full
  product (36 cells, about 2.5 s CPU each after the first few, more cold) is beyond the suite's
  budget. The failed worker moves across stages (first, middle, last) and data-parallel
  replicas from cell to cell. Cells not in `quick` are `slow`.
  """
  pairs = [(dp, pp, schedule) for dp, pp in GRIDS for schedule in SCHEDULES]
  cases = []
  for i, policy in enumerate(POLICIES):
    dp, pp, schedule = pairs[(i + offset) % len(pairs)]
    cases.append((dp, pp, schedule, policy, f"2:{i % dp}.{(i + offset) % pp}"))
  return quick_only(cases, quick)


@functools.cache
def _net() -> Net:
  return Net()


def fresh_net() -> Net:
  """A `Net()` as built, without initialising it again: its layers initialise op by op (a
  second or so of the matrix's cells each), and a clone shares the arrays, not the state."""
  return nnx.clone(_net())


_user_references: dict[tuple, tuple[list[float], dict[str, np.ndarray]]] = {}


def user_reference(cfg) -> tuple[list[float], dict[str, np.ndarray]]:
  """The single-device run of `Net()`, shared by every grid, schedule and policy: they train
  the same global batches (summation order aside), so one reference per model, optimizer and
  training section serves the matrix (the first cell's grid only orders the summation)."""
  key = (cfg.model, cfg.optimizer, cfg.train)
  if key not in _user_references:
    _user_references[key] = reference(fresh_net(), cfg, cfg.train.steps)
  return _user_references[key]


def run_cell(tmp_path, model, dp, pp, schedule, policy, faults, **overrides):
  """One matrix cell: train, then the sample digests of a run that never failed.

  Two steps: the first on the whole grid, the second after the failure at its start, run by
  the policy's new plan (replanned, re-routed, restarted from step 1's checkpoint).
  """
  cfg = tiny_config(mesh__dp=dp, mesh__pp=pp, pipeline__schedule=schedule,
                    resilience__policy=policy, faults__schedule=faults, train__steps=2,
                    checkpoint__every_steps=1 if policy == "restart" else 0, **overrides)
  result = train(cfg, tmp_path, model=model, log=lambda _: None)
  cfg = run_config(cfg, model) if model is not None else cfg
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert sum(m["live_workers"] < dp * pp for m in result.metrics) >= 1  # the failure happened
  return cfg, result


# One cell, Bamboo's (a replica forward runs another stage's slice of the user's forward): the
# Llama family runs every policy (its matrix below), and the published-style models
# (`published_models.py`) run re-routing at 2x2 and an uneven pp=4 split through their own
# forward; a user's model differs from a family's only in how it is described and cut. (Net's
# other five cells cost ~50 s of the suite's CPU.)
@pytest.mark.parametrize("dp,pp,schedule,policy,faults", [(2, 4, "gpipe", "bamboo", "2:1.3")])
def test_user_model_matches_single_device(tmp_path, dp, pp, schedule, policy, faults):
  cfg, result = run_cell(tmp_path, fresh_net(), dp, pp, schedule, policy, faults)
  losses, params = user_reference(cfg)
  np.testing.assert_allclose([m["loss"] for m in result.metrics], losses, rtol=LOSS_RTOL)
  got = result.interpreter.all_params()
  assert sorted(got) == sorted(params)
  for name, value in params.items():
    np.testing.assert_allclose(got[name], value, atol=PARAM_ATOL, err_msg=name)


@pytest.mark.parametrize("dp,pp,schedule,policy,faults", matrix(
  [(2, 2, "zb-h1", "auto", "2:1.0")], offset=3))
def test_llama_matches_single_device(tmp_path, dp, pp, schedule, policy, faults):
  cfg, result = run_cell(tmp_path, None, dp, pp, schedule, policy, faults, model__name="llama")
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)


def test_dropout_draws_per_sample_masks():
  """The same sample draws the same mask alone or in any batch; other samples differ."""
  from resilient_jax.model.check import token_batch
  from resilient_jax.model.cut import LossCut
  from resilient_jax.model.staging import flat_params

  model = fresh_net()
  together_cut = LossCut(model, None, token_batch(16, 4))
  alone_cut = LossCut(model, None, token_batch(16, 1))
  # As a stage program runs it (and eager would compile each of its ops).
  run = jax.jit(lambda p, b, s: (together_cut.whole()(p, [], b, s)[0],
                                 alone_cut.whole()(p, [], {k: v[2:3] for k, v in b.items()},
                                                   s[2:3]),
                                 alone_cut.whole()(p, [], {k: v[2:3] for k, v in b.items()},
                                                   s[1:2])))
  x = jnp.arange(4 * 16).reshape(4, 16) % VOCAB
  seeds = jnp.asarray(sample_seeds(3, np.arange(4)[:, None]).reshape(-1, 2))
  together, (alone, _), (other, _) = run(flat_params(model), {"tokens": x, "targets": x}, seeds)
  np.testing.assert_allclose(together[2:3], alone, rtol=1e-5, atol=1e-5)
  assert not np.allclose(alone, other)


class NoBlocks(nnx.Module):
  def __init__(self):
    self.embed = nnx.Embed(VOCAB, D, rngs=nnx.Rngs(0))
    self.head = nnx.Linear(D, VOCAB, rngs=nnx.Rngs(0))


class OwnNames(nnx.Module):
  """The parts under the names published models give them."""

  def __init__(self):
    rngs = nnx.Rngs(0)
    self.wte = nnx.Embed(VOCAB, D, rngs=rngs)
    self.layers = nnx.List([Block(rngs) for _ in range(2)])
    self.lm_head = nnx.Linear(D, VOCAB, rngs=rngs)


class OwnNamesCalled(OwnNames):
  def __call__(self, tokens):
    x = self.wte(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(x)


class TwoLists(OwnNamesCalled):
  def __init__(self):
    super().__init__()
    self.extra = nnx.List([Block(nnx.Rngs(1)) for _ in range(2)])


def test_check_stageable_names_each_problem():
  with pytest.raises(NotStageableError, match="no list of blocks"):
    check_stageable(NoBlocks())
  # Under the names published models give them, with a forward of its own: nothing to rename.
  with pytest.raises(NotStageableError, match=r"no `__call__\(tokens\)`"):
    check_stageable(OwnNames())
  check_stageable(OwnNamesCalled(), num_stages=2, seq_len=16)
  with pytest.raises(NotStageableError, match='model.layers="extra"'):
    check_stageable(TwoLists())
  check_stageable(TwoLists(), layers="layers")
  with pytest.raises(NotStageableError, match="not a flax.nnx.Module"):
    check_stageable(object())
  reused = Net(num_blocks=2)
  reused.blocks = nnx.List([reused.blocks[0], reused.blocks[0]])
  with pytest.raises(NotStageableError, match=r"blocks\[0\] and blocks\[1\] are the same module"):
    check_stageable(reused)
  with pytest.raises(NotStageableError, match="4 stages but only 2 blocks"):
    check_stageable(Net(num_blocks=2), num_stages=4)
  bad = Net(num_blocks=2)
  bad.blocks[1].mlp = nnx.Linear(D, 2 * D, rngs=nnx.Rngs(0))
  with pytest.raises(NotStageableError, match=r"its loss fails on \{'targets': int32\[1, 16\], "
                                              r"'tokens': int32\[1, 16\]\}: TypeError"):
    check_stageable(bad, seq_len=16)
  check_stageable(Net(), num_stages=4, seq_len=16)


def text_source(seq_len: int):
  """A grain source of the shipped text, as a user's pipeline builds one: `MapDataset` random
  access by index to dicts of `tokens` and `targets`."""
  import grain

  from resilient_jax.data import TextSource

  text = TextSource(seq_len)
  return grain.MapDataset.range(text.num_samples).map(
    lambda i: {k: v[0] for k, v in text.batch(np.asarray([i])).items()})


def test_a_published_gemma_with_its_loss_fn_and_a_grain_source_trains_through_a_failure(
    tmp_path):
  """Flax's Gemma as published: `__call__(last_tokens, positions, cache, attention_mask)`
  returning `(logits, cache)`, one nnx.Rngs that every block's dropout draws from, and its own
  training code's `loss_fn(model, batch)` (positions and a padding-aware mask made from the
  batch, the cross-entropy of every target but padding), on a grain source: no subclass,
  wrapper or rename. On dp=2 pp=2 through a failure re-routed by ReCycle: the one-device run's
  losses (the weighted mean over the whole batch, however micro-batches are re-routed) and
  parameters; later stages rebuild the positions and the mask from the token ids rather than
  receive them, and the tied embedding is held by both stages."""
  from resilient_jax.reference import eval_reference, train_reference
  from tests.published_models import gemma_loss_fn

  space = ord(" ")
  loss_fn = functools.partial(gemma_loss_fn, pad=space)
  source = text_source(16)
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, pipeline__schedule="zb-h1", train__steps=6,
                    faults__schedule="3:1.1", train__eval_every=6, train__eval_batches=2)
  result = train(cfg, tmp_path, model=GemmaStyle(pad=space), loss_fn=loss_fn, data=source,
                 log=lambda _: None)
  cfg = run_config(cfg, GemmaStyle(pad=space), loss_fn=loss_fn, data=source)
  progs = result.interpreter.programs(((0, 2), (2, 4)))
  assert progs[1].batch_keys == ("targets", "tokens")  # the mask and positions: recomputed
  # Only the hidden state crosses (each sample's own, `[1, seq, d]`: dropout runs per sample).
  assert progs[1].segment.carry_in.specs == (jax.ShapeDtypeStruct((2, 1, 16, 32), jnp.float32),)
  assert "embedder.embedding" in progs[0].param_names and "embedder.embedding" in \
    progs[1].param_names
  assert any(m["live_workers"] < 4 for m in result.metrics)
  one = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp=1, pp=1),
                            faults=dataclasses.replace(cfg.faults, schedule=()),
                            train=dataclasses.replace(cfg.train, global_batch=cfg.step_batch,
                                                      accumulate_steps=1))
  losses, params = train_reference(one, model=GemmaStyle(pad=space), loss_fn=loss_fn,
                                   data=source)
  np.testing.assert_allclose([m["loss"] for m in result.metrics], losses, rtol=LOSS_RTOL)
  got = result.interpreter.all_params()
  assert sorted(got) == sorted(params)
  for name, value in params.items():
    np.testing.assert_allclose(got[name], value, atol=PARAM_ATOL, err_msg=name)
  # Held out, over two batches: the weighted mean over every held-out target, as one device.
  expected = eval_reference(one, got, model=GemmaStyle(pad=space), loss_fn=loss_fn, data=source)
  np.testing.assert_allclose(result.metrics[-1]["eval_loss"], expected, rtol=LOSS_RTOL)


def test_a_shared_stream_draws_the_same_masks_on_an_uneven_split():
  """Gemma's one nnx.Rngs, drawn from by every block's dropout: cut 1,2,1, the stages run one
  after the other compute exactly the whole loss, sample by sample (dropout on: other seeds
  give other losses): the stream's count travels across each cut like any carried value."""
  from resilient_jax.model.check import token_batch
  from resilient_jax.model.cut import LossCut
  from resilient_jax.model.staging import flat_params
  from tests.published_models import gemma_loss_fn

  model = GemmaStyle()
  cut = LossCut(model, gemma_loss_fn, token_batch(16, 2))
  segs = cut.segments([range(0, 1), range(1, 3), range(3, 4)])
  tokens = jnp.asarray(np.arange(2 * 16).reshape(2, 16) % 7 + 1, jnp.int32)
  batch = {"tokens": tokens, "targets": tokens}
  seeds = jnp.asarray(sample_seeds(5, np.arange(2)[:, None]).reshape(-1, 2))

  @jax.jit  # one program for all three (a compile each would cost seconds)
  def losses(p):
    whole = cut.whole()(p, [], batch, seeds)[0]
    xs = []
    for seg in segs:
      xs = seg(p, xs, batch, seeds)
    return whole, xs[0], cut.whole()(p, [], batch, seeds + 1)[0]

  whole, staged, reseeded = losses(flat_params(model))
  np.testing.assert_array_equal(staged, whole)
  assert not np.allclose(reseeded, whole)


def test_a_qwen3_with_keyword_only_arguments_and_sharding_constraints_trains_on_packed_data(
    tmp_path):
  """A Qwen3 as a public collection writes it: `__call__(x, *, segment_ids, cache)`, packed
  sequences (attention within a segment, positions restarting per segment), sharding
  constraints naming its mesh's `data` axis, built under that mesh, and its own `loss_fn`
  reading inputs, targets, segment ids and loss weights from a dict of arrays. On pp=4 split
  1,2,0,1 (a stage of no blocks among them), against one device."""
  from jax.sharding import AxisType

  from resilient_jax.reference import train_reference
  from tests.published_models import Qwen3Style, qwen_loss_fn

  rng = np.random.default_rng(0)
  n, t = 64, 16
  tokens = rng.integers(1, VOCAB, (n, t + 1)).astype(np.int32)
  segments = np.cumsum(rng.random((n, t)) < 0.15, axis=1).astype(np.int32)
  data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
          "weights": (rng.random((n, t)) < 0.8).astype(np.float32)}
  cfg = tiny_config(mesh__dp=1, mesh__pp=4, pipeline__partition="1,2,0,1", train__steps=6,
                    optimizer__learning_rate=1e-2)
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                       devices=jax.devices()[:4])
  with jax.set_mesh(mesh):
    model = Qwen3Style()
    result = train(cfg, tmp_path, model=model, loss_fn=qwen_loss_fn, data=data,
                   log=lambda _: None)
    # One device, as the model's authors would run it: under their mesh, the whole batch.
    one = run_config(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, pp=1),
                                         pipeline=dataclasses.replace(cfg.pipeline,
                                                                      partition=())),
                     Qwen3Style(), loss_fn=qwen_loss_fn, data=data)
    one = dataclasses.replace(one, train=dataclasses.replace(one.train,
                                                             global_batch=one.step_batch))
    losses, params = train_reference(one, model=Qwen3Style(), loss_fn=qwen_loss_fn, data=data)
  got = [m["loss"] for m in result.metrics]
  assert np.ptp(got) > 0.05
  np.testing.assert_allclose(got, losses, rtol=LOSS_RTOL)
  trained = result.interpreter.all_params()
  for name, value in params.items():
    np.testing.assert_allclose(trained[name], value, atol=PARAM_ATOL, err_msg=name)


def test_a_tutorial_gpt_built_under_its_mesh_trains_unedited_on_an_uneven_split(tmp_path):
  """The miniGPT tutorial's model: learned positions and a final norm in its own __call__,
  blocks in `transformer_blocks`, dropout in every block, built as the tutorial builds it:
  under `jax.set_mesh` with explicit axes, its kernels sharded over the mesh. 5 blocks on pp=4
  split 2,1,1,1, against an independent one-device loop of its own forward (the same values,
  built without a mesh). The library takes its values over for its own devices: nothing is
  built after the first step, and the caller's mesh is theirs again after."""
  from jax.sharding import AxisType

  mesh = jax.make_mesh((2, 2), ("batch", "model"), axis_types=(AxisType.Explicit,) * 2,
                       devices=jax.devices()[:4])
  cfg = tiny_config(mesh__dp=1, mesh__pp=4, pipeline__partition="2,1,1,1", train__steps=2,
                    model__num_layers=5)  # the described model replaces it: 5 blocks too
  with jax.set_mesh(mesh):
    model = TutorialGPT(sharded=True)
    assert "model" in str(jax.typeof(model.output_layer.kernel[...]))
    result = train(cfg, tmp_path, model=model, log=lambda _: None)
    assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
  assert [m["compile_s"] for m in result.metrics[1:]] == [0.0]
  losses, params = reference(TutorialGPT(), run_config(cfg, TutorialGPT()), 2,
                             call=lambda m, x: m(x))
  np.testing.assert_allclose([m["loss"] for m in result.metrics], losses, rtol=LOSS_RTOL)
  got = result.interpreter.all_params()
  assert {"pos_emb.embedding", "norm_f.scale"} <= set(got) and sorted(got) == sorted(params)
  for name, value in params.items():
    np.testing.assert_allclose(got[name], value, atol=PARAM_ATOL, err_msg=name)


class Unread(Net):
  """A parameter its forward never reads: no stage would train it."""

  def __init__(self):
    super().__init__(num_blocks=2)
    self.spare = nnx.Linear(D, D, rngs=nnx.Rngs(5))


def test_a_parameter_the_loss_never_reads_is_refused_by_name(tmp_path):
  with pytest.raises(NotStageableError) as err:
    train(tiny_config(), tmp_path, model=Unread())
  assert "spare.kernel" in str(err.value) and "spare.bias" in str(err.value)
  assert "\n" not in str(err.value)


def _readme_block(marker: str) -> str:
  import re

  from tests.helpers import ROOT

  for name in ("README.md", "docs/checkpoints.md"):  # the own-model example, the orbax one
    with open(f"{ROOT}/{name}") as f:
      found = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```", f.read(), re.S)
    if found:
      return found.group(1)
  raise AssertionError(f"no <!-- {marker} --> block in README.md or docs/checkpoints.md")


def _run_code(code: str):
  import subprocess
  import sys

  from tests.helpers import ROOT

  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
  """The README's "Bring your own model" example, as written, in a fresh process; its
  trained parameters saved beside the run."""
  run = tmp_path_factory.mktemp("readme") / "run"
  code = _readme_block("own-model-example").replace("/tmp/my_model_run", str(run))
  code += (f"\nimport numpy as np\nnp.savez({str(run / 'trained.npz')!r}, **{{k: np.asarray(v) "
           "for k, v in result.interpreter.all_params().items()})\n")
  return run, _run_code(code)


def test_readme_example_runs(readme_run):
  _, proc = readme_run
  assert "FAILURE: worker (dp=1, stage=1) failed at the start of step 3" in proc.stderr  # absl
  assert np.isfinite(float(proc.stdout.strip().splitlines()[-1]))


def test_readme_orbax_example_loads_the_run_without_resilient_jax(readme_run):
  """The plain-orbax example of docs/checkpoints.md, in a fresh process that never imports
  resilient_jax: orbax's CheckpointManager lists the run's steps and restores the last one into
  a plain NNX model (the example's own class), whose parameters are the trainer's."""
  run, _ = readme_run
  own = _readme_block("own-model-example")
  classes = own[own.index("import grain\n"):own.index("\ndef loss_fn")]
  orbax = _readme_block("orbax-load-example").replace("/tmp/my_model_run", str(run))
  example = classes + "\n" + orbax
  assert "resilient_jax" not in example
  code = example + f"""
import sys
import numpy as np
assert not [m for m in sys.modules if m.split(".")[0] == "resilient_jax"]
flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
np.savez({str(run / 'restored.npz')!r},
         **{{".".join(map(str, k)): np.asarray(v[...]) for k, v in flat}})
"""
  proc = _run_code(code)
  lines = proc.stdout.strip().splitlines()
  assert lines[0] == "[2, 4]"
  assert lines[1].split()[0] == "4"
  trained, restored = np.load(run / "trained.npz"), np.load(run / "restored.npz")
  assert sorted(trained.files) == sorted(restored.files) and "lm_head.kernel" in trained.files
  for name in trained.files:
    np.testing.assert_array_equal(restored[name], trained[name], err_msg=name)


def test_init_from_starts_a_new_run_from_saved_parameters(tmp_path):
  """Fine-tuning: parameters from a universal checkpoint (a workdir) or a plain orbax NNX state;
  the new run's first loss is the loss of those parameters, not of a fresh model."""
  import orbax.checkpoint as ocp

  first = tiny_config(mesh__dp=2, mesh__pp=2, checkpoint__every_steps=3)
  done = train(first, tmp_path / "a", log=lambda _: None)
  trained = done.interpreter.all_params()
  fresh = train(tiny_config(train__seed=5, train__steps=1), tmp_path / "b", log=lambda _: None)
  tuned = train(tiny_config(train__seed=5, train__steps=1,
                            checkpoint__init_from=str(tmp_path / "a")), tmp_path / "c",
                log=lambda _: None)
  assert tuned.metrics[0]["loss"] < fresh.metrics[0]["loss"] - 0.01
  assert tuned.metrics[0]["step"] == 1
  # The same parameters as an orbax checkpoint of the NNX state give the same first step.
  model = tiny_config().model.build(0)
  from resilient_jax.checkpoint.init_from import init_params

  init_params(model, trained, "test")
  saver = ocp.StandardCheckpointer()
  saver.save((tmp_path / "nnx").absolute(), nnx.state(model, nnx.Param))
  saver.wait_until_finished()
  again = train(tiny_config(train__seed=5, train__steps=1,
                            checkpoint__init_from=str(tmp_path / "nnx")), tmp_path / "d",
                log=lambda _: None)
  np.testing.assert_allclose(again.metrics[0]["loss"], tuned.metrics[0]["loss"], rtol=1e-6)
  with pytest.raises(Exception, match="init_from"):
    train(tiny_config(model__name="llama", checkpoint__init_from=str(tmp_path / "a")),
          tmp_path / "e", log=lambda _: None)
