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
