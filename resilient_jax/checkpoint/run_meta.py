"""What a checkpoint records of the run that saved it, and the check that a resume keeps it.

The state itself is layout-free (`universal.py`); beside it a checkpoint records the plan that
saved it (for `inspect`), the data position and the model, so that a resume on any layout can
refuse what would change the sample order or the model.
"""

from __future__ import annotations

import dataclasses
import json

from resilient_jax.checkpoint.store import Loaded
from resilient_jax.config import ConfigError, RunConfig
from resilient_jax.schedule.plan import GridPlan, Plan


def check_resumable(cfg: RunConfig, loaded: Loaded) -> None:
  """Raises ConfigError if resuming `loaded` under `cfg` would change the model or the data."""
  data = loaded.meta["data"]
  for key, now in (
    ("seed", cfg.train.seed),
    ("global_batch", cfg.step_batch),
    ("kind", cfg.train.data),
  ):
    if data[key] != now:
      raise ConfigError(
        f"train.{'data' if key == 'kind' else key}={now!r} differs from the checkpoint's "
        f"{data[key]!r} in {loaded.path}; resuming would change the sample order"
      )
  if loaded.meta["model"] != json.loads(json.dumps(dataclasses.asdict(cfg.model))):
    raise ConfigError(f"model.* differs from the model saved in {loaded.path}")


def plan_layout(plan: Plan) -> dict:
  """What a checkpoint records of the plan that saved it."""
  if isinstance(plan, GridPlan):
    s = plan.schedule
    return {"plan": plan.name, "dp": s.dp, "pp": s.pp,
            "partition": [hi - lo for lo, hi in plan.partition], "live_workers": len(s.ops)}
  return {"plan": plan.name, "pipelines": [[hi - lo for lo, hi in p.stages]
                                           for p in plan.pipelines],
          "dp": len(plan.pipelines), "pp": max(p.num_stages for p in plan.pipelines),
          "live_workers": len(plan.nodes)}


def checkpoint_meta(cfg: RunConfig, plan: Plan, step: int) -> dict:
  """What a checkpoint records besides the state: layout, data position, model."""
  return {
    # `tp` is for reading only: the state is the same whatever the sub-meshes it was split over.
    "layout": {**plan_layout(plan), "tp": cfg.mesh.tp},
    "data": {
      "kind": cfg.train.data,
      "seed": cfg.train.seed,
      "global_batch": cfg.step_batch,
      "next_step": step + 1,
    },
    "model": dataclasses.asdict(cfg.model),
    "train_steps": cfg.train.steps,
  }
