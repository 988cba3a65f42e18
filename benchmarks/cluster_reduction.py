"""The gradient ring reduction on real links: dp processes on dp hosts of rate-limited links.

    python benchmarks/cluster_reduction.py                     # dp=4, 200 Mbit/s, 16 MiB gradient
    python benchmarks/cluster_reduction.py --dp=4 --rate_mbit=200 --floats=4194304 --repeats=5

Needs root (`launch/cluster_box.py`: each host a network namespace on a private bridge, its link
limited with `tc tbf` both ways). dp processes, one per host, one CPU device each, join one
`jax.distributed` job at host 1's address and reduce one stage's gradient (`--floats` float32)
`--repeats` times through `ProcessTransport.reduce`, the runtime's own ring (the same child
program as `benchmarks/reduction.py`, which counts the bytes each process offers and pulls).

The ring promises 2 (dp - 1) / dp of the gradient in and out of every process (1.5 at dp=4); at
`rate_mbit` a host moves those bytes in at least bytes / rate seconds, each way at once. It prints
the busiest process's measured bytes over the gradient's, the median seconds per reduction (every
process waiting for the slowest), and `seconds_vs_bytes_bound: X`, the median seconds over
(the busiest process's bytes, the larger direction) / rate. Near 1: the ring is bound by the link,
as its byte count says; above it, by latency, hops in series or host time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.reduction import _CHILD, collect  # noqa: E402
from benchmarks.results import record  # noqa: E402
from launch.cluster_box import ClusterBox, missing  # noqa: E402


def measure(dp: int, rate_mbit: float, floats: int, repeats: int) -> dict:
  """One job of `dp` processes on `dp` hosts limited to `rate_mbit`."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  code = _CHILD.format(tree=ROOT, dp=dp, floats=floats, repeats=repeats)
  with ClusterBox(dp, rate_mbit=rate_mbit or None, tag="rjb", subnet="10.77.7") as box:
    address = f"{box.addr(1)}:7002"
    procs = [box.popen(p + 1, [sys.executable, "-c", code, str(p), address], cwd=ROOT, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in range(dp)]
    rows = collect(procs)
  grad = 4 * floats
  sent = max(statistics.median(r["sent"]) for r in rows)
  received = max(statistics.median(r["received"]) for r in rows)
  seconds = statistics.median(statistics.median(r["ms"]) for r in rows) / 1e3
  bound = max(sent, received) / (rate_mbit * 1e6 / 8) if rate_mbit else float("nan")
  return dict(dp=dp, sent_ratio=sent / grad, received_ratio=received / grad, seconds=seconds,
              bound_s=bound, promised_ratio=2 * (dp - 1) / dp)


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dp", type=int, default=4)
  p.add_argument("--rate_mbit", type=float, default=200.0)
  p.add_argument("--floats", type=int, default=4 * 1024 * 1024)
  p.add_argument("--repeats", type=int, default=5)
  a = p.parse_args(argv)
  if a.dp < 2 or a.rate_mbit <= 0 or a.floats < 1 or a.repeats < 1:
    print("error: --dp >= 2, --rate_mbit > 0, --floats >= 1 and --repeats >= 1", file=sys.stderr)
    sys.exit(2)
  why = missing(slurm=False)
  if why:
    print(f"error: {why}", file=sys.stderr)
    sys.exit(2)
  r = measure(a.dp, a.rate_mbit, a.floats, a.repeats)
  print(f"dp={r['dp']} on {r['dp']} hosts at {a.rate_mbit:g} Mbit/s each way, gradient "
        f"{4 * a.floats / 2**20:.1f} MiB: the busiest process sent {r['sent_ratio']:.3f} and "
        f"received {r['received_ratio']:.3f} of it per reduction (the ring promises "
        f"{r['promised_ratio']:.3f}); median {r['seconds']:.3f} s per reduction, bytes / rate "
        f"{r['bound_s']:.3f} s")
  ratio = r["seconds"] / r["bound_s"]
  print(f"seconds_vs_bytes_bound: {ratio:.3f}")
  variant = "" if a.rate_mbit == 200 else f"_{a.rate_mbit:g}mbit"
  record(f"cluster_reduction{variant}", {
    "seconds_vs_bytes_bound": round(ratio, 3), "seconds": round(r["seconds"], 3),
    "bytes_bound_s": round(r["bound_s"], 3), "sent_ratio": round(r["sent_ratio"], 3),
    "received_ratio": round(r["received_ratio"], 3), "dp": r["dp"], "rate_mbit": a.rate_mbit,
    "gradient_mib": 4 * a.floats / 2**20})


if __name__ == "__main__":
  main()
