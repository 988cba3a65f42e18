"""Test set-up: 8 simulated CPU devices and a shared compilation cache, before JAX starts."""

import gc
import os
import sys
import types

import pytest

# The suite's process traces and compiles thousands of programs: Python's cyclic collector,
# run every 700 allocations by default, took 5-8% of its CPU (tests/test_policies.py and
# tests/test_pipeline.py from an empty cache: 85 s user CPU, 78-81 s with these thresholds or
# with the collector off). Objects still go at refcount zero; cycles a little later.
gc.set_threshold(10_000, 10, 10)

# The suite compiles hundreds of tiny programs and runs each a few times: XLA's CPU backend at
# optimization level 0 compiles them about a quarter faster (tests/test_pipeline.py from an
# empty cache: 91 s of CPU against 67 s; from a warm one 38 s either way). What the tests check
# (every layout and policy against a one-device reference, computed in the same process and
# its subprocesses, which inherit the flag) does not depend on it; benchmarks and the library
# leave XLA's default, and the programs cache keys on XLA_FLAGS. Set the level yourself to
# test at another.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("RESILIENT_JAX_CACHE", os.path.join(ROOT, ".jax_cache"))

from resilient_jax.runtime import setup as runtime_setup  # noqa: E402

runtime_setup.configure_jax(num_cpu_devices=8)


@pytest.fixture(scope="session")
def rerouted_run(tmp_path_factory):
  """One small run through a failure, shared by the tests of its re-routing, timelines, log
  lines and evaluation: 2 x 2 grid, 4 steps, worker (1, 1) fails at the start of step 3, the
  held-out loss evaluated after steps 2 and 4 (`params`: every parameter then)."""
  from resilient_jax.training.loop import Trainer
  from tests.helpers import tiny_config

  cfg = tiny_config(mesh__dp=2, mesh__pp=2, faults__schedule="3:1.1", train__steps=4,
                    train__eval_every=2)
  workdir = tmp_path_factory.mktemp("rerouted_run")
  lines, params = [], {}
  trainer = Trainer(cfg, workdir, log=lines.append)
  trainer.add_hook(lambda info: params.update({info.step: info.params()}),
                   every=2)
  result = trainer.run()
  return types.SimpleNamespace(cfg=cfg, trainer=trainer, result=result, lines=lines,
                               workdir=workdir, params=params)


MAPS_TO_CLEAR = 30_000
"""Memory maps of the suite's process above which the stage programs kept for reuse are
dropped between test files. On XLA:CPU every loaded executable maps memory of its own (a
whole-model stage's fused backward ~330 maps, its forward ~150), the suite loads thousands,
and Linux ends the process at `vm.max_map_count` (65530 here) with a SIGSEGV in the next load.
Dropped programs are read back from the programs cache when a later test needs them."""


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():
  yield
  try:
    with open("/proc/self/maps") as f:
      count = sum(1 for _ in f)
  except OSError:  # not Linux: no such limit to keep under
    return
  if count > MAPS_TO_CLEAR:
    from resilient_jax.programs.shared import clear_shared_programs

    clear_shared_programs()
    gc.collect()
