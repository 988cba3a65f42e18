"""One simulation end to end: cost model, sweep, trace, goodput, results.json, table and plots.

`launch/simulate.py` is a thin wrapper around `run_simulation`; tests and notebooks call it
directly with a `SimConfig`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilient_jax.observe.logs import info
from resilient_jax.observe.progress import reporting
from resilient_jax.policy.base import (
  Grid,
  PolicyUnavailableError,
  RecoveryParams,
  usable_policies,
)
from resilient_jax.policy.registry import build_policies
from resilient_jax.sim.config import SimConfig
from resilient_jax.sim.cost_model import CostModel, load_profile
from resilient_jax.sim.engine import TraceResult, restore_intervals, run_trace, sweep
from resilient_jax.sim.goodput import Slowdown, format_goodput, goodput_json
from resilient_jax.sim.mixes import MIXES
from resilient_jax.sim.traces import Trace, mix_trace, poisson_trace, read_csv_trace

__all__ = ["build_costs", "build_trace", "format_table", "run_simulation"]


def build_costs(cfg: SimConfig) -> CostModel:
  """The cost model: the measured profile when the config names one, else the specs."""
  if cfg.profile:
    return load_profile(cfg.profile, cfg.layout.pp)
  return CostModel.from_specs(
    cfg.model, cfg.device, cfg.network, cfg.layout, recompute=cfg.recompute
  )


def build_trace(cfg: SimConfig) -> Trace:
  """The failure trace: read from `trace.csv`, drawn from a published mix (`trace.mix`), or a
  seeded Poisson trace."""
  lay, tc = cfg.layout, cfg.trace
  if tc.csv:
    return read_csv_trace(
      tc.csv, nodes=lay.nodes, devices_per_node=lay.devices_per_node, duration_s=tc.duration_s
    )
  if tc.mix:
    return mix_trace(
      nodes=lay.nodes,
      devices_per_node=lay.devices_per_node,
      duration_s=tc.duration_s,
      device_mtbf_s=tc.device_mtbf_s,
      causes=MIXES[tc.mix](tc.repair_s, tc.transient_repair_s),
      nodes_per_switch=tc.nodes_per_switch,
      stragglers=tc.stragglers,
      seed=tc.seed,
    )
  return poisson_trace(
    nodes=lay.nodes,
    devices_per_node=lay.devices_per_node,
    duration_s=tc.duration_s,
    device_mtbf_s=tc.device_mtbf_s,
    node_mtbf_s=tc.node_mtbf_s,
    repair_s=tc.repair_s,
    seed=tc.seed,
  )


def _title(cfg: SimConfig) -> str:
  lay = cfg.layout
  return (
    f"{cfg.model.name} on {lay.devices} x {cfg.device.name} "
    f"(dp {lay.dp} x pp {lay.pp} x tp {lay.tp}, m={lay.microbatches}, {lay.schedule})"
  )


def _trace_json(cfg: SimConfig, result: TraceResult) -> dict[str, Any]:
  tr = result.trace
  policies = {}
  bins = None
  for name, run in result.policies.items():
    bins, rates = run.binned(tr.duration_s, cfg.bin_s)
    mean = run.samples / tr.duration_s
    policies[name] = {
      "throughput": [round(float(r), 4) for r in rates],
      "mean_throughput": mean,
      "fault_free_throughput": run.fault_free_throughput,
      "relative": mean / run.fault_free_throughput,
      "samples": run.samples,
      "paused_s": run.paused_s,
      "lost_s": run.lost_s,
      "stopped_s": run.stopped_s,
    }
  peak = max((len(f) for _, f in result.states), default=0)
  summary = (
    f"{tr.duration_s / 3600:g} h trace: {tr.failures} failures, {tr.rejoins} rejoins, "
    f"at most {peak} workers down at once"
  )
  return {
    "duration_s": tr.duration_s,
    "bin_s": cfg.bin_s,
    "bin_start_s": [float(b) for b in bins] if bins is not None else [],
    "summary": summary,
    "source": cfg.trace.csv or "poisson",
    "events": [
      {"time_s": e.time_s, "kind": e.kind, "node": e.node, "device": e.device} for e in tr.events
    ],
    "failed_workers": [{"time_s": t, "failed": len(f)} for t, f in result.states],
    "policies": policies,
  }


def run_simulation(
  cfg: SimConfig, out_dir: str | Path | None = None, *, log: Callable[[str], None] = info
) -> dict[str, Any]:
  """Simulates the sweep and the trace for every policy of `cfg`.

  Args:
    cfg: the configuration.
    out_dir: where results.json, sim_trace.png, sim_failures.png, sim_goodput.png and
      TensorBoard events (`tb/`, the goodput in `tb/goodput`) go; None: nowhere.
    log: progress lines.

  Returns:
    The results.json content: `config`, `rows`, `trace`, `goodput` (each policy's ETTR and
    losses), `unavailable`, `timing`.

  Raises:
    ValueError: for a bad profile or trace file (one-line message).
    PolicyUnavailableError: when the config names a policy that cannot evaluate its grid.
  """
  t_start = time.perf_counter()
  lay = cfg.layout
  costs = build_costs(cfg)
  grid = Grid(lay.dp, lay.pp, lay.microbatches, lay.schedule, lay.memory_cap)
  params = recovery_params(cfg, grid, costs)
  policies = build_policies(cfg.policies, params=params, exact_ops=cfg.exact_ops)
  policies, unavailable = usable_policies(policies, grid, costs)
  if unavailable and cfg.policies is not None:
    # Asked for by name: a one-line error rather than a table without it.
    raise PolicyUnavailableError(next(iter(unavailable.values())))
  log(f"simulating {_title(cfg)}; policies: {', '.join(policies)}")
  counts = len(cfg.sweep.failures)
  with reporting(log, lambda t: f"  sweeping {counts} failure counts x {len(policies)} policies: "
                 f"{t:.0f}s so far"):
    rows = sweep(
      grid,
      costs,
      policies,
      cfg.sweep.failures,
      samples_per_step=lay.global_batch,
      placement=cfg.sweep.placement,
      stage=cfg.sweep.stage,
      seed=cfg.sweep.seed,
      layout=lay,
    )
  t_sweep = time.perf_counter() - t_start
  trace = build_trace(cfg)
  with reporting(log, lambda t: f"  replaying the failure trace ({len(trace.events)} events) "
                 f"under every policy: {t:.0f}s so far"):
    result = run_trace(
      lay, costs, policies, trace, checkpoint_interval_s=params.checkpoint_interval_s,
      checkpoint_write_s=cfg.checkpoint_blocking_s,
    )
    if cfg.young_daly:
      # Each policy checkpoints as often as the restores it needs: a second pass at those
      # intervals (the first counted the restores at restart's interval).
      intervals = restore_intervals(result, cfg.checkpoint_blocking_s, cfg.checkpoint_write_s)
      for name, policy in policies.items():
        if hasattr(policy, "params"):
          policy.params = dataclasses.replace(policy.params,
                                              checkpoint_interval_s=intervals[name])
      result = run_trace(lay, costs, policies, trace, checkpoint_interval_s=intervals,
                         checkpoint_write_s=cfg.checkpoint_blocking_s)
      log("checkpoint intervals (Young/Daly for each policy's restores, "
          f"{cfg.checkpoint_blocking_s * 1e3:.0f} ms blocking a save): "
          + ", ".join(f"{n} {v:.0f} s" for n, v in intervals.items()))
  t_total = time.perf_counter() - t_start
  results = {
    "config": _config_json(cfg, costs, params),
    "op_costs_s": _op_costs_json(cfg, costs),
    "rows": [r.to_json() for r in rows],
    "trace": _trace_json(cfg, result),
    "goodput": goodput_json(result),
    "unavailable": unavailable,
    "timing": {
      "sweep_s": t_sweep,
      "trace_s": t_total - t_sweep,
      "total_s": t_total,
      "plans": sum(getattr(p, "plans", 0) for p in policies.values()),
    },
  }
  if out_dir is not None:
    _write_results(results, Path(out_dir), log)
  return results


def recovery_params(cfg: SimConfig, grid: Grid, costs: CostModel) -> RecoveryParams:
  """The recovery times the policies price with: the config's, with `regroup_steps` fault-free
  steps added to the regroup (the runtime's `resilience.regroup_steps`, priced at this cost
  model's step time)."""
  if not cfg.regroup_steps:
    return cfg.recovery
  step = Slowdown(grid, costs).ideal_step
  return dataclasses.replace(
    cfg.recovery, regroup_s=cfg.recovery.regroup_s + cfg.regroup_steps * step
  )


def _config_json(cfg: SimConfig, costs: CostModel, params: RecoveryParams) -> dict[str, Any]:
  """results.json's `config`: what was simulated, for the table, the plots and a reader."""
  lay = cfg.layout
  return {
    "title": _title(cfg),
    "model": cfg.model.name,
    "params": cfg.model.params,
    "device": cfg.device.name,
    "devices": lay.devices,
    "dp": lay.dp,
    "pp": lay.pp,
    "tp": lay.tp,
    "microbatches": lay.microbatches,
    "micro_batch_size": lay.micro_batch_size,
    "global_batch": lay.global_batch,
    "schedule": lay.schedule,
    "placement": lay.placement,
    "cost_source": costs.source,
    "sweep_placement": cfg.sweep.placement,
    "recovery": {
      **{
        k: getattr(params, k)
        for k in ("detect_s", "regroup_s", "restart_s", "checkpoint_interval_s")
      },
      "checkpoint_write_s": cfg.checkpoint_write_s,
      "checkpoint_blocking_s": cfg.checkpoint_blocking_s,
    },
  }


def _op_costs_json(cfg: SimConfig, costs: CostModel) -> dict[str, Any]:
  """results.json's `op_costs_s`: the per-stage op times of the fault-free grid."""
  lay = cfg.layout
  op = costs.op_costs((lay.dp,) * lay.pp)
  return {
    "f": list(op.f),
    "b": list(op.b),
    "w": list(op.w),
    "ar": list(op.ar),
    "opt": list(op.opt),
    "comm": op.comm,
  }


def _write_results(results: dict[str, Any], out: Path, log: Callable[[str], None]) -> None:
  """results.json, the two plots and the TensorBoard events under `out`."""
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps(_finite(results), indent=1) + "\n")
  from resilient_jax.sim import plots

  plots.plot_trace(results, out / "sim_trace.png")
  plots.plot_sweep(results, out / "sim_failures.png")
  plots.plot_goodput(results, out / "sim_goodput.png")
  from resilient_jax.observe import tensorboard

  tensorboard.write_simulation(out / "tb", results, log=log)
  _write_goodput_board(out / "tb" / "goodput", results, log)


def _write_goodput_board(logdir: Path, results: dict[str, Any], log: Callable[[str], None]
                         ) -> None:
  """TensorBoard scalars `goodput/<policy>/ettr` and `.../<loss>_share` (one step, 0), in a
  run of their own (`tb/goodput`) beside the sweep's and the trace's."""
  from resilient_jax.observe.tensorboard import Board

  board = Board(logdir, start_step=0, log=log)
  for name, g in results["goodput"]["policies"].items():
    values = {"ettr": g["ettr"], **{f"{k}_share": v for k, v in g["losses_share"].items()}}
    board.scalars(0, f"goodput/{name}/", values)
  board.close()


def _finite(obj: Any) -> Any:
  """JSON has no infinity: a step time of `inf` (cannot train) is written as null."""
  if isinstance(obj, float) and not math.isfinite(obj):
    return None
  if isinstance(obj, dict):
    return {k: _finite(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [_finite(v) for v in obj]
  return obj


def format_table(results: dict[str, Any]) -> str:
  """The printed summary: the sweep as a table of relative throughput, then the trace."""
  cfg = results["config"]
  rows = results["rows"]
  names = list(dict.fromkeys(r["policy"] for r in rows))
  by = {(r["policy"], r["failures"]): r for r in rows}
  ks = sorted({r["failures"] for r in rows})
  lines = [
    cfg["title"],
    f"global batch {cfg['global_batch']} samples; op costs from {cfg['cost_source']}",
  ]
  ff = "  ".join(f"{n} {by[(n, ks[0])]['fault_free_throughput']:.1f}" for n in names)
  lines.append(f"fault-free samples/s: {ff}")
  if cfg["sweep_placement"] == "hosts":
    lines.append("relative throughput vs concurrent failed hosts (random, all their workers; "
                 f"placement {cfg['placement']}):")
  else:
    where = "one stage" if cfg["sweep_placement"] == "stage" else "random workers"
    lines.append(f"relative throughput vs concurrent failed workers ({where}):")
  lines.append(f"{'failures':>8} {'bound':>7} " + " ".join(f"{n:>8}" for n in names))
  for k in ks:
    cells = " ".join(
      f"{by[(n, k)]['relative']:8.3f}" if (n, k) in by else f"{'-':>8}" for n in names
    )
    lines.append(f"{k:8d} {by[(names[0], k)]['bound']:7.3f} {cells}")
  tr = results["trace"]
  lines.append(tr["summary"] + ":")
  lines.append(f"{'policy':>8} {'samples/s':>10} {'relative':>8} {'paused':>9} {'lost':>9}")
  for name, run in tr["policies"].items():
    lines.append(
      f"{name:>8} {run['mean_throughput']:10.1f} {run['relative']:8.3f} "
      f"{run['paused_s'] / 60:8.1f}m {run['lost_s'] / 60:8.1f}m"
    )
  for name, why in results["unavailable"].items():
    lines.append(f"{name:>8} not available: {why}")
  lines += format_goodput(results)
  t = results["timing"]
  lines.append(f"simulated in {t['total_s']:.1f} s ({t['plans']} plans)")
  return "\n".join(lines)
