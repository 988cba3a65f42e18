"""Universal checkpoints: resume on other layouts, integrity, fallback, retention, async."""

import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from resilient_jax import checkpoint as ckpt
from resilient_jax.checkpoint import store
from resilient_jax.config import ConfigError
from resilient_jax.observe.events import CheckpointLoaded, Restored
from resilient_jax.training.api import train
from resilient_jax.training.loop import Trainer
from tests.helpers import ROOT, assert_matches_reference, loaded_checkpoints, tiny_config
from tests.test_tensorboard import assert_losses_match, texts

# The suite's tiny model (4 blocks) and a step count whose learning-rate schedule is the other
# tests' (`recipe.optimizer_key`): every layout below runs programs the pipeline tests compile
# too, so this file adds runs, not compiles.
STEPS, STOP = 5, 4


def cfg_of(**over):
  return tiny_config(train__steps=STEPS, **over)


def quiet(_):
  pass


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A (2, 4) run stopped after step 4 with checkpoints at 2 and 4, and the uninterrupted run."""
  base = tmp_path_factory.mktemp("ckpt")
  cfg = cfg_of(train__stop_after=STOP, checkpoint__every_steps=2, mesh__dp=2, mesh__pp=4)
  stopped = train(cfg, base / "stopped", log=quiet)
  full = train(cfg_of(mesh__dp=2, mesh__pp=4), base / "full", log=quiet)
  return base, stopped, full


def _resume(saved, tmp_path, dp, pp, **over):
  base, _, _ = saved
  shutil.copytree(base / "stopped", tmp_path / "run")
  lines = []
  cfg = cfg_of(mesh__dp=dp, mesh__pp=pp, **over)
  return cfg, Trainer(cfg, tmp_path / "run", log=lines.append).run(), lines


def test_stop_after_checkpoints_and_stops(saved):
  base, stopped, _ = saved
  assert [m["step"] for m in stopped.metrics] == [1, 2, 3, 4]
  assert ckpt.committed_steps(base / "stopped" / "checkpoints") == [2, 4]


def _watch_placement(monkeypatch):
  """Records what `import_state` was given (the loaded arrays, and copies of their bytes) and
  how many of the parameters it placed share the loaded arrays' memory."""
  from resilient_jax.runtime.interpreter import Interpreter

  seen = {}
  import_state = Interpreter.import_state

  def watched(self, params, opt_entries):
    import_state(self, params, opt_entries)
    seen["loaded"] = {**params, **{f"opt/{k}": v for k, v in opt_entries.items()}}
    seen["bytes"] = {k: v.tobytes() for k, v in seen["loaded"].items()}
    placed = [(n, a) for slot in self.local_slots for n, a in self.params[slot].items()]
    seen["placed"] = len(placed)
    seen["equal"] = sum(np.asarray(a).tobytes() == np.asarray(params[n]).tobytes()
                        for n, a in placed)

  monkeypatch.setattr(Interpreter, "import_state", watched)
  return seen


@pytest.mark.parametrize("dp,pp", [pytest.param(4, 2, marks=pytest.mark.slow), (1, 1), (2, 2),
                                   pytest.param(1, 4, marks=pytest.mark.slow)])
def test_resume_on_another_layout(saved, tmp_path, dp, pp, monkeypatch):
  _, _, full = saved
  placed = _watch_placement(monkeypatch)
  cfg, result, lines = _resume(saved, tmp_path, dp, pp)
  # Placement packs the loaded arrays into each stage's buffers (one copy, `StagePrograms.
  # state_from`): every placed parameter is the loaded one bitwise, and the optimizer steps
  # after it, which donate their state, leave the loaded bytes as they were.
  assert placed["equal"] == placed["placed"] > 0
  assert all(v.tobytes() == placed["bytes"][k] for k, v in placed["loaded"].items())
  [(step, _, onto)] = loaded_checkpoints(result)
  assert step == 4 and onto.startswith(f"dp={dp} pp={pp}")
  assert [m["step"] for m in result.metrics] == list(range(1, STEPS + 1))
  assert [m["sample_digest"] for m in result.metrics] == [m["sample_digest"] for m in full.metrics]
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
  # Optimizer state, leaf by leaf, against the uninterrupted run.
  _, opt_full = full.interpreter.export_state()
  _, opt_resumed = result.interpreter.export_state()
  assert sorted(opt_full) == sorted(opt_resumed)
  for key, value in opt_full.items():
    np.testing.assert_allclose(
      np.asarray(opt_resumed[key]), np.asarray(value), rtol=1e-4, atol=1e-8, err_msg=key
    )


def test_restored_state_is_exactly_the_saved_one(saved, tmp_path):
  base, stopped, _ = saved
  loaded = ckpt.load(ckpt.step_dir(base / "stopped" / "checkpoints", 4))
  params, opt = stopped.interpreter.export_state()
  for name, value in params.items():
    np.testing.assert_array_equal(loaded.params[name], np.asarray(value))
  for key, value in opt.items():
    np.testing.assert_array_equal(loaded.opt_state[key], np.asarray(value))
  assert loaded.meta["layout"]["dp"] == 2 and loaded.meta["data"]["next_step"] == 5


def _write_meta(folder, meta, seal=True):
  """Rewrites a checkpoint's metadata, with its own checksum recomputed (`seal`), or none (as
  versions before the checksum wrote it)."""
  meta = {k: v for k, v in meta.items() if k != store.META_DIGEST}
  if seal:
    meta[store.META_DIGEST] = store.meta_digest(meta)
  ckpt.meta_path(folder).write_text(json.dumps(meta))


def _corrupt_latest(run_dir, how):
  latest = ckpt.step_dir(run_dir / "checkpoints", 4)
  if how == "checksum":
    meta = json.loads(ckpt.meta_path(latest).read_text())
    meta["entries"]["params"]["blocks.1.mlp.fc.kernel"]["crc32"] = "00000000"
    _write_meta(latest, meta)  # resealed: the entry's bytes, not the metadata, fail
  else:  # truncate every data file of the array store
    for f in (latest / "state").rglob("*"):
      if f.is_file() and f.stat().st_size > 64 and "METADATA" not in f.name:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


@pytest.mark.parametrize("how", ["checksum", "truncate"])
def test_corrupt_latest_falls_back_to_previous(saved, tmp_path, how):
  base, _, full = saved
  shutil.copytree(base / "stopped", tmp_path / "run")
  _corrupt_latest(tmp_path / "run", how)
  proc = subprocess.run(
    [sys.executable, "-m", "launch.checkpoint", "verify", str(tmp_path / "run")],
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  assert proc.returncode == 1 and "CORRUPT" in proc.stderr
  if how == "checksum":
    assert "blocks.1.mlp.fc.kernel" in proc.stderr
  lines = []
  cfg = cfg_of(mesh__dp=2, mesh__pp=2)
  result = Trainer(cfg, tmp_path / "run", log=lines.append).run()
  assert any("step 4 is unusable" in x for x in lines)
  assert [s for s, _, _ in loaded_checkpoints(result)] == [2]
  assert [m["sample_digest"] for m in result.metrics] == [m["sample_digest"] for m in full.metrics]
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)


def test_half_written_checkpoint_is_never_latest(saved, tmp_path):
  base, _, _ = saved
  shutil.copytree(base / "stopped", tmp_path / "run")
  root = tmp_path / "run" / "checkpoints"
  shutil.copytree(ckpt.step_dir(root, 4), root / "6.orbax-checkpoint-tmp-1234")  # orbax's
  shutil.copytree(ckpt.step_dir(root, 4), root / ".tmp-step_00000007-abcd")  # older versions'
  (root / "8").mkdir()  # no metadata: never committed
  (root / "step_00000009").mkdir()
  assert ckpt.committed_steps(root) == [2, 4]
  assert ckpt.load_latest(root, log=quiet).step == 4
  assert ckpt.CheckpointWriter(root).remove_unfinished() == [
    ".tmp-step_00000007-abcd", "6.orbax-checkpoint-tmp-1234"]


def _disk_full(*args, **kwargs):
  raise OSError("disk full")


def _write_older(root, step, params, opt):
  """A checkpoint as versions before orbax's CheckpointManager wrote it: `step_00000012/`, a
  flat state tree, `meta.json` beside it."""
  from resilient_jax.checkpoint import reader, store

  folder = root / f"step_{step:08d}"
  folder.mkdir(parents=True)
  tree = {"params": params, "opt_state": opt}
  store._checkpointer().save((folder / "state").absolute(), tree)
  entries = {g: {k: {"shape": list(a.shape), "dtype": str(a.dtype),
                     "crc32": reader.checksum_and_finite(a)[0]} for k, a in t.items()}
             for g, t in tree.items()}
  (folder / "meta.json").write_text(json.dumps(
    {"format": store.FORMAT, "step": step, "layout": {}, "entries": entries, "bytes": 0}))
  return folder


def test_older_step_folders_load_and_retire(tmp_path, monkeypatch):
  """An older workdir's `step_*` folders load (latest, CLI) beside orbax's bare-number ones;
  retention counts both; a step saved again replaces its earlier copy, and a failed re-save
  leaves that copy in place."""
  from launch.checkpoint import main as checkpoint_cli

  params = {"blocks.0.fc.kernel": np.ones((3, 2), np.float32)}
  opt = {"0/count": np.array(1, np.int32)}
  for step in (1, 2):
    _write_older(tmp_path, step, {k: v * step for k, v in params.items()}, opt)
  assert ckpt.committed_steps(tmp_path) == [1, 2]
  assert ckpt.step_dir(tmp_path, 2).name == "step_00000002"
  loaded = ckpt.load_latest(tmp_path, log=quiet)
  assert loaded.step == 2 and loaded.timings["direct"] == loaded.timings["entries"] == 2
  np.testing.assert_array_equal(loaded.params["blocks.0.fc.kernel"], 2 * params[
    "blocks.0.fc.kernel"])
  assert checkpoint_cli(["checkpoint", "verify", str(tmp_path)]) == 0

  writer = ckpt.CheckpointWriter(tmp_path, keep=2)
  writer.save(3, params, opt, {"layout": {}})
  writer.wait()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "step_00000002"]
  assert ckpt.load_latest(tmp_path, log=quiet).step == 3
  writer.save(2, {k: v * 5 for k, v in params.items()}, opt, {"layout": {}})  # saved again
  writer.wait()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3"]
  assert ckpt.load(ckpt.step_dir(tmp_path, 2)).params["blocks.0.fc.kernel"][0, 0] == 5

  import orbax.checkpoint as ocp

  monkeypatch.setattr(ocp.Checkpointer, "save", _disk_full)
  writer.save(3, {k: v * 7 for k, v in params.items()}, opt, {"layout": {}})
  with pytest.raises(ckpt.CheckpointError, match="disk full"):
    writer.wait()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3"]
  assert ckpt.load(ckpt.step_dir(tmp_path, 3)).params["blocks.0.fc.kernel"][0, 0] == 1


def test_older_workdir_resumes(saved, tmp_path):
  """A run's workdir from before orbax's step folders (its step 4 as an older version wrote
  it) resumes from that step."""
  base, _, full = saved
  shutil.copytree(base / "stopped", tmp_path / "run")
  root = tmp_path / "run" / "checkpoints"
  loaded = ckpt.load(ckpt.step_dir(root, 4))
  shutil.rmtree(ckpt.step_dir(root, 4))
  folder = _write_older(root, 4, loaded.params, loaded.opt_state)
  meta = json.loads((folder / "meta.json").read_text())
  (folder / "meta.json").write_text(json.dumps({**loaded.meta, "entries": meta["entries"]}))
  lines = []
  cfg = cfg_of(mesh__dp=1, mesh__pp=1)
  result = Trainer(cfg, tmp_path / "run", log=lines.append).run()
  [loaded] = [e for e in result.events if isinstance(e, CheckpointLoaded)]
  assert loaded.step == 4 and loaded.path.endswith("step_00000004"), loaded
  assert [m["sample_digest"] for m in result.metrics] == [m["sample_digest"] for m in full.metrics]
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)


def _damage(folder, how, name, data):
  state = folder / "state"
  if how == "flip":  # one bit, in the middle of the entry's stored bytes
    needle = data[len(data) // 2: len(data) // 2 + 64]
    for f in sorted(p for p in state.rglob("*") if p.is_file()):
      raw = bytearray(f.read_bytes())
      at = raw.find(needle)
      if at >= 0:
        raw[at] ^= 0x01
        f.write_bytes(bytes(raw))
        return
    raise AssertionError(f"the bytes of {name} are not stored as such")
  if how == "no_state_metadata":
    (state / "_METADATA").unlink()
  elif how == "no_manifest":
    for f in state.rglob("manifest.ocdbt"):
      f.unlink()
  elif how == "meta_without_checksums":
    meta = json.loads(ckpt.meta_path(folder).read_text())
    del meta["entries"]["opt_state"]
    _write_meta(folder, meta, seal=False)  # an older checkpoint's, without a checksum
  elif how == "truncated":  # the largest data file loses its second half
    files = sorted((p for p in state.rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size)
    files[0].write_bytes(files[0].read_bytes()[: files[0].stat().st_size // 2])


@pytest.mark.parametrize("how", ["flip", "no_state_metadata", "no_manifest", "truncated",
                                 "meta_without_checksums"])
def test_damage_is_caught_by_the_one_pass_read(saved, tmp_path, how):
  """The parallel read checksums each array as its bytes arrive; every kind of damage is still
  a CheckpointError (so `load_latest` falls back), a flipped bit names its entry."""
  base, _, _ = saved
  folder = tmp_path / "ck"
  shutil.copytree(ckpt.step_dir(base / "stopped" / "checkpoints", 4), folder)
  good = ckpt.load(folder, workers=3)
  assert good.timings["direct"] == good.timings["entries"] > 0  # all took the one-pass read
  name = "blocks.1.mlp.fc.kernel"
  _damage(folder, how, name, good.params[name].tobytes())
  expected = {"flip": f"params entry '{name}' fails its checksum",
              "no_state_metadata": "state metadata unreadable",
              "no_manifest": "entry '.*' is missing",
              "truncated": "entry '.*' is unreadable",
              "meta_without_checksums": "lacks the opt_state entries"}[how]
  with pytest.raises(ckpt.CheckpointError, match=expected):
    ckpt.load(folder)


def test_damaged_metadata_is_a_damaged_checkpoint(tmp_path, capsys, monkeypatch):
  """Metadata carries its own checksum and its step must be its folder's: a `step` edited to 7
  in step 3's folder once skipped a step silently; `inspect` crashed on damaged metadata;
  `verify WORKDIR` said OK for an older step without naming the damaged newest; `init_from`
  took an older checkpoint without saying which or why. An older checkpoint without the
  checksum still loads."""
  from launch.checkpoint import main as checkpoint_cli
  from resilient_jax.checkpoint.init_from import read_params

  root = tmp_path / "run" / "checkpoints"
  writer = ckpt.CheckpointWriter(root, keep=0)
  for step in (1, 2, 3):
    writer.save(step, {"w": np.full((2, 2), step, np.float32)}, {}, {"layout": {}})
  writer.wait()
  monkeypatch.setattr(store, "non_finite", lambda arrays: [])  # as an older version wrote it
  writer.save(4, {"w": np.full((2, 2), np.nan, np.float32)}, {}, {"layout": {}})
  writer.wait()
  monkeypatch.undo()
  lines = []
  params, taken = read_params(tmp_path / "run", log=lines.append)
  assert params["w"][0, 0] == 3 and taken.startswith("step 3 (")
  assert "1 newer one(s) skipped" in taken
  assert len(lines) == 1 and "step 4 is unusable" in lines[0] and "non-finite" in lines[0]
  shutil.rmtree(root / "4")

  meta = json.loads(ckpt.meta_path(root / "3").read_text())
  assert meta[store.META_DIGEST] == store.meta_digest(meta)
  edited = {**meta, "step": 7}
  for write, why in ((lambda: ckpt.meta_path(root / "3").write_text(json.dumps(edited)),
                      "fails its checksum"),  # its checksum is the unedited one's
                     (lambda: _write_meta(root / "3", edited),  # resealed: step 7 in 3/
                      "says step 7, but its folder is step 3")):
    write()
    lines = []
    assert ckpt.load_latest(root, log=lines.append).step == 2
    assert len(lines) == 1 and "step 3 is unusable" in lines[0] and why in lines[0], lines
    assert checkpoint_cli(["checkpoint", "verify", str(tmp_path / "run")]) == 1
    out, err = capsys.readouterr()
    assert f"CORRUPT: step 3: {root / '3'}" in err and why in err
    assert "OK:" in out and "(step 2)" in out and "a resume starts after step 2" in out
    assert checkpoint_cli(["checkpoint", "inspect", str(tmp_path / "run")]) == 1
    assert why in capsys.readouterr().err

  ckpt.meta_path(root / "3").write_bytes(b'{"format": "\xff\xfe"}')  # not UTF-8
  assert checkpoint_cli(["checkpoint", "inspect", str(root)]) == 1
  assert "unreadable" in capsys.readouterr().err
  _write_meta(root / "3", meta, seal=False)  # written before metadata had a checksum
  assert ckpt.load_latest(root, log=quiet).step == 3


def test_a_superseded_job_commits_no_checkpoint(saved, tmp_path):
  """Two jobs on one workdir (process 0 frozen past the heartbeat, the job requeued, the frozen
  process let go): each start takes the workdir's lease, and the older job, at its next commit,
  finds the newer one's there and stops with exit 7, committing nothing; before the lease it
  trained on and committed over the newer job's checkpoints."""
  from resilient_jax.checkpoint.lease import Lease, Superseded
  from resilient_jax.exit_codes import EXIT_DECLARED_DEAD, exit_code_for

  base, _, _ = saved
  run = tmp_path / "run"
  shutil.copytree(base / "stopped", run)
  lines = []
  trainer = Trainer(cfg_of(mesh__dp=2, mesh__pp=2, checkpoint__every_steps=2), run,
                    log=lines.append)
  newer = []
  trainer.add_hook(lambda info: newer.append(Lease.take(run)))  # step 5's, before its save
  with pytest.raises(Superseded, match="a newer job took over") as stopped:
    trainer.run()
  assert exit_code_for(stopped.value) == EXIT_DECLARED_DEAD
  assert any("workdir lease: generation 2" in x for x in lines), lines
  assert newer[0].generation == 3 and "checkpoint of step 5 not committed" in str(stopped.value)
  assert ckpt.committed_steps(run / "checkpoints") == [2, 4]

  # The writer checks again just before its commit; a damaged lease is its holder's again.
  writer = ckpt.CheckpointWriter(tmp_path / "w")
  older = Lease.take(tmp_path)
  writer.fence = lambda step: older.check(f"the checkpoint of step {step}")
  (tmp_path / "lease").write_bytes(b"\xff")
  older.check("a test")
  assert json.loads((tmp_path / "lease").read_text())["token"] == older.token
  writer.save(1, {"w": np.ones(2, np.float32)}, {}, {"layout": {}})
  writer.wait()
  Lease.take(tmp_path)
  writer.save(2, {"w": np.ones(2, np.float32)}, {}, {"layout": {}})
  with pytest.raises(Superseded):
    writer.wait()
  assert ckpt.committed_steps(tmp_path / "w") == [1]


def test_bfloat16_state_is_checksummed_and_checked_for_non_finite(tmp_path, monkeypatch):
  """numpy does not count bfloat16 as floating; an inf in it is still never written or loaded."""
  import ml_dtypes

  from resilient_jax.checkpoint import store

  w = np.arange(8, dtype=np.float32).reshape(2, 4).astype(ml_dtypes.bfloat16)
  writer = ckpt.CheckpointWriter(tmp_path, keep=0)
  writer.save(1, {"w": w}, {}, {"layout": {}})
  assert writer.wait()
  loaded = ckpt.load(ckpt.step_dir(tmp_path, 1))
  assert loaded.params["w"].dtype == w.dtype and loaded.params["w"].tobytes() == w.tobytes()
  bad = w.copy()
  bad[0, 1] = np.inf
  writer.save(2, {"w": bad}, {}, {"layout": {}})
  with pytest.raises(ckpt.CheckpointError, match="not finite"):
    writer.wait()
  monkeypatch.setattr(store, "non_finite", lambda arrays: [])  # as an older version wrote it
  writer._write(3, {"params": {"w": bad}, "opt_state": {}}, {"layout": {}})
  monkeypatch.undo()
  with pytest.raises(ckpt.CheckpointError, match="'w' holds non-finite values"):
    ckpt.load(ckpt.step_dir(tmp_path, 3))


def test_retention_and_async_commit(tmp_path, monkeypatch):
  gate = threading.Event()
  original = ckpt.CheckpointWriter._write

  def gated(self, *args):
    gate.wait(timeout=60)
    original(self, *args)

  monkeypatch.setattr(ckpt.CheckpointWriter, "_write", gated)
  writer = ckpt.CheckpointWriter(tmp_path, keep=2)
  params = {"a.kernel": np.ones((3, 2), np.float32)}
  opt = {"0/count": np.array(1, np.int32)}
  writer.save(1, params, opt, {"layout": {}})
  # save() returned while the write is still held back: nothing committed yet.
  assert ckpt.committed_steps(tmp_path) == []
  gate.set()
  for step in (2, 3):
    writer.save(step, params, opt, {"layout": {}})
  writer.wait()
  assert ckpt.committed_steps(tmp_path) == [2, 3]
  assert len(writer.blocked_s) == 3


def test_save_due_while_the_previous_is_written_is_deferred(tmp_path, monkeypatch):
  """Training does not wait for the disk: a save due while the writer is busy is taken at the
  first step it is free; the last step's save is always taken."""
  busy = iter([False, True, True, False])  # asked at steps 1, 2, 3, 4 (5 is the last: forced)
  monkeypatch.setattr(ckpt.CheckpointWriter, "busy", lambda self: next(busy))
  lines = []
  cfg = tiny_config(train__steps=5, checkpoint__every_steps=1, checkpoint__keep=0,
                    checkpoint__if_busy="defer")
  Trainer(cfg, tmp_path, log=lines.append).run()
  assert ckpt.committed_steps(tmp_path / "checkpoints") == [1, 4, 5]
  deferred = [line for line in lines if "deferred" in line]
  assert len(deferred) == 2, deferred
  assert deferred[0].startswith("checkpoint of step 2 deferred: the previous save is still")
  assert deferred[1].startswith("checkpoint of step 4 (due at step 2, deferred while")
  assert next(busy, None) is None  # asked exactly at the due steps


def test_failed_background_save_is_reported_and_keeps_older(tmp_path, monkeypatch):
  writer = ckpt.CheckpointWriter(tmp_path, keep=0)
  params = {"a.kernel": np.ones((3, 2), np.float32)}
  writer.save(1, params, {}, {})
  writer.wait()
  import orbax.checkpoint as ocp

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "async_save", _disk_full)  # mid-save
  writer.save(2, params, {}, {})
  with pytest.raises(ckpt.CheckpointError, match="disk full"):
    writer.wait()
  assert ckpt.committed_steps(tmp_path) == [1]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # no unfinished folder left


def _files(root) -> dict[str, tuple[bytes, int]]:
  """Every file under `root`: its bytes and modification time."""
  return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
          for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("key,value", [("train__global_batch", 32), ("train__seed", 7),
                                       ("model__num_heads", 4), ("train__data", "text")])
def test_a_refused_resume_changes_no_file(saved, tmp_path, key, value):
  """Another seed, batch, model or data is refused before anything is written: config.json
  was once overwritten with the rejected config."""
  base, _, _ = saved
  run = tmp_path / "run"
  shutil.copytree(base / "stopped", run)
  before = _files(run)
  cfg = cfg_of(mesh__dp=2, mesh__pp=2, **{key: value})
  with pytest.raises(ConfigError, match="differs from the (checkpoint|model saved)"):
    Trainer(cfg, run, log=quiet).run()
  assert _files(run) == before


def test_inspect_cli(saved):
  base, _, _ = saved
  proc = subprocess.run(
    [sys.executable, "-m", "launch.checkpoint", "inspect", str(base / "stopped")],
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stderr
  assert "step 4" in proc.stdout and "dp=2 pp=4" in proc.stdout
  assert "blocks.3.mlp.fc.kernel" in proc.stdout and "(32, 128)" in proc.stdout
  bad = subprocess.run(
    [sys.executable, "-m", "launch.checkpoint", "inspect", "/nope"],
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_stage_loss_restores_onto_survivors(tmp_path):
  """Both workers of stage 1 die at step 4: restore step 3 onto the 2 survivors (one pipeline
  of the same 2 stages), go on."""
  cfg = cfg_of(
    mesh__dp=2,
    mesh__pp=2,
    checkpoint__every_steps=1,
    faults__schedule="4:0.1,4:1.1",
  )
  lines = []
  result = Trainer(cfg, tmp_path, log=lines.append).run()
  [restore] = [e for e in result.events if isinstance(e, Restored)]
  assert (restore.step, restore.from_step) == (4, 3) and restore.plan.startswith("dp=1 pp=2")
  assert any("redoing 1 step(s): 4..4" in x for x in lines)
  rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert rows[-1]["live_workers"] == 2
  ref_cfg = cfg_of()
  plan_digests = [m["sample_digest"] for m in train(ref_cfg, tmp_path / "ref", log=quiet).metrics]
  assert [r["sample_digest"] for r in rows] == plan_digests
  assert_matches_reference(result.metrics, result.interpreter.all_params(), ref_cfg)


def test_restart_policy_restores_and_matches(tmp_path):
  """policy=restart: any failure stops, restores the latest checkpoint onto the survivors."""
  cfg = cfg_of(
    mesh__dp=2,
    mesh__pp=2,
    checkpoint__every_steps=2,
    faults__schedule="4:1.0",
    resilience__policy="restart",
  )
  lines = []
  result = Trainer(cfg, tmp_path, log=lines.append).run()
  # 3 survivors: one pipeline of the same 2 stages (the stage count is what fits in memory).
  assert any("resilience.policy=restart" in x and "onto dp=1 pp=2" in x for x in lines)
  assert any("redoing 2 step(s): 3..4" in x for x in lines)
  rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  # TensorBoard: steps 3 and 4, run twice, once each with their second values; the failure.
  assert_losses_match(tmp_path, rows)
  [(step, text)] = texts(tmp_path / "tb", "failure")
  assert step == 4 and "node(s) [2] failed at the start of step 4" in text
  assert "going on from step 3 on dp=1 pp=2" in text
  ref_cfg = cfg_of()
  assert_matches_reference(result.metrics, result.interpreter.all_params(), ref_cfg)


@pytest.mark.parametrize("verbosity,shown", [(0, False), (1, True)])
def test_orbax_info_lines_only_at_debug_verbosity(tmp_path, caplog, verbosity, shown):
  """At absl's INFO verbosity a save adds no orbax INFO lines (about 40 otherwise); at
  `--verbosity=1` they are there."""
  import logging

  from absl import logging as absl_logging

  before = absl_logging.get_verbosity()
  absl_logging.set_verbosity(verbosity)
  try:
    with caplog.at_level(logging.DEBUG, logger="absl"):
      writer = ckpt.CheckpointWriter(tmp_path)
      writer.save(1, {"a.kernel": np.ones((3, 2), np.float32)}, {}, {})
      writer.wait()
  finally:
    absl_logging.set_verbosity(before)
  chatter = [r for r in caplog.records if "orbax" in r.pathname and r.levelno < logging.WARNING]
  assert bool(chatter) == shown
