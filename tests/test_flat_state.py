"""A stage's state as a few flat buffers (`programs/state.py`) and the optimizer stepping on
them where its own traced update says that is exact (`programs/flat_optimizer.py`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from resilient_jax.checkpoint import universal
from resilient_jax.programs.flat_optimizer import FlatOptimizer
from tests.helpers import assert_close, tiny_config

SHAPES = {"a.kernel": (4, 3), "a.bias": (3,), "b.kernel": (3, 5), "b.scale": (5,),
          "emb.embedding": (7, 4)}


def _decay(tree):  # the library's mask: matrices decay, embeddings and vectors do not
  return {k: v.ndim >= 2 and not k.endswith("embedding") for k, v in tree.items()}


def _global_scale(lr):
  """A user's optimizer that reads across parameters: every update scaled by the global norm."""
  def init(params):
    del params
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates)
    return jax.tree.map(lambda g: -lr * g / (norm + 1.0), updates), state

  return optax.GradientTransformation(init, update)


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10, 1e-3)
FLAT = {
  "adamw": optax.adamw(SCHEDULE, weight_decay=0.1, mask=_decay),
  "sgd": optax.chain(optax.add_decayed_weights(0.1, _decay), optax.sgd(SCHEDULE, momentum=0.9)),
  "lion": optax.lion(SCHEDULE, weight_decay=0.1, mask=_decay),
}
PER_TENSOR = {
  "adafactor": optax.adafactor(1e-2),  # factored moments: by the parameter's shape
  "lamb": optax.lamb(1e-3),  # a trust ratio per tensor
  "global": _global_scale(1e-2),  # reads every parameter's gradient
}


@pytest.mark.parametrize("name", sorted(FLAT))
def test_an_elementwise_optimizer_steps_flat_buffers_as_it_steps_the_tree(name):
  """AdamW, SGD with momentum and Lion (each with the decay mask): two classes (what decays,
  what does not), and four steps on one buffer per class equal optax's on the tree."""
  opt = FLAT[name]
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}
  flat = FlatOptimizer.of(opt, abstract)
  assert flat is not None
  assert flat.classes["a.kernel"] == flat.classes["b.kernel"] != flat.classes["a.bias"]
  assert flat.classes["a.bias"] == flat.classes["b.scale"] == flat.classes["emb.embedding"]
  members = [[n for n in sorted(SHAPES) if flat.classes[n] == c] for c in range(2)]
  entries = universal.flatten_state(opt.init(params))
  state = {"shared": {k: entries[k] for k in flat.shared},
           "buffers": [{r: jnp.concatenate([entries[r + n].ravel() for n in ms])
                        for r in flat.roles[c]} for c, ms in enumerate(members)]}
  buffers = [jnp.concatenate([params[n].ravel() for n in ms]) for ms in members]
  step = jax.jit(lambda g, p, s: flat.update(g, p, [0, 1], s))
  tree, tree_state = dict(params), opt.init(params)
  for t in range(4):
    grads = {k: jnp.asarray(rng.normal(size=s), jnp.float32) * (t + 1) for k, s in SHAPES.items()}
    updates, tree_state = opt.update(grads, tree_state, tree)
    tree = optax.apply_updates(tree, updates)
    buffers, state = step([jnp.concatenate([grads[n].ravel() for n in ms]) for ms in members],
                          buffers, state)
  for c, ms in enumerate(members):
    assert_close(buffers[c], jnp.concatenate([tree[n].ravel() for n in ms]))


@pytest.mark.parametrize("name", sorted(PER_TENSOR))
def test_an_optimizer_that_is_not_elementwise_runs_per_tensor(name):
  """Adafactor (shapes), LAMB (per-tensor norms), a user's optimizer reading every gradient:
  their traced updates are not the same elementwise function on each element, so they stay
  per tensor (None)."""
  abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  big = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32), **abstract}  # Adafactor factors
  assert FlatOptimizer.of(PER_TENSOR[name], big if name == "adafactor" else abstract) is None


def test_a_stage_holds_a_buffer_per_block_with_a_region_per_optimizer_class():
  """The tiny GPT's whole model on one device at 4 and at 16 layers: its state is a buffer a
  block and one for the rest, whatever the arrays in a block, each buffer a region per
  optimizer class (what AdamW decays, what it does not); the optimizer runs flat; the
  optimizer state reads back by universal key as optax's own initial state."""
  from resilient_jax.model.check import token_batch
  from resilient_jax.programs.shared import build_stage_programs
  from resilient_jax.recipe import make_model, make_optimizer

  for layers in (4, 16):
    cfg = tiny_config(mesh__dp=1, mesh__pp=1, model__num_layers=layers)
    (prog,) = build_stage_programs(make_model(cfg), cfg.partition,
                                   token_batch(cfg.model.seq_len, cfg.microbatch_size),
                                   make_optimizer(cfg), cfg.step_batch)
    assert prog.flat_opt is not None
    assert len(prog.layout.groups) == layers + 1
    blocks: dict[str, int] = {}
    for b in range(len(prog.layout.groups)):
      (block,) = {n.split(".")[1] if n.startswith("blocks.") else "-" for n in
                  prog.layout.buffer_names(b)}
      blocks[block] = blocks.get(block, 0) + 1
      if block != "-":  # vectors first (not decayed), then the matrices
        (c0, lo0, hi0), (c1, lo1, hi1) = prog.layout.regions[b]
        assert c0 != c1 and lo0 == 0 and hi0 == lo1 and hi1 == prog.layout.sizes[b]
    assert blocks == {**{str(i): 1 for i in range(layers)}, "-": 1}
  device = jax.devices()[0]
  params = prog.initial_params(device)
  opt = prog.init_opt_state(params, device)
  entries = prog.opt_entries(opt)
  want = universal.flatten_state(make_optimizer(cfg).init(
    {n: params[n] for n in prog.param_names}))
  assert sorted(entries) == sorted(want)
  for key in ("0/mu/blocks.3.mlp.fc.kernel", "0/count"):
    np.testing.assert_array_equal(np.asarray(entries[key]), np.asarray(want[key]))


def test_a_slot_that_owns_part_of_a_buffer_counts_those_names_apart():
  """Ownership of the global norm is per buffer: a slot owning every array of a buffer weighs it
  1, none 0; names of a buffer it owns in part (a tied parameter another stage counts) are
  summed apart, and the two add up to the sum over the names it owns."""
  from resilient_jax.model.check import token_batch
  from resilient_jax.programs.shared import build_stage_programs
  from resilient_jax.recipe import make_model, make_optimizer

  cfg = tiny_config(mesh__dp=1, mesh__pp=1)
  (prog,) = build_stage_programs(make_model(cfg), cfg.partition,
                                 token_batch(cfg.model.seq_len, cfg.microbatch_size),
                                 make_optimizer(cfg), cfg.step_batch)
  device = jax.devices()[0]
  params = prog.initial_params(device)
  grads = jax.device_put(params.replace({}), device)  # the parameters as stand-in gradients
  owned = [n for n in prog.param_names if n != "blocks.1.ln1.scale"]
  apart = prog.owned_apart(owned)
  assert "blocks.1.ln1.bias" in apart and "blocks.1.mlp.fc.kernel" in apart
  assert "blocks.1.ln1.scale" not in apart and all(n.startswith("blocks.1.") for n in apart)
  _, _, share = prog.optimizer_step(params, prog.init_opt_state(params, device), grads,
                                    prog.norm_weights(owned, device))
  total = float(share) + float(prog.sumsq_of(grads, apart))
  want = sum(float(np.sum(np.square(np.asarray(params[n], np.float64)))) for n in owned)
  np.testing.assert_allclose(total, want, rtol=1e-5)


def test_a_per_tensor_optimizer_trains_on_the_buffers_as_one_device_does(tmp_path):
  """Adafactor (per tensor: its moments are factored) steps on the buffers' views inside OPT
  and trains what one device trains, on two stages with a failure that Bamboo's replica takes
  over (its state placed whole, the optimizer's own tree with it)."""
  from resilient_jax.schedule.core import B, Op
  from resilient_jax.training.faults import FaultEvent
  from resilient_jax.training.loop import Trainer
  from tests.helpers import assert_matches_reference

  cfg = tiny_config(mesh__dp=2, mesh__pp=2, optimizer__name="adafactor",
                    resilience__policy="bamboo")
  result = Trainer(cfg, tmp_path, log=lambda _: None,
                   faults=[FaultEvent(2, (1, 0), after_op=Op(B, 3))]).run()
  assert result.interpreter.program(result.interpreter.local_slots[0]).flat_opt is None
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
