"""The docs' tables that the deterministic simulator prints, generated so they cannot go stale.

Run:
  python benchmarks/readme_tables.py            # prints every block
  python benchmarks/readme_tables.py --write    # rewrites them where they are (docs/*.md)
  python benchmarks/readme_tables.py --only=sim-gpt3_6_7b --write

Each block sits in one of `DOCUMENTS` (docs/simulator.md, docs/clusters.md) between
`<!-- begin: NAME canary=DIGEST -->` and `<!-- end -->`.
A block costs full simulations (`sim-gpt3_6_7b`: about 20 s of CPU; `sim-ettr`, two presets
of 54 and 90 days, and `sim-placement`, 2 x 80 sweeps and 8 traces: minutes each), too much for
the test suite, so the marker carries a canary:
the digest of the same configs' `:runlocal` variants' results (the sweep, the trace and the
goodput of every policy on a tiny grid, a fraction of a second). `tests/test_sim.py` recomputes
the canaries and compares the 6.7B table's fault-free row with a fresh run of the full config
(that row alone is cheap): a change of the simulator or its policies changes a canary, and the
test names this command. The simulator is pure Python without clocks or unseeded randomness,
so every figure here is the same on any machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import runpy
import sys
import textwrap
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

DOCS = os.path.join(ROOT, "docs")
DOCUMENTS = [os.path.join(ROOT, "README.md"),
             *sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))]
"""Where the blocks may sit (each block in one of them)."""
SWEEP_ROWS = (0, 1, 16, 64, 256)
"""The failure counts of the sweep the 6.7B table shows (of the config's 0, 1, 2, ... 256)."""
ETTR_PRESETS = (("llama3_16k", "Llama 3 mix, 16k GPUs, 54 days"),
                ("byterobust_9600", "ByteRobust-like, 9,600 GPUs, 90 days"))
_BLOCK = re.compile(r"<!-- begin: (?P<name>[\w-]+) canary=(?P<canary>\w+) -->\n(?P<body>.*?)"
                    r"<!-- end -->", re.S)


def simulate(name: str, variant: str | None = None) -> dict:
  """`configs/sim/NAME.py[:variant]`'s results (`run_simulation`, nothing written)."""
  from resilient_jax.sim import from_config_dict, run_simulation

  cd = runpy.run_path(os.path.join(ROOT, "configs", "sim", f"{name}.py"))["get_config"](variant)
  return run_simulation(from_config_dict(cd), None, log=lambda _: None)


def canary(names: tuple[str, ...]) -> str:
  """Digest of the `:runlocal` variants' results of `names` (their timings left out)."""
  h = hashlib.sha256()
  for name in names:
    results = simulate(name, "runlocal")
    results.pop("timing")
    h.update(json.dumps(results, sort_keys=True).encode())
  return h.hexdigest()[:16]


def fault_free_rows(name: str) -> list[dict]:
  """The sweep's rows of `configs/sim/NAME.py` (full size) at no failure: each policy's
  fault-free throughput, without the rest of the sweep or the trace (cheap enough for a test)."""
  from resilient_jax.policy.base import Grid
  from resilient_jax.policy.registry import build_policies
  from resilient_jax.sim import build_costs, from_config_dict
  from resilient_jax.sim.engine import sweep
  from resilient_jax.sim.run import recovery_params, usable_policies

  cd = runpy.run_path(os.path.join(ROOT, "configs", "sim", f"{name}.py"))["get_config"]()
  cfg = from_config_dict(cd)
  lay = cfg.layout
  costs = build_costs(cfg)
  grid = Grid(lay.dp, lay.pp, lay.microbatches, lay.schedule, lay.memory_cap)
  policies = build_policies(cfg.policies, params=recovery_params(cfg, grid, costs),
                            exact_ops=cfg.exact_ops)
  policies, _ = usable_policies(policies, grid, costs)
  rows = sweep(grid, costs, policies, [0], samples_per_step=lay.global_batch,
               placement=cfg.sweep.placement, stage=cfg.sweep.stage, seed=cfg.sweep.seed,
               layout=lay)
  return [r.to_json() for r in rows]


def fault_free_row(rows: list[dict]) -> str:
  """The table's `fault-free samples/s` row from the sweep's rows (any failure count's)."""
  names = list(dict.fromkeys(r["policy"] for r in rows))
  by = {r["policy"]: r["fault_free_throughput"] for r in rows}
  return "| fault-free samples/s | | " + " | ".join(f"{by[n]:.0f}" for n in names) + " |"


def sim_table(results: dict) -> str:
  """GPT-3 6.7B's sweep (relative throughput at `SWEEP_ROWS` failures, each policy against its
  own fault-free throughput), fault-free and trace samples/s, and what the trace costs."""
  rows = results["rows"]
  names = list(dict.fromkeys(r["policy"] for r in rows))
  by = {(r["policy"], r["failures"]): r for r in rows}
  lines = ["| k | bound | " + " | ".join(names) + " |",
           "| ---: | ---: | " + " | ".join("---:" for _ in names) + " |"]
  for k in SWEEP_ROWS:
    lines.append(f"| {k} | {by[(names[0], k)]['bound']:.3f} | "
                 + " | ".join(f"{by[(n, k)]['relative']:.3f}" for n in names) + " |")
  lines.append(fault_free_row(rows))
  trace = results["trace"]["policies"]
  lines.append("| 24 h trace, mean samples/s | | "
               + " | ".join(f"{trace[n]['mean_throughput']:.0f}" for n in names) + " |")
  events = re.match(r".*?: (\d+) failures, (\d+) rejoins", results["trace"]["summary"])
  recycle, restart = trace["recycle"], trace["restart"]
  cost = (f"The trace ({events.group(1)} failures, {events.group(2)} rejoins) costs ReCycle "
          f"{100 * (1 - recycle['relative']):.1f}% of its fault-free throughput and "
          f"checkpoint-restart {100 * (1 - restart['relative']):.0f}% "
          f"({restart['paused_s'] / 60:.0f} minutes of restarts, {restart['lost_s'] / 60:.0f} "
          "minutes of lost work).")
  lines += ["", *textwrap.wrap(cost, width=100, break_on_hyphens=False)]
  return "\n".join(lines) + "\n"


def ettr_table(results: list[tuple[str, dict]]) -> str:
  """Each preset's ETTR per policy, the best in bold."""
  names = list(results[0][1]["goodput"]["policies"])
  lines = ["| policy | " + " | ".join(names) + " |",
           "| --- | " + " | ".join("---:" for _ in names) + " |"]
  for label, r in results:
    ettr = {n: p["ettr"] for n, p in r["goodput"]["policies"].items()}
    best = max(ettr.values())
    cells = [f"**{ettr[n]:.3f}**" if f"{ettr[n]:.3f}" == f"{best:.3f}" else f"{ettr[n]:.3f}"
             for n in names]
    lines.append(f"| ETTR, {label} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def placement_table(draws: int = 20, seeds: int = 4) -> str:
  """`benchmarks/placement.py`'s comparison: the re-routing policy's samples/s with k hosts
  failed under each placement (mean and worst of `draws` random host sets), and through
  `seeds` 24-hour traces of host failures."""
  from benchmarks.placement import HOSTS_FAILED, measure

  res = {p: measure(p, draws, seeds) for p in ("pipeline", "stage")}
  lines = [f"| hosts failed at once | `pipeline`: samples/s (relative), mean / worst of {draws} "
           "draws | `stage` |", "| --- | --- | --- |",
           f"| 0 | {res['pipeline']['fault_free']:.1f} | {res['stage']['fault_free']:.1f} |"]
  for k in HOSTS_FAILED:
    cells = []
    for p in ("pipeline", "stage"):
      (mean, worst), free = res[p]["hosts"][k], res[p]["fault_free"]
      cells.append(f"{mean:.1f} ({mean / free:.3f}) / {worst / free:.3f}")
    lines.append(f"| {k} | " + " | ".join(cells) + " |")
  traces = {p: sum(res[p]["trace"]) / len(res[p]["trace"]) for p in res}
  lines += ["", f"Through {seeds} traces of 24 hours of host failures only: "
            f"{traces['pipeline']:.1f} samples/s with `pipeline`, {traces['stage']:.1f} with "
            "`stage`."]
  return "\n".join(lines) + "\n"


BLOCKS: dict[str, tuple[tuple[str, ...], Callable[[], str]]] = {
  "sim-gpt3_6_7b": (("gpt3_6_7b",), lambda: sim_table(simulate("gpt3_6_7b"))),
  "sim-ettr": (tuple(n for n, _ in ETTR_PRESETS),
               lambda: ettr_table([(label, simulate(n)) for n, label in ETTR_PRESETS])),
  "sim-placement": (("hosts",), placement_table),
}
"""Block name -> (the sim configs its canary runs, what generates its body)."""


def readme_blocks(text: str) -> dict[str, re.Match]:
  return {m["name"]: m for m in _BLOCK.finditer(text)}


def document_blocks() -> dict[str, tuple[str, re.Match]]:
  """Every block of `DOCUMENTS`: its name -> (the file holding it, its match)."""
  found = {}
  for path in DOCUMENTS:
    with open(path) as f:
      found.update({name: (path, m) for name, m in readme_blocks(f.read()).items()})
  return found


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--write", action="store_true", help="rewrite the blocks where they are")
  p.add_argument("--only", default="", help="comma-separated block names (default: all)")
  args = p.parse_args(argv)
  chosen = [b for b in args.only.split(",") if b] or list(BLOCKS)
  unknown = sorted(set(chosen) - set(BLOCKS))
  if unknown:
    p.error(f"unknown block {unknown[0]} (choose from {', '.join(BLOCKS)})")
  made = {}
  for name in chosen:
    configs, make = BLOCKS[name]
    made[name] = f"<!-- begin: {name} canary={canary(configs)} -->\n{make()}<!-- end -->"
    print(made[name])
  if not args.write:
    return
  # Read just before writing: others may edit the docs while the simulations run.
  found = document_blocks()
  missing = [name for name in chosen if name not in found]
  if missing:
    sys.exit(f"no document has block {missing[0]}: add '<!-- begin: {missing[0]} canary=x -->' "
             "and '<!-- end -->' lines where it goes")
  for path in sorted({found[name][0] for name in chosen}):
    with open(path) as f:
      text = f.read()
    for name in chosen:
      if found[name][0] == path:
        text = text.replace(found[name][1].group(0), made[name])
    with open(path, "w") as f:
      f.write(text)
    print(f"wrote {', '.join(n for n in chosen if found[n][0] == path)} into {path}")

if __name__ == "__main__":
  main()
