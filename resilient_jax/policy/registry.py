"""The registry of policies: open, so a user's policy runs in the runtime and the simulator alike.

A policy is registered once under its name (`register_policy`) with a factory that builds it for
one run or one simulation and, optionally, the check of a run's config it needs (Bamboo's
`mesh.pp >= 2`); `resilience.policy` and `sim.policies` name registered policies. The library
registers its own at import: `recycle` and `naive` (`rerouting.py`), `oobleck` (`templates.py`),
`bamboo` (`redundancy.py`), `restart` (`restart.py`) and `auto` (`auto.py`), which chooses among
the library's others.

`build_policies` gives fresh policy objects (with empty caches) for the runtime's coordinator
(one run) or the simulator (one simulation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from resilient_jax.checks import ConfigError
from resilient_jax.policy.auto import AutoPolicy
from resilient_jax.policy.base import Policy, RecoveryParams
from resilient_jax.policy.redundancy import BambooPolicy
from resilient_jax.policy.rerouting import DEFAULT_EXACT_OPS, PlannerPolicy
from resilient_jax.policy.restart import RestartPolicy
from resilient_jax.policy.templates import OobleckPolicy

__all__ = ["PolicyContext", "build_policies", "check_config", "policy_names", "register_policy"]


@dataclasses.dataclass(frozen=True)
class PolicyContext:
  """What a factory builds its policy from.

  Attributes:
    params: recovery times.
    restart: the run's checkpoint-restart policy (what an in-place policy falls back on).
    exact_ops: grids with at most this many compute ops are planned whole (`PlannerPolicy`).
    tolerate: Oobleck's failures to survive (`resilience.tolerate`).
    min_pipeline_nodes: Oobleck's smallest template; 0: see `templates.py`.
  """

  params: RecoveryParams
  restart: RestartPolicy
  exact_ops: int = DEFAULT_EXACT_OPS
  tolerate: int = 1
  min_pipeline_nodes: int = 0


@dataclasses.dataclass(frozen=True)
class _Entry:
  factory: Callable[[PolicyContext], Policy]
  check_config: Callable[[Any], None] | None
  candidate: bool
  """Whether `auto` chooses among it (the library's in-place policies and restart)."""


_REGISTRY: dict[str, _Entry] = {}


def register_policy(name: str, factory: Callable[[PolicyContext], Policy], *,
                    check_config: Callable[[Any], None] | None = None,
                    _candidate: bool = False) -> None:
  """Registers `factory` (`PolicyContext -> Policy`) under `name`, for `resilience.policy` and
  `sim.policies`; `check_config(RunConfig)` raises `ConfigError` for a run it cannot serve.

  Raises:
    ValueError: `name` is taken, or not a plain name.
  """
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f"a policy's name is a plain identifier, not {name!r}")
  if name in _REGISTRY:
    raise ValueError(f"a policy named {name!r} is already registered")
  _REGISTRY[name] = _Entry(factory, check_config, _candidate)


def policy_names() -> tuple[str, ...]:
  """The registered policies' names, the library's first."""
  return (*_REGISTRY, "auto")


def check_config(cfg: Any) -> None:
  """Raises `ConfigError` (one line) if `cfg.resilience.policy` is not registered or cannot
  serve `cfg` (the policy's own check)."""
  name = cfg.resilience.policy
  if name == "auto":
    return
  if name not in _REGISTRY:
    raise ConfigError(f"resilience.policy={name!r} is not one of {', '.join(policy_names())}")
  entry = _REGISTRY[name]
  if entry.check_config is not None:
    entry.check_config(cfg)


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
    names: policies to build, in order; None: every registered one.
    params: recovery times.
    exact_ops: see `PlannerPolicy`.
    tolerate: Oobleck's failures to survive (`resilience.tolerate`).
    min_pipeline_nodes: Oobleck's smallest template; 0: see `templates.py`.

  Returns:
    `{name: policy}`. `auto` chooses among the library's others.

  Raises:
    ValueError: for an unknown name.
  """
  params = params or RecoveryParams()
  restart = RestartPolicy(params)
  ctx = PolicyContext(params, restart, exact_ops, tolerate, min_pipeline_nodes)
  every: dict[str, Policy] = {name: e.factory(ctx) for name, e in _REGISTRY.items()}
  restart.fault_free = every["recycle"]  # what restart runs until a failure
  every["auto"] = AutoPolicy({n: every[n] for n, e in _REGISTRY.items() if e.candidate}, params)
  if names is None:
    return every
  names = list(names)
  unknown = [n for n in names if n not in every]
  if unknown:
    raise ValueError(f"unknown policy {unknown[0]!r}; choose from {', '.join(policy_names())}")
  return {name: every[name] for name in names}


def _bamboo_config(cfg: Any) -> None:
  if cfg.mesh.pp < 2:
    raise ConfigError("resilience.policy=bamboo needs mesh.pp >= 2: a stage's replica lives "
                      "on its predecessor")


register_policy("recycle", lambda c: PlannerPolicy(
  "recycle", "adaptive", "ReCycle: re-route to peers, fill bubbles (plan_adaptive)", c.params,
  c.restart, c.exact_ops), _candidate=True)
register_policy("naive", lambda c: PlannerPolicy(
  "naive", "naive", "re-route to peers, no bubble filling (plan_naive)", c.params, c.restart,
  c.exact_ops, keep_sources=True), _candidate=True)
register_policy("oobleck", lambda c: OobleckPolicy(
  c.params, c.restart, tolerate=c.tolerate, min_nodes=c.min_pipeline_nodes), _candidate=True)
register_policy("bamboo", lambda c: BambooPolicy(c.params, c.restart),
                check_config=_bamboo_config, _candidate=True)
register_policy("restart", lambda c: c.restart, _candidate=True)
