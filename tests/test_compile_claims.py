"""Processes sharing a cache folder compile a program once between them (`compile_claims`)."""

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

from resilient_jax.programs import compile_claims, compiled
from resilient_jax.programs.compiled import BuildCounter, OnEachDevice


def _read(path):
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return None


def _keeper(path, calls, started=None, release=None):
  def compile_and_keep():
    calls.append(threading.get_ident())
    if started is not None:
      started.set()
      release.wait(10)
    with open(path, "w") as f:
      f.write("program")
    return "compiled"
  return compile_and_keep


def test_the_second_process_waits_for_the_first_ones_compile(tmp_path):
  path = str(tmp_path / "prog")
  calls, started, release = [], threading.Event(), threading.Event()
  results = []
  first = threading.Thread(target=lambda: results.append(
    compile_claims.compile_once(path, _read, _keeper(path, calls, started, release))))
  first.start()
  assert started.wait(10)  # the first holds the claim, compiling
  second = threading.Thread(target=lambda: results.append(
    compile_claims.compile_once(path, _read, _keeper(path, calls))))
  second.start()
  second.join(0.3)
  assert second.is_alive()  # waiting for the kept file, not compiling
  release.set()
  first.join(10)
  second.join(10)
  assert len(calls) == 1
  assert sorted(results) == [("compiled", True), ("program", False)]
  assert not os.path.exists(path + ".compiling")  # released


def test_a_dead_or_silent_holder_is_taken_over_and_every_wait_is_bounded(tmp_path):
  path = str(tmp_path / "prog")
  claim = path + ".compiling"
  done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True)
  with open(claim, "w") as f:  # a holder of this host that has exited (SIGKILLed mid-compile)
    f.write(f"{compile_claims._HOST} {int(done.stdout)}\n")
  calls = []
  assert compile_claims.compile_once(path, _read, _keeper(path, calls)) == ("compiled", True)
  os.remove(path)
  with open(claim, "w") as f:  # a holder on another host that stopped touching its claim
    f.write("elsewhere 1\n")
  old = os.stat(claim).st_mtime - compile_claims.STALE_S - 1
  os.utime(claim, (old, old))
  assert compile_claims.compile_once(path, _read, _keeper(path, calls)) == ("compiled", True)
  os.remove(path)
  with open(claim, "w") as f:  # a live holder (this process) that never finishes
    f.write(f"{compile_claims._HOST} {os.getpid()}\n")
  assert compile_claims.compile_once(path, _read, _keeper(path, calls), wait_s=0.2) == \
    ("compiled", True)
  assert len(calls) == 3


def test_two_programs_needed_at_once_compile_once(tmp_path, monkeypatch):
  """Two `OnEachDevice`s of one function (two processes' programs) built at the same time on
  an empty cache folder: one compiles, the other reads the kept executable."""
  monkeypatch.setattr(compiled, "_cache_dir", str(tmp_path))

  def step(w, x):
    return jnp.tanh(x @ w) * 3.0 + 0.25

  devices = jax.devices()[:2]
  args = [[jax.device_put(jnp.linspace(-1, 1, 36).reshape(6, 6), d)] * 2 for d in devices]
  counts = BuildCounter()  # each thread counts into it
  outs = [None, None]

  def run(i):
    with counts.counting():
      outs[i] = np.asarray(OnEachDevice(step)(*args[i]))

  threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert (counts.compiled, counts.from_disk) == (1, 1)
  np.testing.assert_array_equal(outs[0], outs[1])
