"""The pipelined trainer against a single-device run of the same model and data."""

import dataclasses
import json
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resilient_jax import data as data_lib
from resilient_jax.model.check import token_batch
from resilient_jax.programs.compiled import BuildCounter, OnEachDevice
from resilient_jax.programs.shared import (
  build_stage_programs,
  clear_shared_programs,
  model_signature,
)
from resilient_jax.recipe import make_model, make_optimizer, optimizer_key
from resilient_jax.training.api import train
from resilient_jax.training.loop import Trainer
from resilient_jax.training.run import activation_memory
from tests.helpers import assert_close, assert_matches_reference, quick_only, tiny_config

GRIDS = [(1, 1), (2, 1), (1, 4), (2, 4), (4, 2)]
SCHEDULES = ["gpipe", "1f1b", "zb-h1"]


@pytest.mark.parametrize("dp,pp,schedule", quick_only(
  [(dp, pp, s) for dp, pp in GRIDS for s in SCHEDULES],
  [(1, 1, "gpipe"), (2, 1, "1f1b"), (1, 4, "zb-h1"), (2, 4, "1f1b"), (4, 2, "zb-h1")]))
def test_matches_single_device(tmp_path, dp, pp, schedule):
  cfg = tiny_config(mesh__dp=dp, mesh__pp=pp, pipeline__schedule=schedule)
  result = train(cfg, tmp_path, log=lambda _: None)
  assert [m["step"] for m in result.metrics] == [1, 2, 3]
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)


@pytest.mark.parametrize("dp,pp,schedule", [(2, 2, "zb-h1"), (1, 4, "1f1b"), (1, 1, "gpipe")])
def test_tied_head_matches_single_device(tmp_path, dp, pp, schedule):
  """The head shares the token embedding; with pp > 1 two stages hold it and sum its grads."""
  cfg = tiny_config(mesh__dp=dp, mesh__pp=pp, pipeline__schedule=schedule, model__tied_head=True)
  result = train(cfg, tmp_path, log=lambda _: None)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
  if pp > 1:
    first = np.asarray(result.interpreter.stage_params(0)["embed.wte.embedding"])
    last = np.asarray(result.interpreter.stage_params(pp - 1)["embed.wte.embedding"])
    np.testing.assert_array_equal(first, last)


def test_uneven_partition_matches(tmp_path):
  cfg = tiny_config(mesh__dp=1, mesh__pp=2, pipeline__partition="3,1")
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  assert [list(p.info.layers) for p in trainer.programs] == [[0, 1, 2], [3]]
  result = trainer.run()
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)


def test_rematerialised_blocks_match_keep_less_and_add_no_third_forward(tmp_path):
  """`model.remat=full` at pp=2 under zb-h1 (B and W apart): the losses and parameters of one
  device without remat; F keeps fewer bytes per micro-batch; the backward recomputes each
  block's forward once, in B (W runs the matmuls it runs without remat); the fused backward
  equals B then W."""
  cfg = tiny_config(mesh__dp=1, mesh__pp=2, pipeline__schedule="zb-h1", model__remat="full",
                    resilience__activation_budget_mb=0.5)
  lines = []
  trainer = Trainer(cfg, tmp_path, log=lines.append)
  result = trainer.run()
  plain = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="none"))
  assert_matches_reference(result.metrics, result.interpreter.all_params(), plain)
  # The same stages without remat: traced only (in the suite, shared with a run of this shape).
  none = build_stage_programs(
    make_model(plain), cfg.partition, token_batch(cfg.model.seq_len, 4), make_optimizer(plain),
    cfg.step_batch, optimizer_key=optimizer_key(plain))

  def dots(prog, side):
    return sum(prog.split.jaxpr.eqns[i].primitive.name == "dot_general"
               for i in getattr(prog.split, side))

  recomputed = []
  for full, base in zip(trainer.programs, none, strict=True):
    assert full.activation_bytes < base.activation_bytes / 4, (full.activation_bytes,
                                                              base.activation_bytes)
    if not full.info.first:  # the first stage has no B: its W is its whole backward
      assert dots(full, "_w_eqns") == dots(base, "_w_eqns")
    recomputed.append(sum(dots(full, s) - dots(base, s) for s in ("_b_eqns", "_w_eqns")))
  # Each stage (two blocks each) recomputes its blocks' forward matmuls once, the head none.
  assert recomputed[0] == recomputed[1] > 0, recomputed
  # The planner's in-flight cap is the activation budget over the largest stage's bytes: the
  # same budget lets more micro-batches fly with remat. Logged at start.
  full_bytes = [p.activation_bytes for p in trainer.programs]
  assert trainer.coordinator.grid.memory_cap == 2**19 // max(full_bytes) > 1
  plain_cap = activation_memory(plain, types.SimpleNamespace(configured=none), lines.append)
  assert plain_cap.resilience.memory_cap == 1  # below one micro-batch: at least 1
  assert "already exceeds it (model.remat=full keeps less)" in lines[-1]
  assert lines[0] == "activations per micro-batch, by stage: " + ", ".join(
    f"{b / 2**20:.2f}" for b in full_bytes) + " MiB (model.remat=full)"
  # The fused backward of the last stage against its B then W, on one micro-batch.
  last = trainer.programs[1]
  params = result.interpreter.stage_params(1)
  device = next(iter(params.values())).devices().pop()
  x = jax.device_put(jnp.ones((4, cfg.model.seq_len, cfg.model.d_model)), device)
  t = jax.device_put(jnp.ones((4, cfg.model.seq_len), jnp.int32), device)
  _, res, saved = last.forward(params, x, {"targets": t})
  g = jax.device_put(jnp.float32(1.0), device)
  dx, handover = last.backward_input(res, g)
  split = last.backward_weight(params, saved, handover, last.zero_grads(params, device))
  fused_dx, fused = last.backward_fused(res, saved, params, g, last.zero_grads(params, device))
  assert_close(fused_dx, dx)
  for name, value in split.items():
    assert_close(fused[name], value, err_msg=name)


@pytest.mark.parametrize("partition,schedule", quick_only(
  [("2,0,2", "1f1b"), ("0,2,2", "zb-h1"), ("2,2,0", "gpipe")], [("2,0,2", "1f1b")]))
def test_a_stage_of_no_layers_matches(tmp_path, partition, schedule):
  """`pipeline.partition` may give a stage no layers (the first keeps the embedding, the last
  the head): it passes activations on, reduces nothing, and the run is one device's."""
  cfg = tiny_config(mesh__dp=1, mesh__pp=3, pipeline__partition=partition,
                    pipeline__schedule=schedule)
  result = train(cfg, tmp_path, log=lambda _: None)
  assert [m["step"] for m in result.metrics] == [1, 2, 3]
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)


def test_data_parallel_replicas_stay_identical(tmp_path):
  cfg = tiny_config(mesh__dp=4, mesh__pp=2, pipeline__schedule="zb-h1")
  clear_shared_programs()  # programs of its own, to count where they were loaded
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  result = trainer.run()
  # Each stage program was compiled once (or read from disk) and loaded on the other three
  # replicas' devices.
  for prog in trainer.programs:
    ran = [p for p in prog.compiled_programs() if p.devices]
    assert ran and all(p.devices == 4 * p.built for p in ran), \
      [(p.__name__, p.built, p.devices) for p in ran]
  ex = result.interpreter
  for stage in range(2):
    replicas = [ex.params[(d, stage)] for d in range(4)]
    for name in replicas[0]:
      for other in replicas[1:]:
        np.testing.assert_array_equal(np.asarray(replicas[0][name]), np.asarray(other[name]))


def test_a_spread_reduction_trains_the_same_network(tmp_path, monkeypatch):
  """Each replica summing its own piece of a stage's gradients (the reduction of GPUs and
  TPUs, forced here on CPU devices) trains what one device trains, the replicas bitwise alike,
  and no device sends or receives more than 2 (dp - 1) / dp of its stage's gradients a step
  (`device_bytes_*` in the metrics; summed on one device it would be dp - 1 of them)."""
  from resilient_jax.runtime.transport import Transport
  from resilient_jax.schedule import ring

  monkeypatch.setattr(Transport, "spread", True)
  cfg = tiny_config(mesh__dp=4, mesh__pp=2, pipeline__schedule="zb-h1")
  result = train(cfg, tmp_path, log=lambda _: None)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
  ex = result.interpreter
  floats = []
  for stage in range(2):
    replicas = [ex.params[(d, stage)] for d in range(4)]
    floats.append(sum(v.size for v in replicas[0].values()))
    for name in replicas[0]:
      for other in replicas[1:]:
        np.testing.assert_array_equal(np.asarray(replicas[0][name]), np.asarray(other[name]))
  most = 2 * 3 * -(-max(floats) // 4) * 4  # 3 of the 4 pieces out and in, each zero-padded
  assert most == ring.two_level(max(floats), (4,)).device_bytes  # as the simulator prices it
  for row in result.metrics:
    assert (row["device_bytes_out"], row["device_bytes_in"]) == (most, most), row


def test_workdir_outputs(tmp_path):
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, pipeline__schedule="zb-h1")
  clear_shared_programs()  # an earlier trainer's programs would leave nothing to build
  lines = []
  train(cfg, tmp_path, log=lines.append)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r in rows:
    for key in ("loss", "samples", "sample_digest", "live_workers", "step_time_s", "schedule"):
      assert key in r
    assert r["samples"] == cfg.train.global_batch and r["live_workers"] == 4
    assert r["schedule"] == "zb-h1"
  plan = data_lib.BatchPlan(None, cfg.train.global_batch, cfg.train.seed)
  assert rows[1]["sample_digest"] == data_lib.sample_digest(plan.ids_for_step(1))
  assert len({r["sample_digest"] for r in rows}) == 3
  trace = json.loads((tmp_path / "timeline.json").read_text())
  names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
  assert {"F0", "B0", "W0", "AR", "OPT"} <= names
  assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # Measured per-stage op times, in the format the simulator reads.
  from resilient_jax.sim.cost_model import load_profile

  profile = load_profile(tmp_path / "profile.json", pp=2)
  assert all(t > 0 for t in profile.f) and all(t > 0 for t in profile.w)
  assert "d1 s1 |" in (tmp_path / "schedule.txt").read_text()
  assert len(lines) == 3 and all("loss" in line and "samples/s" in line for line in lines)
  # Building the programs is reported apart from the step that built them: step 1 of a new
  # trainer builds (compiles, or reads from the cache folder) and says so, later steps do not,
  # and samples/s counts step time only.
  assert rows[0]["compile_s"] > 0 and "building programs:" in lines[0]
  assert [r["compile_s"] for r in rows[1:]] == [0, 0]
  assert not any("building" in line for line in lines[1:])
  for r in rows:
    assert r["samples_per_s"] == pytest.approx(r["samples"] / r["step_time_s"], rel=1e-3)


def test_trainers_of_one_configuration_share_their_programs(tmp_path):
  """A second trainer of the same stages reuses the first one's programs (nothing traced,
  lowered, read or loaded again) and starts from its own model's parameters (another seed);
  a model that differs in a shape, or in an RNG key its programs read as a constant, does not
  match."""
  first = Trainer(tiny_config(mesh__dp=1, mesh__pp=2), tmp_path / "a", log=lambda _: None)
  first.run()
  programs = [p for prog in first.programs for p in prog.compiled_programs()]
  before = [(p.built, p.devices) for p in programs]
  cfg = tiny_config(mesh__dp=1, mesh__pp=2, train__seed=7)
  second = Trainer(cfg, tmp_path / "b", log=lambda _: None)
  result = second.run()
  assert [(p.built, p.devices) for p in programs] == before
  for a, b in zip(first.programs, second.programs, strict=True):
    assert a.backward_fused is b.backward_fused and a.optimizer_step is b.optimizer_step
    assert not np.array_equal(a._initial["head.proj.kernel" if a.info.last else
                                         "embed.wte.embedding"],
                              b._initial["head.proj.kernel" if b.info.last else
                                         "embed.wte.embedding"])
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)

  from flax import nnx

  class Noisy(nnx.Module):
    def __init__(self, seed: int, width: int = 4):
      self.w = nnx.Param(jnp.zeros((width,)))
      self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=seed))

  assert model_signature(Noisy(0)) == model_signature(nnx.clone(Noisy(0)))
  assert model_signature(Noisy(0)) != model_signature(Noisy(1))
  assert model_signature(Noisy(0)) != model_signature(Noisy(0, width=5))


def test_a_model_is_initialised_by_one_program_per_config_whatever_the_seed():
  """`make_model` traces and loads a model config's initializer once per process: another
  seed only runs it. Its values are the eager build's; a family whose `build` cannot be traced
  is built eagerly."""
  import dataclasses

  from flax import nnx

  from resilient_jax import recipe

  cfg = tiny_config()
  first = recipe.make_model(cfg)
  _, init = recipe._initializer(cfg.model)
  before = (init.built, init.devices)
  assert init.built == 1  # compiled or read once
  other = recipe.make_model(tiny_config(train__seed=5))
  assert (init.built, init.devices) == before
  for model, seed in ((first, 0), (other, 5)):
    eager = dict(nnx.to_flat_state(nnx.state(cfg.model.build(seed))))
    for path, value in nnx.to_flat_state(nnx.state(model)):
      assert_close(value[...], eager[path][...], err_msg=str(path))
  assert not np.array_equal(first.embed.wte.embedding[...], other.embed.wte.embedding[...])

  @dataclasses.dataclass(frozen=True)
  class Concrete(type(cfg.model)):
    def build(self, seed):
      return super().build(int(np.asarray(seed)))  # needs the seed's value

  model = recipe.make_model(dataclasses.replace(cfg, model=Concrete(**vars(cfg.model))))
  assert_close(model.embed.wte.embedding[...], first.embed.wte.embedding[...])


def test_one_compile_serves_every_device():
  def step(w, x, acc):
    return {"w": acc["w"] + jnp.tanh(x @ w).T @ x}

  program = OnEachDevice(step, donate_argnums=(2,))
  for device in jax.devices()[1:3]:  # told ahead: loaded there in the background once compiled
    program.expect(device)
  outs = []
  with BuildCounter().counting() as counts:
    for i, device in enumerate(jax.devices()[:4]):
      if i == 1:
        assert {p for p, _ in program._pending} == {(d,) for d in jax.devices()[1:3]}
      w, x = (jax.device_put(jnp.linspace(-1, 1, 64).reshape(s), device)
              for s in [(8, 8), (8, 8)])
      acc = {"w": jax.device_put(jnp.ones((8, 8)), device)}
      out = program(w, x, acc)["w"]
      assert out.devices() == {device} and acc["w"].is_deleted()  # placed there, donation kept
      outs.append(np.asarray(out))
  assert (counts.compiled + counts.from_disk, counts.loaded) == (1, 3)
  assert not program._pending  # every load taken by its device's first call
  for out in outs[1:]:
    np.testing.assert_array_equal(out, outs[0])
  # A new process (here: a new program object) reads the executable from disk, whatever device.
  again = OnEachDevice(step, donate_argnums=(2,))
  device = jax.devices()[5]
  put = lambda v: jax.device_put(v, device)  # noqa: E731
  w = put(jnp.linspace(-1, 1, 64).reshape(8, 8))
  with BuildCounter().counting() as counts:
    out = again(w, put(jnp.linspace(-1, 1, 64).reshape(8, 8)), {"w": put(jnp.ones((8, 8)))})["w"]
  assert (counts.from_disk, counts.compiled) == (1, 0)
  np.testing.assert_array_equal(np.asarray(out), outs[0])


def test_progress_lines_only_while_work_runs_long():
  from resilient_jax.observe.progress import reporting

  lines = []
  with reporting(lines.append, lambda t: f"{t:.2f}s so far", every_s=60):
    pass  # ends before the first line is due: a quick step's output stays as it was
  assert lines == []
  done = threading.Event()
  with reporting(lines.append, lambda t: (done.set(), "still running")[1], every_s=0.01):
    assert done.wait(30)  # the block outlives a few periods: a line comes
  n = len(lines)
  assert n >= 1 and set(lines) == {"still running"}
  done.clear()
  assert not done.wait(0.1) and len(lines) == n  # and none once it has ended


def test_hooks_see_every_nth_committed_step_and_the_last(tmp_path):
  """`Trainer.add_hook(fn, every=N)`: after the standard hooks (the metrics line is written
  when `fn` sees it), on steps N, 2N, ... and the last; it sees the row read-only, and what it
  returns joins the row kept in memory (`TrainResult.metrics`)."""
  cfg = tiny_config(mesh__dp=1, mesh__pp=2, train__steps=5, faults__nonfinite="2:0")
  lines = []
  trainer = Trainer(cfg, tmp_path, log=lines.append)
  seen = []

  def hook(info):
    written = (tmp_path / "metrics.jsonl").read_text().splitlines()
    seen.append((info.step, info.last, dict(info.row), json.loads(written[-1])))
    with pytest.raises(TypeError):
      info.row["loss"] = 0.0
    return {"mine": info.step}

  trainer.add_hook(hook, every=2)
  with pytest.raises(ValueError, match="every N >= 1"):
    trainer.add_hook(hook, every=0)
  result = trainer.run()
  assert [(s, last) for s, last, _, _ in seen] == [(2, False), (4, False), (5, True)]
  same = lambda *rows: len({json.dumps(r, sort_keys=True) for r in rows}) == 1  # noqa: E731 (NaN)
  for _, _, row, written in seen:
    kept = dict(result.metrics[row["step"] - 1])
    assert kept.pop("mine") == row["step"]
    assert same(row, written, kept)
  # The learning rate each step's optimizer step used: step 2 was skipped (non-finite), so
  # step 3 is the schedule's second update, not its third.
  from resilient_jax.recipe import learning_rate

  schedule = learning_rate(cfg)
  assert [m.get("skipped", False) for m in result.metrics] == [False, True, False, False, False]
  assert [m["lr"] for m in result.metrics] == [float(schedule(n)) for n in (0, 1, 1, 2, 3)]
  for m in result.metrics:
    assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * cfg.model.seq_len, rel=1e-3)
  step_lines = [x for x in lines if x.startswith("step ")]
  assert f"lr {result.metrics[3]['lr']:.2e}" in step_lines[3] and "grad_norm" in step_lines[3]


def test_a_resilient_step_takes_a_state_and_returns_the_next(tmp_path):
  """`ResilientStep(state) -> (state, record)`: the state is a value (the arrays of step 0 are
  still step 0's after steps 1 and 2 ran), and the record says what committed."""
  cfg = tiny_config(mesh__dp=1, mesh__pp=2, train__steps=2)
  trainer = Trainer(cfg, tmp_path, log=lambda _: None)
  before = trainer.step.state(0, 0)
  kept = {slot: {k: np.asarray(v) for k, v in p.items()} for slot, p in before.params.items()}
  after, record = trainer.step(trainer.step(before)[0])  # step 1's learning rate is 0 (warmup)
  assert (after.step, after.updates, record.step, record.committed) == (2, 2, 2, True)
  assert after.plan is trainer.coordinator.plan and set(after.params) == set(before.params)
  for slot, params in before.params.items():
    assert all(np.array_equal(np.asarray(v), kept[slot][k]) for k, v in params.items())
    assert any(not np.array_equal(np.asarray(after.params[slot][k]), kept[slot][k])
               for k in params)
  with pytest.raises(TypeError):
    after.params[(0, 0)] = {}
