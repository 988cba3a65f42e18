"""The on-disk program cache (`compiled.py`): an entry serves only callers it fits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from resilient_jax.programs import compiled
from resilient_jax.programs.compiled import BuildCounter, OnEachDevice


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setattr(compiled, "_cache_dir", str(tmp_path))
  return tmp_path


def _fresh_run(fn, *args):
  """`fn` on `args` as a new process would run it (a new program object, the same cache
  folder); what it built: (compiled, read from disk)."""
  with BuildCounter().counting() as counts:
    out = OnEachDevice(fn)(*args)
  return out, (counts.compiled, counts.from_disk)


def test_an_unread_arguments_shape_is_in_the_key(cache):
  """jit leaves an argument the program never reads out of its text (an empty stage's forward
  reads none of its input); a run at another micro-batch size must not get the first run's
  executable, which checks the shape it was compiled for."""

  def forward(params, x):
    del x  # unread
    return params * 2.0

  dev = jax.devices()[0]
  params = jax.device_put(jnp.ones(3), dev)
  for rows, built in ((4, (1, 0)), (2, (1, 0)), (4, (0, 1))):
    out, counts = _fresh_run(forward, params, jax.device_put(jnp.zeros((rows, 3)), dev))
    np.testing.assert_array_equal(np.asarray(out), [2.0, 2.0, 2.0])
    assert counts == built, rows


def test_which_arguments_a_program_reads_is_in_the_key(cache):
  """Two programs reading the first or the second of two equal-shaped buffers have the same
  text once jit drops the unread one: the second must not load the first's executable, which
  would read the wrong buffer (packed gradients of two stages whose block sits in another
  chunk did: `programs/packing.py`)."""
  dev = jax.devices()[0]
  a, b = (jax.device_put(jnp.full(3, v), dev) for v in (1.0, 5.0))
  first, counts = _fresh_run(lambda x, y: x * 2.0, a, b)
  np.testing.assert_array_equal(np.asarray(first), [2.0] * 3)
  second, counts = _fresh_run(lambda x, y: y * 2.0, a, b)
  np.testing.assert_array_equal(np.asarray(second), [10.0] * 3)
  assert counts == (1, 0)  # compiled, not read from the first's file


def test_an_entry_from_a_host_with_other_features_is_rebuilt(cache, monkeypatch):
  """A program kept by a host with other instruction-set features (AVX-512 here, none there) is
  compiled again, not loaded; the first host's entry stays for it."""

  def step(w, x):
    return jnp.tanh(x @ w)

  dev = jax.devices()[0]
  args = [jax.device_put(jnp.linspace(-1, 1, 16).reshape(4, 4), dev)] * 2
  real = compiled.host_features(dev)
  assert real  # the machine and its flags, or the GPU's compute capability
  want = np.asarray(step(*args))
  for features, built in (("x86_64: avx2 avx512f", (1, 0)), ("x86_64: avx2", (1, 0)),
                          ("x86_64: avx2 avx512f", (0, 1))):
    monkeypatch.setattr(compiled, "host_features", lambda _d, f=features: f)
    out, counts = _fresh_run(step, *args)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
    assert counts == built, features
  assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 2


def _entries(cache):
  return sorted(p for p in cache.iterdir() if not p.name.startswith(".") and "." not in p.name)


class _Payload:
  """A pickle that runs a command when read."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    import os

    return (os.system, (f"touch {self.marker}",))


def _step(w, x):
  return jnp.tanh(x @ w) + 1.0


def test_damaged_or_foreign_entries_are_rebuilt_and_never_run(cache, tmp_path_factory,
                                                              monkeypatch):
  """A kept file is native code behind a pickle: one with flipped bytes (it crashed every
  later run), one a stranger wrote into a shared folder (it ran their command), one signed
  with another key, and a bare pickle are each compiled again; nothing of them runs."""
  import pickle

  dev = jax.devices()[0]
  args = [jax.device_put(jnp.linspace(-1, 1, 16).reshape(4, 4), dev)] * 2
  want = np.asarray(_step(*args))
  _, counts = _fresh_run(_step, *args)
  [entry] = _entries(cache)
  good = entry.read_bytes()
  marker = tmp_path_factory.mktemp("attack") / "ran"
  evil = pickle.dumps(_Payload(marker))
  flipped = bytearray(good)
  flipped[len(good) // 2] ^= 0xFF
  real_secret = compiled._secret()
  monkeypatch.setattr(compiled, "_secret", lambda: b"someone else's key")
  compiled._serialize(OnEachDevice(_step)._jit.lower(*args).compile(), str(entry), (dev,))
  foreign = entry.read_bytes()
  monkeypatch.setattr(compiled, "_secret", lambda: real_secret)
  for name, data in (("flipped", bytes(flipped)), ("foreign key", foreign),
                     ("bare pickle", evil), ("unsigned", good[:len(compiled._KEPT)]
                                             + bytes(32) + evil)):
    entry.write_bytes(data)
    out, counts = _fresh_run(_step, *args)
    np.testing.assert_array_equal(np.asarray(out), want)
    assert counts == (1, 0), name
    assert entry.read_bytes() == good, name  # rewritten, signed
    _, counts = _fresh_run(_step, *args)
    assert counts == (0, 1), name
  assert not marker.exists()


def test_the_unpickler_refuses_anything_but_jax_types(tmp_path):
  """Behind the signature, the reader of a program's pickle resolves JAX's and NumPy's types
  only."""
  import pickle

  marker = tmp_path / "ran"
  dev = jax.devices()[0]
  with pytest.raises(pickle.UnpicklingError, match="not part of a compiled program"):
    compiled._Retarget(pickle.dumps(_Payload(marker)), (dev,), ()).load()
  assert not marker.exists()


def test_the_users_key_is_made_once_private_and_refused_when_shared(tmp_path, monkeypatch):
  """`~/.config/resilient_jax/cache.key` (here under XDG_CONFIG_HOME) is made with mode 600 and
  read back the same; a key file others may read signs nothing (kept programs go unused)."""
  import os

  monkeypatch.delenv(compiled.SECRET_ENV, raising=False)
  monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
  compiled._secret.cache_clear()
  try:
    key = compiled._secret()
    path = tmp_path / "resilient_jax" / "cache.key"
    assert key and path.read_bytes().strip() == key and (path.stat().st_mode & 0o777) == 0o600
    compiled._secret.cache_clear()
    assert compiled._secret() == key  # made once
    os.chmod(path, 0o644)
    compiled._secret.cache_clear()
    assert compiled._secret() is None
    monkeypatch.setenv(compiled.SECRET_ENV, "shared by the job's hosts")
    compiled._secret.cache_clear()
    assert compiled._secret() == b"shared by the job's hosts"
  finally:
    compiled._secret.cache_clear()


def test_a_layout_that_equals_only_itself_does_not_split_the_key():
  """JAX 0.11 on GPU: arrays pulled from another process carry a layout object that prints as
  `AutoLayout` but equals no other; keyed by the object, every step missed the program cache."""
  from types import SimpleNamespace

  from resilient_jax.programs.compiled import _signature

  class Auto:  # equality by identity, as the layouts measured there
    def __repr__(self):
      return "AutoLayout"

  def leaf():
    aval = SimpleNamespace(shape=(3,), dtype=jnp.float32, weak_type=False, sharding=None,
                           memory_space=None, layout=Auto())
    return SimpleNamespace(aval=aval)

  treedef = jax.tree.structure([0, 0])
  assert _signature(treedef, [leaf(), leaf()], multi=False) == _signature(
    treedef, [leaf(), leaf()], multi=False)


@pytest.fixture
def jax_cache(tmp_path, monkeypatch):
  """JAX's own persistent compilation cache on, every program kept (as a user who sets
  `jax_compilation_cache_dir` has it), the library's folder off: `use(name)` points JAX at a
  fresh folder (a new process's view of it); all off again after."""
  from jax.experimental.compilation_cache import compilation_cache as jax_cc

  monkeypatch.setattr(compiled, "_cache_dir", None)
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  saved = {n: getattr(jax.config, n) for n in names}

  def use(name):
    jax_cc.reset_cache()  # JAX decides once per process whether its cache is used
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / name))

  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  try:
    yield use
  finally:
    for n, v in saved.items():
      jax.config.update(n, v)
    jax_cc.reset_cache()


def test_with_jax_cache_on_compiles_stay_flat_in_dp(jax_cache):
  """With JAX's persistent cache on, a program is compiled once whatever the number of devices
  (data-parallel replicas) it runs on, and loaded on the others. And where JAX's cache serves
  the first device (its executable would re-serialize without its kernels: "Function ... not
  found" on the others), the second device compiles it and every later one loads that: the
  same results, no broken copies."""

  devices = jax.devices()
  w, x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), np.eye(8, dtype=np.float32)
  want = np.tanh(x @ w) * 3.0

  def run(dp, folder):
    def step(w, x):  # a new function: as in a new process, JAX's in-memory caches miss
      return {"y": jnp.tanh(x @ w) * 3.0}

    jax_cache(folder)
    with BuildCounter().counting() as counts:
      program = OnEachDevice(step)
      for d in devices[:dp]:
        out = program(jax.device_put(w, d), jax.device_put(x, d))["y"]
        assert out.devices() == {d}
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
    return counts.compiled, counts.loaded, counts.xla

  assert run(2, "dp2") == (1, 1, 1)
  assert run(4, "dp4") == (1, 3, 1)  # as many compiles as at dp=2
  # JAX's folder of the dp=4 run holds the first device's program: read there, compiled on the
  # second (a compile of XLA's own, not a cache read), loaded on the other two.
  assert run(4, "dp4") == (2, 2, 2)
