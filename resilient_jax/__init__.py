"""resilient_jax: DP x PP training in JAX that keeps running when workers fail.

What a user calls is re-exported here (`__all__`), lazily, so `import resilient_jax.schedule`
(pure Python: schedules, planners, cost model) stays free of JAX for the simulator and fast
tests.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
  "RunConfig": "resilient_jax.config",
  "ConfigError": "resilient_jax.config",
  "from_config_dict": "resilient_jax.config",
  "Trainer": "resilient_jax.training.loop",
  "TrainResult": "resilient_jax.training.loop",
  "FaultEvent": "resilient_jax.training.faults",
  "NonFiniteSteps": "resilient_jax.training.hooks",
  "train": "resilient_jax.training.api",
  "run_config": "resilient_jax.training.api",
  "configure_jax": "resilient_jax.runtime.setup",
  "check_stageable": "resilient_jax.model.check",
  "NotStageableError": "resilient_jax.model.check",
  "Stageable": "resilient_jax.model.staging",
  "token_cross_entropy": "resilient_jax.model.staging",
  "train_reference": "resilient_jax.reference",
}

__all__ = sorted(_EXPORTS)
"""What users call: train a model, configure and check a run, compare with one device. The
runtime's parts (`runtime.interpreter.Interpreter`, `programs.stages.StagePrograms`, the
schedule's `Op` and plans, the policies' `RunCoordinator`) stay importable from their modules."""


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'resilient_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return __all__
