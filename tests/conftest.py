"""Test set-up: 8 simulated CPU devices and a shared compilation cache, before JAX starts."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("RESILIENT_JAX_CACHE", os.path.join(ROOT, ".jax_cache"))

from resilient_jax import runtime_setup  # noqa: E402

runtime_setup.configure_jax(num_cpu_devices=8)
