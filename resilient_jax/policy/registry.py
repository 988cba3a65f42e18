"""The registry of policies: every one built once per run or simulation, with shared caches.

`build_policies` gives fresh policy objects for the runtime's coordinator (one run) or the
simulator (one simulation): `recycle` and `naive` (`rerouting.py`), `oobleck` (`templates.py`),
`bamboo` (`redundancy.py`), `restart` (`restart.py`) and `auto` (`auto.py`), which chooses among
the others.
"""

from __future__ import annotations

from collections.abc import Iterable

from resilient_jax.config import POLICIES
from resilient_jax.policy.auto import AutoPolicy
from resilient_jax.policy.base import Policy, RecoveryParams
from resilient_jax.policy.redundancy import BambooPolicy
from resilient_jax.policy.rerouting import DEFAULT_EXACT_OPS, PlannerPolicy
from resilient_jax.policy.restart import RestartPolicy
from resilient_jax.policy.templates import OobleckPolicy

__all__ = ["POLICY_NAMES", "build_policies"]

POLICY_NAMES = POLICIES


def build_policies(
  names: Iterable[str] | None = None,
  *,
  params: RecoveryParams | None = None,
  exact_ops: int = DEFAULT_EXACT_OPS,
  tolerate: int = 1,
  min_pipeline_nodes: int = 0,
) -> dict[str, Policy]:
  """Fresh policy objects (with empty caches) for one run or one simulation.

  Args:
    names: policies to build, in order; None: every one.
    params: recovery times.
    exact_ops: see `PlannerPolicy`.
    tolerate: Oobleck's failures to survive (`resilience.tolerate`).
    min_pipeline_nodes: Oobleck's smallest template; 0: see `templates.py`.

  Returns:
    `{name: policy}`. `auto` chooses among all the others.

  Raises:
    ValueError: for an unknown name.
  """
  params = params or RecoveryParams()
  restart = RestartPolicy(params)
  every: dict[str, Policy] = {
    "recycle": PlannerPolicy(
      "recycle",
      "adaptive",
      "ReCycle: re-route to peers, fill bubbles (plan_adaptive)",
      params,
      restart,
      exact_ops,
    ),
    "naive": PlannerPolicy(
      "naive",
      "naive",
      "re-route to peers, no bubble filling (plan_naive)",
      params,
      restart,
      exact_ops,
      keep_sources=True,
    ),
    "oobleck": OobleckPolicy(params, restart, tolerate=tolerate, min_nodes=min_pipeline_nodes),
    "bamboo": BambooPolicy(params, restart),
    "restart": restart,
  }
  restart.fault_free = every["recycle"]  # what restart runs until a failure
  every["auto"] = AutoPolicy(dict(every), params)
  if names is None:
    return every
  unknown = [n for n in names if n not in every]
  if unknown:
    raise ValueError(f"unknown policy {unknown[0]!r}; choose from {', '.join(POLICY_NAMES)}")
  return {name: every[name] for name in names}
