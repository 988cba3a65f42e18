"""An open policy registry (issue 51): a policy a user writes and registers by name runs in the
runtime and in the simulator alike, validates its own config, and keeps the mathematics."""

from __future__ import annotations

import pytest

from resilient_jax.config import ConfigError
from resilient_jax.policy import (
  InPlacePolicy,
  Policy,
  PolicyContext,
  RunCoordinator,
  RuntimePolicy,
  build_policies,
  check_config,
  policy_names,
  register_policy,
  registry,
)
from resilient_jax.policy.rerouting import PlannerPolicy
from resilient_jax.sim import from_config_dict as sim_config
from resilient_jax.sim import run_simulation
from resilient_jax.training.loop import Trainer
from tests.helpers import ROOT, assert_matches_reference, expected_digests, tiny_config


class Steady(PlannerPolicy):
  """A user's policy: re-routes with the library's naive planner (no bubble filling), never
  moves work off a straggler, and serves only grids of at least two pipelines."""

  reweights = False

  def __init__(self, ctx: PolicyContext):
    super().__init__("steady", "naive", "naive re-routing, stragglers left alone", ctx.params,
                     ctx.restart, ctx.exact_ops, keep_sources=True)

  @staticmethod
  def check_config(cfg) -> None:
    if cfg.mesh.dp < 2:
      raise ConfigError("resilience.policy=steady needs mesh.dp >= 2: it re-routes to peers")


@pytest.fixture
def steady():
  register_policy("steady", Steady, check_config=Steady.check_config)
  yield
  registry._REGISTRY.pop("steady")


def test_the_library_s_policies_keep_the_whole_contract():
  for name, policy in build_policies().items():
    assert isinstance(policy, Policy), name
    assert isinstance(policy.current or build_policies()["recycle"], RuntimePolicy), name
  assert issubclass(Steady, InPlacePolicy)


def test_a_registered_policy_is_named_validated_and_refused_when_unknown(steady):
  assert "steady" in policy_names() and "steady" in build_policies()
  assert "steady" not in build_policies()["auto"].candidates  # auto keeps the library's
  with pytest.raises(ValueError, match="already registered"):
    register_policy("steady", Steady)
  with pytest.raises(ConfigError, match="needs mesh.dp >= 2"):
    check_config(tiny_config(mesh__dp=1, mesh__pp=2, resilience__policy="steady"))
  with pytest.raises(ConfigError, match="is not one of recycle, naive"):
    RunCoordinator(tiny_config(resilience__policy="stedy"), range(4))


def test_a_registered_policy_trains_what_one_device_trains(steady, tmp_path):
  cfg = tiny_config(mesh__dp=2, mesh__pp=2, resilience__policy="steady", faults__schedule="2:1.1")
  result = Trainer(cfg, tmp_path, log=lambda _: None).run()
  assert [m["sample_digest"] for m in result.metrics] == expected_digests(cfg)
  assert_matches_reference(result.metrics, result.interpreter.all_params(), cfg)
  assert result.coordinator.policy == "steady" and result.metrics[-1]["live_workers"] == 3


def test_a_registered_policy_runs_in_the_simulator(steady, tmp_path):
  from resilient_jax.sim.config import load_config_file

  cd = load_config_file(f"{ROOT}/configs/sim/gpt3_6_7b.py:runlocal")
  cd.sim.policies = "steady,naive"
  results = run_simulation(sim_config(cd), None, log=lambda _: None)
  rows = {(r["policy"], r["failures"]): r["throughput"] for r in results["rows"]}
  # The same planner as naive's, so the same step times at every failure count.
  assert {k[1]: v for k, v in rows.items() if k[0] == "steady"} == {
    k[1]: v for k, v in rows.items() if k[0] == "naive"}
  assert set(results["trace"]["policies"]) == {"steady", "naive"}
