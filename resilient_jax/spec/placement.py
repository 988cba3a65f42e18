"""Where the workers of a DP x PP grid sit on hosts: one function for the runtime and the simulator.

A host (a process in a `jax.distributed` job, a node of the simulator's cluster) drives several
devices, and a worker `(d, s)` is `tp` of them. Workers are ranked in one of two orders and the
ranks are cut into consecutive runs of `workers_per_host`:

* `"pipeline"` (pipeline-per-host, rank = d * pp + s): a host holds consecutive stages of one
  pipeline (all of them once `pp` divides its worker count). Activations stay inside the host;
  a host failure removes part of *one* pipeline: at most one worker of each stage per pipeline
  it holds, spread over the stages.
* `"stage"` (stage-per-host, rank = s * dp + d): a host holds one stage of consecutive
  pipelines. The gradient all-reduce stays partly inside the host; a host failure removes
  several workers of the *same* stage, whose survivors must then absorb all of their
  micro-batches (and once a host holds `dp` workers, the whole stage is gone).

Re-routing (ReCycle) is limited by the most damaged stage, so losses spread over stages cost
less than losses concentrated in one: `"pipeline"` is the default (`DEFAULT_PLACEMENT`); the
docs/clusters.md gives the simulator's numbers (`configs/sim/hosts.py`).

Pure Python, no JAX: the simulator places 16k devices with it, the runtime derives the same map
in every process (`runtime.multiprocess.ProcessLayout`).
"""

from __future__ import annotations

Worker = tuple[int, int]

PLACEMENTS = ("pipeline", "stage")
DEFAULT_PLACEMENT = "pipeline"


def check_placement(placement: str, what: str = "mesh.placement") -> None:
  """Raises ValueError naming `what` unless `placement` is one of `PLACEMENTS`."""
  if placement not in PLACEMENTS:
    raise ValueError(f"{what}={placement!r} is not one of {', '.join(PLACEMENTS)}")


def rank_of_worker(worker: Worker, dp: int, pp: int, placement: str) -> int:
  """The worker's position in the order hosts are filled in."""
  d, s = worker
  return d * pp + s if placement == "pipeline" else s * dp + d


def worker_of_rank(rank: int, dp: int, pp: int, placement: str) -> Worker:
  """The inverse of `rank_of_worker`."""
  if placement == "pipeline":
    return divmod(rank, pp)
  s, d = divmod(rank, dp)
  return (d, s)


def host_slots(dp: int, pp: int, hosts: int, placement: str) -> dict[Worker, tuple[int, int]]:
  """Every worker's (host, index among the host's workers) when `hosts` hosts share the grid.

  Raises:
    ValueError: the workers do not divide evenly over the hosts.
  """
  check_placement(placement)
  workers = dp * pp
  if hosts < 1 or workers % hosts:
    raise ValueError(f"mesh.dp * mesh.pp = {workers} workers do not divide evenly over {hosts} "
                     "hosts (processes)")
  per = workers // hosts
  return {worker_of_rank(r, dp, pp, placement): divmod(r, per) for r in range(workers)}


def host_workers(dp: int, pp: int, hosts: int, placement: str) -> list[list[Worker]]:
  """The workers of each host, in their local order (`host_slots` grouped)."""
  out: list[list[Worker]] = [[] for _ in range(hosts)]
  for w, (h, _) in sorted(host_slots(dp, pp, hosts, placement).items(), key=lambda x: x[1]):
    out[h].append(w)
  return out


def process_slots(dp: int, pp: int, placement: str, num_processes: int, local_devices: int,
                  devices_per_worker: int = 1) -> dict[int, tuple[int, int]]:
  """Every node's (process, index among the process's workers) in a multi-process job.

  Node `d * pp + s` is worker `(d, s)` (the coordinator's numbering); a worker is
  `devices_per_worker` (`mesh.tp`) consecutive devices of its process, so its index `i` holds
  local devices `i * devices_per_worker ...`. The rule the launchers and `launch/CLUSTERS.md`
  state: a process drives all its host's devices, so
  `dp * pp * devices_per_worker == num_processes * local_devices`.

  Raises:
    ValueError: the grid does not fill the job's devices exactly.
  """
  workers = dp * pp
  have = num_processes * local_devices
  if workers * devices_per_worker != have or workers % num_processes:
    tp = devices_per_worker
    grid = (f"mesh.dp * mesh.pp = {dp} * {pp} = {workers} workers (one device each)" if tp == 1
            else f"mesh.dp * mesh.pp * mesh.tp = {dp} * {pp} * {tp} = {workers * tp} devices "
            f"({workers} workers of {tp})")
    raise ValueError(
      f"{grid} must fill the job's {num_processes} processes x {local_devices} devices = {have} "
      "exactly, each process an equal share of the workers: one process drives all its "
      "host's devices (launch/CLUSTERS.md)")
  grid = host_slots(dp, pp, num_processes, placement)
  return {d * pp + s: where for (d, s), where in grid.items()}
