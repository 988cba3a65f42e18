"""The data-parallel gradient reduction across real processes: bytes per process and host time.

    python benchmarks/reduction.py                      # dp = 2, 4, 8; prints bytes_ratio_dp8
    python benchmarks/reduction.py --tree=/tmp/old      # the same on another checkout (before)

For each dp, dp processes on this machine (one simulated CPU device each, `jax.distributed` on
127.0.0.1) join one job and reduce one stage's gradient (`--floats` float32, one buffer per
member) `--repeats` times through `ProcessTransport.reduce`, the runtime's own reduction. It
counts the bytes each process offers to and pulls from the others (by wrapping `Cluster.offer`
and `Cluster.pull`, so an older checkout is counted the same way) and prints, per dp, the busiest
process's bytes sent and received per reduction over the gradient's bytes, and the median host
milliseconds per reduction (wall, every process waiting for the slowest). A ring moves
2 (dp - 1) / dp of the gradient each way (1.75 at dp = 8); a gather of every member's buffer
moves dp - 1 (7 at dp = 8). Host time on this 2-core machine is dominated by dp processes
sharing the cores; bytes are the figure that carries to a cluster.

Then (unless `--no_local`) the reduction among the devices of one process (`Transport.reduce`,
8 simulated CPU devices, k = 2, 4, 8 of them members): each device's bytes sent and received
per reduction over the gradient's bytes (`Transport.device_bytes`, the busiest device), spread
(`Transport.spread`: a piece summed on each member, what GPUs and TPUs do) and summed on the
first member (CPU devices' default), and the calling thread's CPU milliseconds per reduction of
each (its dispatch: the devices' copies and sums run on XLA's threads, and on CPU devices a
copy between devices may run in the caller), the two interleaved, medians. Spread, every device
moves 2 (k - 1) / k of the gradient (1.75 at k = 8); on the first, k - 1 each way (7 at k = 8).
It ends with `device_bytes_ratio_k8: X`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.results import record  # noqa: E402

_CHILD = r"""
import json, sys, time
sys.path.insert(0, {tree!r})
import jax
import numpy as np
from resilient_jax.config import DistributedConfig
from resilient_jax.runtime import cluster as cluster_mod
from resilient_jax.runtime.multiprocess import ProcessLayout, ProcessTransport
from resilient_jax.model.sharding import where_key

counts = {{"sent": 0, "received": 0}}
offer, pull = cluster_mod.Cluster.offer, cluster_mod.Cluster.pull
def counted_offer(self, uid, arrays, specs=None):
  counts["sent"] += sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in arrays)
  return offer(self, uid, arrays, specs)
def counted_pull(self, process, uid, specs, device=None):
  counts["received"] += sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in specs)
  return pull(self, process, uid, specs, device)
cluster_mod.Cluster.offer, cluster_mod.Cluster.pull = counted_offer, counted_pull

pid, dp = int(sys.argv[1]), {dp}
cl = cluster_mod.Cluster(DistributedConfig(enabled=True, coordinator=sys.argv[2],
                                           num_processes=dp, process_id=pid, wait_timeout_s=120))
transport = ProcessTransport(cl, ProcessLayout.of(dp, 1, "pipeline", dp, 1))
nodes = list(range(dp))
members = tuple(sorted((transport.device(n) for n in nodes), key=where_key))
mine = transport.device(pid)
grad = {{"w": jax.device_put(np.full(({floats},), pid + 1.0, np.float32), mine)}}
times, sent, received = [], [], []
for step in range(1, {repeats} + 2):
  transport.begin(step, 0, nodes)
  before = dict(counts)
  t0 = time.perf_counter()
  out = transport.reduce(0, nodes, members, {{mine: grad}})
  jax.block_until_ready(out)
  if step > 1:  # the first builds the programs
    times.append(time.perf_counter() - t0)
    sent.append(counts["sent"] - before["sent"])
    received.append(counts["received"] - before["received"])
  assert not transport.doomed, transport.doomed
  value = float(np.asarray(out[mine]["w"])[0])
  assert value == dp * (dp + 1) / 2, value
  cl.kv_set(f"done/{{step}}/{{pid}}", True)
  for q in range(dp):  # every process ends the step before the next one starts
    cl.await_key(f"done/{{step}}/{{q}}", q, "the step")
print(json.dumps(dict(pid=pid, ms=[t * 1e3 for t in times], sent=sent, received=received)),
      flush=True)
cl.finish(0)
"""


_LOCAL = r"""
import json, statistics, sys, time
sys.path.insert(0, {tree!r})
import jax
import numpy as np
from resilient_jax.programs.packing import Packed
from resilient_jax.runtime.transport import Transport
devices = jax.devices()
rows = {{}}
for k in {ks!r}:
  members = devices[:k]
  rng = np.random.default_rng(k)
  local = {{d: jax.device_put(Packed.from_dict({{"g": rng.standard_normal({floats}).astype(
    np.float32)}}), d) for d in members}}
  times = {{True: [], False: []}}
  moved = {{}}
  for rep in range({repeats} + 1):
    for spread in (True, False) if rep % 2 else (False, True):
      t = Transport(dict(enumerate(members)))
      t.spread = spread
      t.begin(1, 0)
      c0 = time.thread_time()
      out = t.reduce(0, list(range(k)), tuple(members), local)
      times[spread].append(time.thread_time() - c0)
      jax.block_until_ready([o.buffers for o in out.values()])
      moved[spread] = t.device_bytes()
  rows[k] = {{str(sp): dict(bytes=moved[sp], ms=1e3 * statistics.median(times[sp][1:]))
             for sp in (True, False)}}
print(json.dumps(rows))
"""


def measure_local(ks: list[int], floats: int, repeats: int, tree: str) -> dict:
  """The reduction among `k` devices of one process, spread and on the first member."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={max(ks)}",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _LOCAL.format(tree=tree, ks=ks, floats=floats,
                                                            repeats=repeats)],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=600)
  if out.returncode != 0:
    raise SystemExit(f"local reduction: exited {out.returncode}: {out.stderr.strip()[-1500:]}")
  return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def collect(procs: list[subprocess.Popen], what: str = "") -> list[dict]:
  """Each child's last line (its JSON row), in order; a child that failed ends the run with
  its error's tail."""
  rows = []
  for p in procs:
    out, err = p.communicate(timeout=600)
    if p.returncode != 0:
      raise SystemExit(f"{what}a process exited {p.returncode}: {err.strip()[-1500:]}")
    rows.append(json.loads(out.strip().splitlines()[-1]))
  return rows


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def measure(dp: int, floats: int, repeats: int, tree: str) -> dict:
  """One job of `dp` processes; the busiest process's bytes and the median time per reduction."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_PLATFORMS="cpu")
  code = _CHILD.format(tree=tree, dp=dp, floats=floats, repeats=repeats)
  address = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, "-c", code, str(p), address], cwd=tree, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for p in range(dp)]
  rows = collect(procs, f"dp={dp}: ")
  grad_bytes = 4 * floats
  return {
    "dp": dp,
    "sent_ratio": max(statistics.median(r["sent"]) for r in rows) / grad_bytes,
    "received_ratio": max(statistics.median(r["received"]) for r in rows) / grad_bytes,
    "ms": statistics.median(statistics.median(r["ms"]) for r in rows),
  }


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dps", default="2,4,8", help="data-parallel sizes (one process each)")
  p.add_argument("--floats", type=int, default=1 << 20, help="gradient size (float32)")
  p.add_argument("--repeats", type=int, default=10, help="timed reductions per dp")
  p.add_argument("--tree", default=ROOT, help="import resilient_jax from this checkout")
  p.add_argument("--local", default="2,4,8", help="members of the reduction in one process")
  p.add_argument("--no_local", action="store_true", help="skip the reduction in one process")
  args = p.parse_args(argv)
  load = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
  print(f"gradient {args.floats} float32 ({4 * args.floats / 2**20:.1f} MiB) per member, "
        f"{args.repeats} reductions per dp, one process per member; tree {args.tree}; "
        f"load {load}")
  print(f"{'dp':>4} {'sent/grad':>10} {'received/grad':>14} {'ms/reduction':>13}"
        "  (busiest process)")
  results = {}
  t0 = time.perf_counter()
  for dp in [int(x) for x in args.dps.split(",")]:
    r = measure(dp, args.floats, args.repeats, args.tree)
    results[dp] = r
    print(f"{dp:>4} {r['sent_ratio']:>10.3f} {r['received_ratio']:>14.3f} {r['ms']:>13.1f}",
          flush=True)
  figures: dict[str, float] = {}
  for dp, r in results.items():
    print(f"bytes_ratio_dp{dp}: {max(r['sent_ratio'], r['received_ratio']):.3f}")
    figures[f"bytes_ratio_dp{dp}"] = round(max(r["sent_ratio"], r["received_ratio"]), 3)
    figures[f"ms_per_reduction_dp{dp}"] = round(r["ms"], 1)
  if not args.no_local:
    ks = [int(x) for x in args.local.split(",")]
    local = measure_local(ks, args.floats, args.repeats, args.tree)
    print(f"in one process, busiest device per reduction: {'k':>3} {'spread sent/grad':>17} "
          f"{'received/grad':>14} {'host ms':>8} {'first sent/grad':>16} {'received/grad':>14} "
          f"{'host ms':>8}")
    for k, r in local.items():
      sp, fi = r["True"], r["False"]
      print(f"{'':>43}{k:>3} {sp['bytes'][0] / (4 * args.floats):>17.3f} "
            f"{sp['bytes'][1] / (4 * args.floats):>14.3f} {sp['ms']:>8.2f} "
            f"{fi['bytes'][0] / (4 * args.floats):>16.3f} "
            f"{fi['bytes'][1] / (4 * args.floats):>14.3f} {fi['ms']:>8.2f}")
    for k, r in local.items():
      print(f"device_bytes_ratio_k{k}: {max(r['True']['bytes']) / (4 * args.floats):.3f}")
      figures[f"device_bytes_ratio_k{k}"] = round(max(r["True"]["bytes"]) / (4 * args.floats), 3)
  print(f"({time.perf_counter() - t0:.0f} s)")
  if os.path.abspath(str(args.tree)) == ROOT:  # another checkout's figures are not this one's
    record("reduction", figures)


if __name__ == "__main__":
  main()
