"""Process-level JAX set-up: simulated CPU devices and the cache of compiled programs.

Must run before JAX initialises its backends (the first device query); later changes to the
device count have no effect.
"""

from __future__ import annotations

import os

import jax

from resilient_jax.programs import compiled

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "resilient_jax", "xla")


def configure_jax(num_cpu_devices: int, cache_dir: str | None = None) -> None:
  """Simulates `num_cpu_devices` CPU devices and turns on the cache of compiled programs.

  The CPU device count only matters where the CPU is the backend; on GPU/TPU hosts the real
  devices are used. Compilation dominates small runs, so programs are cached on disk
  (`RESILIENT_JAX_CACHE`, default ~/.cache/resilient_jax/xla; set it to "" to disable).
  """
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    try:
      jax.config.update("jax_num_cpu_devices", max(num_cpu_devices, 1))
    except RuntimeError:  # JAX already started: fine if it has the devices
      if jax.default_backend() == "cpu" and len(jax.devices()) < num_cpu_devices:
        raise RuntimeError(
          f"JAX already started with {len(jax.devices())} CPU devices; call "
          f"configure_jax({num_cpu_devices}) before any JAX operation"
        ) from None
  cache = os.environ.get("RESILIENT_JAX_CACHE", DEFAULT_CACHE) if cache_dir is None else cache_dir
  # The library's own cache of compiled programs (`compiled.OnEachDevice`), not JAX's: JAX's
  # is keyed by device, written by process 0 only, and its executables cannot be re-targeted
  # to another device (see `resilient_jax/programs/compiled.py`).
  compiled.set_cache_dir(os.path.join(cache, "programs") if cache else None)
