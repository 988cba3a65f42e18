"""Tensor parallelism inside a stage: a worker is a sub-mesh of `mesh.tp` devices."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from resilient_jax import checkpoint as ckpt
from resilient_jax.config import ConfigError
from resilient_jax.model.check import token_batch
from resilient_jax.model.sharding import target, worker_mesh
from resilient_jax.programs.shared import build_stage_programs, clear_shared_programs
from resilient_jax.schedule.core import F, Op
from resilient_jax.spec.placement import process_slots
from resilient_jax.training.faults import FaultEvent
from resilient_jax.training.loop import Trainer
from tests.helpers import (
  assert_close,
  assert_matches_reference,
  expected_digests,
  loaded_checkpoints,
  tiny_config,
)


def _stage_outputs(progs, stage, where, tokens, targets, edit=lambda params: params):
  """F, B, W and OPT of one stage on `where`, from its initial parameters (`edit`ed)."""
  prog = progs[stage]
  params = edit(prog.initial_params(where))
  x = None if prog.info.first else jax.device_put(
    np.random.default_rng(1).normal(size=prog.input_spec.shape).astype(np.float32), where)
  batch = jax.device_put({k: v for k, v in (("tokens", tokens), ("targets", targets))
                          if k in prog.batch_keys}, where)
  out, res, saved = prog.forward(params, x, batch)
  g = jax.device_put(jnp.float32(1.0) if prog.info.last else
                     np.random.default_rng(2).normal(size=prog.output_spec.shape)
                     .astype(np.float32), where)
  dx, taps = prog.backward_input(res, g)
  acc = prog.backward_weight(params, saved, taps, prog.zero_grads(params, where))
  owned = prog.norm_weights(prog.param_names, where)
  stepped, opt, sumsq = prog.optimizer_step(params, prog.init_opt_state(params, where), acc,
                                            owned)
  # Packed on one device: by name (and universal key), to compare.
  grads = {n: acc[n] for n in prog.param_names}
  stepped = {n: stepped[n] for n in prog.param_names}
  return params, out, dx, grads, stepped, dict(prog.opt_entries(opt)), sumsq, opt


@pytest.mark.parametrize("family,stage", [
  ("gpt", 1), pytest.param("gpt", 0, marks=pytest.mark.slow),
  pytest.param("llama", 1, marks=pytest.mark.slow)])
def test_sharded_stage_matches_unsharded(family, stage):
  """F, B (split from the backward automatically), W and OPT of a stage on a 2-device sub-mesh
  equal the same stage's on one device; the blocks' matrices are split Megatron-style and
  stay split through W and OPT."""
  cfg = tiny_config(model__name=family)
  model = cfg.model.build(0)
  layers = [range(0, 2), range(2, 4)]
  devs = jax.devices()
  tokens = np.random.default_rng(0).integers(0, 256, (2, cfg.model.seq_len), dtype=np.int32)
  targets = np.roll(tokens, -1, axis=1)
  # A large epsilon: Adam would blow a gradient that is zero but for rounding (the key bias's,
  # softmax ignores it) up to the learning rate, whose sign is then noise.
  optimizer = optax.adamw(1e-2, eps=1.0)
  one = build_stage_programs(model, layers, token_batch(cfg.model.seq_len, 2), optimizer, 16)
  two = build_stage_programs(model, layers, token_batch(cfg.model.seq_len, 2), optimizer, 16,
                             tp=2)
  block = f"blocks.{2 * stage}"
  up = f"{block}.mlp.fc.kernel" if family == "gpt" else f"{block}.mlp.gate.kernel"
  down = f"{block}.mlp.proj.kernel" if family == "gpt" else f"{block}.mlp.down.kernel"

  def compare(ref, got):
    for a, b in zip(jax.tree.leaves(ref[1:7]), jax.tree.leaves(got[1:7]), strict=True):
      assert_close(b, a)

  ref = _stage_outputs(one, stage, devs[0], tokens, targets)
  got = _stage_outputs(two, stage, target(worker_mesh(devs[2:4])), tokens, targets)
  compare(ref, got)
  # The tolerance still sees a real error: the row-split down projection without its
  # all-reduce (one device's half of the sum) moves outputs and gradients far past it.
  half = ref[0][down].shape[0] // 2
  missing_sum = _stage_outputs(one, stage, devs[0], tokens, targets,
                               lambda p: p.replace({down: p[down].at[half:].set(0.0)}))
  with pytest.raises(AssertionError):
    compare(ref, missing_sum)
  params, _, dx, grads, stepped, _, _, opt = got
  assert (dx is None) == (stage == 0)  # the first stage's B is empty: all of it is W's
  split = {n: v.sharding.spec for n, v in params.items() if v.sharding.spec != P()}
  assert split[up] == P(None, "tp") and split[down] == P("tp")
  assert params[up].addressable_shards[0].data.shape[1] * 2 == params[up].shape[1]
  assert not any(n.startswith(("embed", "head")) for n in split)  # replicated
  for tree in (grads, stepped):  # W and OPT keep the split
    assert {n: v.sharding.spec for n, v in tree.items() if v.sharding.spec != P()} == split
  mu = opt[0].mu
  assert mu[up].sharding.spec == P(None, "tp") and len(mu[up].sharding.device_set) == 2


@pytest.mark.slow
def test_dp2_pp2_tp2_through_a_failure_matches_single_device(tmp_path):
  """A 2x2 grid of 2-device workers on 8 devices: a worker (its whole sub-mesh) fails between
  steps and another in the middle of a step; every step keeps its samples, and losses and
  parameters (global-norm clipped) equal the single-device run's. A tp=2 checkpoint then
  resumes on tp=1, and a tp=1 checkpoint on tp=2."""
  # Clipped to a global norm the gradients exceed: its sum of squares adds up the split ones.
  clip = {"optimizer__clip_global_norm": 0.5}
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, mesh__tp=2, train__steps=4,
                    faults__schedule="2:1.0", checkpoint__every_steps=2, **clip)
  trainer = Trainer(cfg, tmp_path / "run", log=lambda _: None,
                    faults=[FaultEvent(3, (0, 1), after_op=Op(F, 1))])
  meshes = {n: trainer.transport.placement(n) for n in range(4)}
  assert sorted(d.id for m in meshes.values() for d in m.devices.flat) == list(range(8))
  result = trainer.run()
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert [m["live_workers"] for m in result.metrics] == [4, 3, 2, 2]
  assert all(m.get("clipped") for m in result.metrics)
  ex = result.interpreter
  assert_matches_reference(result.metrics, ex.all_params(), cfg)
  lost = {d.id for n in (2, 1) for d in meshes[n].devices.flat}  # workers (1, 0) and (0, 1)
  for slot in ex.local_slots:
    kernel = next(v for n, v in ex.params[slot].items() if n.endswith("mlp.fc.kernel"))
    assert kernel.sharding.spec == P(None, "tp")
    assert len(kernel.sharding.device_set) == 2 and not kernel.sharding.device_set & {
      d for d in jax.devices() if d.id in lost}

  # The checkpoint of step 2 (written on sub-meshes) resumes on one device per worker for
  # step 3, and that one's checkpoint on sub-meshes again for step 4.
  shutil.copytree(tmp_path / "run", tmp_path / "resume")
  shutil.rmtree(ckpt.step_dir(tmp_path / "resume" / "checkpoints", 4))
  lines = []
  for tp, restored in ((1, 2), (2, 3)):
    cfg_tp = tiny_config(mesh__dp=2, mesh__pp=2, mesh__tp=tp, train__steps=4,
                         train__stop_after=3 if tp == 1 else 0, **clip)
    resumed = Trainer(cfg_tp, tmp_path / "resume", log=lines.append).run()
    assert (restored, f"dp=2 pp=2 tp={3 - tp}") in [
      (s, on) for s, on, _ in loaded_checkpoints(resumed)], lines
  assert [m["sample_digest"] for m in resumed.metrics] == expected_digests(cfg)
  assert_matches_reference(resumed.metrics, resumed.interpreter.all_params(), cfg_tp)


@pytest.mark.slow
def test_bamboo_replicas_on_sub_meshes(tmp_path):
  """Bamboo's replica of the successor stage is kept split over the holder's sub-mesh and
  takes over when that stage's worker fails."""
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, mesh__tp=2, train__steps=3, faults__schedule="2:1.1",
                    resilience__policy="bamboo")
  clear_shared_programs()  # programs of its own, to count where they were loaded
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  ex = trainer.interpreter
  params, _ = next(iter(ex.replicas.values()))
  assert params["blocks.2.mlp.fc.kernel"].sharding.spec == P(None, "tp")
  # Each stage program is compiled (or read from disk) for one sub-mesh and loaded on the other
  # pipeline's: F, B and W of every worker.
  ex.warm_up()
  for prog in trainer.programs:
    ran = [p for p in prog.compiled_programs() if p.devices]
    assert len(ran) >= 4 and all(p.devices == 2 * p.built for p in ran), \
      [(p.__name__, p.built, p.devices) for p in ran]
  result = trainer.run()
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)


@pytest.mark.slow
def test_a_model_without_annotations_runs_replicated(tmp_path):
  """Without logical axes a sub-mesh holds the whole stage on each device, and says so."""
  model = tiny_config().model.build(0)
  for _, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param):
      var.set_metadata("out_sharding", None)
  cfg = tiny_config(mesh__dp=1, mesh__pp=1, mesh__tp=2, train__steps=1)
  lines = []
  trainer = Trainer(cfg, tmp_path, log=lines.append, model=model)
  assert any("runs replicated over its 2 devices" in x for x in lines), lines
  assert all(spec == P() for prog in trainer.programs for spec in prog.param_specs.values())
  result = trainer.run()
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)


def test_a_tp_that_divides_only_some_dimensions_says_which_stay_whole(tmp_path):
  """`mesh.tp=3` on the tiny GPT (hidden width 32, MLP 128, QKV 96): only QKV splits, and the
  start says in one line which dimensions stay whole on every device of a worker, and that
  the worker gains nothing from its extra devices for those (the run used to be silent)."""
  lines = []
  cfg = tiny_config(mesh__dp=1, mesh__pp=2, mesh__tp=3, train__steps=1)
  trainer = Trainer(cfg, tmp_path, log=lines.append)
  said = [x for x in lines if x.startswith("mesh.tp=3")]
  assert len(said) == 1, lines
  assert "does not divide heads of size 32 (4 parameters, e.g. blocks.0.attn.proj.kernel), " \
    "mlp of size 128 (12 parameters, e.g. blocks.0.mlp.fc.bias): those parameters stay " \
    "replicated, whole on each of a worker's 3 devices, which gain nothing from them" in said[0]
  specs = {n: s for prog in trainer.programs for n, s in prog.param_specs.items()}
  assert specs["blocks.0.attn.qkv.kernel"] == P(None, "tp")
  assert specs["blocks.0.attn.proj.kernel"] == specs["blocks.0.mlp.fc.kernel"] == P()

  # A tp that divides nothing (5: every split dimension is 32, 96 or 128): all replicated.
  from resilient_jax.model.sharding import logical_axes, partition_specs
  from resilient_jax.model.staging import flat_params, variable_names
  from resilient_jax.training.run import replicated_over_tp

  model = cfg.model.build(0)
  axes = logical_axes(model, variable_names(model))
  shapes = {n: v.shape for n, v in flat_params(model).items()}
  line = replicated_over_tp(5, axes, shapes, partition_specs(axes, shapes, 5))
  assert "heads of size 96 (8 parameters, e.g. blocks.0.attn.qkv.bias)" in line
  assert line.endswith("and nothing else splits: every worker's stage runs replicated over its 5 "
                       "devices: correct, but it gains nothing from its extra devices (neither "
                       "faster nor smaller per device)")
  assert replicated_over_tp(2, axes, shapes, partition_specs(axes, shapes, 2)) is None


def test_too_few_devices_for_tp(tmp_path):
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, mesh__tp=4)
  with pytest.raises(ConfigError, match=r"mesh.tp = 16 devices needed \(4 workers of 4\), found 8"):
    Trainer(cfg, tmp_path, log=lambda _: None)
  with pytest.raises(ConfigError, match="mesh.tp must be a positive integer"):
    tiny_config(mesh__tp=0)
  # A multi-process job: the workers' sub-meshes must fill its processes' devices exactly.
  with pytest.raises(ValueError, match=r"mesh.dp \* mesh.pp \* mesh.tp = 2 \* 2 \* 2 = 8 "
                     r"devices \(4 workers of 2\) must fill the job's 2 processes x 2 devices"):
    process_slots(2, 2, "pipeline", num_processes=2, local_devices=2, devices_per_worker=2)
