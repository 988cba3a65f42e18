"""Shared test helpers: tiny configs and a cached single-device reference."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import numpy as np

from configs.gpt_tiny import get_config
from resilient_jax.config import RunConfig, from_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Summation order differs between micro-batched pipelines and one big batch; float32 noise on
# these sizes stays around 1e-7 relative. The bounds leave room for AdamW amplifying it over a
# few steps, and stay far below any real bug (a wrong or missing micro-batch moves the loss by
# ~1e-2 and parameters by ~1e-3).
LOSS_RTOL = 2e-6
PARAM_ATOL = 2e-5


def assert_close(actual, desired, ulps: float = 32, err_msg: str = "") -> None:
  """`actual` equals `desired` up to float rounding at the array's scale.

  Another summation order (another XLA kernel, processor or split of the work) moves each
  element by a few units in the last place of the *largest* magnitude it was summed with, not of
  its own: an element near 0.05 in an array reaching 9.4 can differ by 1.4e-6 in float32 (seen
  on an AMD EPYC against the Intel Xeon the test was written on), where a relative tolerance
  expects 1e-12. So the bound is `ulps` float epsilons of the array's largest magnitude: a sum
  of n terms in another order drifts by about sqrt(n) of them, and 32 is three times that for
  the widest reduction of the tiny models (128 terms; tensor-parallel stages measured 5.5-6.9
  here). A real error (a missing all-reduce, a dropped micro-batch) moves elements by a share
  of that magnitude: the missing all-reduce of `test_tensor_parallel` by 2**23 epsilons.
  """
  actual, desired = np.asarray(actual), np.asarray(desired)
  eps = np.finfo(desired.dtype if np.issubdtype(desired.dtype, np.floating) else np.float32).eps
  scale = float(np.max(np.abs(desired))) if desired.size else 0.0
  np.testing.assert_allclose(actual, desired, rtol=0, atol=ulps * eps * scale, err_msg=err_msg)


def tiny_config(**overrides) -> RunConfig:
  """The `runlocal` variant with dotted-key overrides, e.g. `mesh__dp=2`."""
  cd = get_config("runlocal")
  for key, value in overrides.items():
    section, name = key.split("__")
    cd[section][name] = value
  return from_config_dict(cd)


@functools.cache
def _reference(model, optimizer, train):
  from resilient_jax.reference import train_reference

  cfg = tiny_config(mesh__dp=1, mesh__pp=1)
  return train_reference(dataclasses.replace(cfg, model=model, optimizer=optimizer, train=train))


def reference_for(cfg: RunConfig):
  """Losses and final parameters of the single-device run of `cfg`'s model, optimizer and
  data (all the samples of an optimizer step in one batch)."""
  train = dataclasses.replace(cfg.train, global_batch=cfg.step_batch, accumulate_steps=1)
  return _reference(cfg.model, cfg.optimizer, train)


def expected_digests(cfg: RunConfig) -> list[str]:
  """The sample digest of every step of a run that saw no failure."""
  from resilient_jax import data as data_lib
  from resilient_jax.recipe import make_data

  _, plan = make_data(cfg)  # synthetic data: an endless plan; a file: its permutations
  return [data_lib.sample_digest(plan.ids_for_step(t)) for t in range(cfg.train.steps)]


def assert_matches_reference(metrics: list[dict], params: dict, cfg: RunConfig) -> None:
  ref_losses, ref_params = reference_for(cfg)
  losses = [m["loss"] for m in metrics]
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  assert sorted(params) == sorted(ref_params)
  for name, value in ref_params.items():
    np.testing.assert_allclose(params[name], value, atol=PARAM_ATOL, err_msg=name)


def run_launcher(*args: str, env: dict | None = None, timeout: int = 300):
  """Runs `python -m launch.train ARGS` from the repo root; returns the CompletedProcess."""
  full_env = dict(os.environ)
  full_env.update(env or {})
  return subprocess.run(
    [sys.executable, "-m", "launch.train", *args],
    cwd=ROOT,
    env=full_env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def quick_only(cases, quick):
  """`cases` for `pytest.mark.parametrize`, those not in `quick` marked `slow`.

  A matrix of end-to-end runs (grids x schedules x policies) keeps one run of each kind in the
  quick subset (`pytest -m "not slow"`); the full suite runs them all.
  """
  import pytest

  quick = set(quick)
  slow = pytest.mark.slow
  return [c if c in quick else pytest.param(*c, marks=slow) if isinstance(c, tuple)
          else pytest.param(c, marks=slow) for c in cases]


def events_jsonl(workdir, *kinds: str) -> list[dict]:
  """The events a run wrote to `WORKDIR/events.jsonl` (of `kinds` only, when given)."""
  from pathlib import Path

  from resilient_jax.observe.events import read_events

  return read_events(Path(workdir) / "events.jsonl", kinds)


def loaded_checkpoints(result) -> list[tuple[int, str, str]]:
  """The checkpoints a run loaded, as `(step, saved_on, onto)` (`CheckpointLoaded` events)."""
  from resilient_jax.observe.events import CheckpointLoaded

  return [(e.step, e.saved_on, e.onto) for e in result.events if isinstance(e, CheckpointLoaded)]
