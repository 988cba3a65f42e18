"""Where the workers of a DP x PP grid sit on a cluster's nodes.

A worker `(d, s)` is `tp` devices (a tensor-parallel group, or one device when `tp == 1`). A
device that fails takes its worker with it; a node that fails takes every worker with a device
on it. Which workers share a node decides what a node failure looks like to the planners:

* `"pipeline"` placement (rank = d * pp + s): a node holds consecutive stages of one pipeline,
  so activations move over NVLink and a node failure removes (part of) one pipeline.
* `"stage"` placement (rank = s * dp + d): a node holds one stage of consecutive pipelines, so
  the gradient all-reduce stays partly inside nodes and a node failure removes several workers
  of the same stage.

The ranks are `resilient_jax.spec.placement`'s, the same the runtime places processes'
workers by.
"""

from __future__ import annotations

import dataclasses

from resilient_jax.checks import require_ints
from resilient_jax.schedule.core import Worker
from resilient_jax.schedule.generators import GENERATORS
from resilient_jax.spec import placement as placement_lib

__all__ = ["PLACEMENTS", "Layout"]

PLACEMENTS = placement_lib.PLACEMENTS


@dataclasses.dataclass(frozen=True)
class Layout:
  """A training job's grid, batch and placement on the cluster.

  Attributes:
    dp: data-parallel pipelines (D).
    pp: pipeline stages (p).
    tp: devices per worker (tensor parallelism inside a worker).
    microbatches: micro-batches per pipeline per step (m).
    micro_batch_size: samples per micro-batch.
    devices_per_node: devices that fail together when their node fails.
    placement: "pipeline" or "stage" (see the module docstring).
    schedule: the fault-free base schedule ("gpipe", "1f1b" or "zb-h1").
    memory_cap: in-flight cap for the adaptive planner; None: its default.
  """

  dp: int
  pp: int
  tp: int = 1
  microbatches: int = 8
  micro_batch_size: int = 1
  devices_per_node: int = 8
  placement: str = placement_lib.DEFAULT_PLACEMENT
  schedule: str = "zb-h1"
  memory_cap: int | None = None

  def __post_init__(self):
    keys = ("dp", "pp", "tp", "microbatches", "micro_batch_size", "devices_per_node")
    require_ints("layout.", {k: getattr(self, k) for k in keys})
    if self.placement not in PLACEMENTS:
      raise ValueError(f"layout.placement={self.placement!r} is not one of {PLACEMENTS}")
    if self.schedule not in GENERATORS:
      raise ValueError(f"layout.schedule={self.schedule!r} is not one of {sorted(GENERATORS)}")
    if self.memory_cap is not None and (
      not isinstance(self.memory_cap, int) or self.memory_cap < 1
    ):
      raise ValueError(f"layout.memory_cap must be a positive integer, got {self.memory_cap!r}")
    if self.tp % self.devices_per_node and self.devices_per_node % self.tp:
      # A worker must be whole nodes or a whole fraction of one, or a node failure would cut
      # a tensor-parallel group in a way no real launcher lays out.
      raise ValueError(
        f"layout.tp={self.tp} and devices_per_node={self.devices_per_node}: one must divide "
        "the other"
      )
    if self.devices % self.devices_per_node:
      raise ValueError(
        f"{self.devices} devices (dp*pp*tp) do not fill whole nodes of {self.devices_per_node}"
      )

  @property
  def workers(self) -> int:
    return self.dp * self.pp

  @property
  def devices(self) -> int:
    return self.workers * self.tp

  @property
  def nodes(self) -> int:
    return self.devices // self.devices_per_node

  @property
  def global_batch(self) -> int:
    """Samples per training step: the same whatever fails."""
    return self.dp * self.microbatches * self.micro_batch_size

  def worker_of_rank(self, rank: int) -> Worker:
    return placement_lib.worker_of_rank(rank, self.dp, self.pp, self.placement)

  def rank_of_worker(self, worker: Worker) -> int:
    return placement_lib.rank_of_worker(worker, self.dp, self.pp, self.placement)

  def worker_of_device(self, device: int) -> Worker:
    """The worker device `device` (0 .. devices - 1) belongs to."""
    return self.worker_of_rank(device // self.tp)

  def node_of_worker(self, worker: Worker) -> int:
    """The node of the worker's first device."""
    return self.rank_of_worker(worker) * self.tp // self.devices_per_node

  def stage_boundary_crosses_nodes(self) -> bool:
    """Whether some activation transfer between consecutive stages leaves its node."""
    if self.pp == 1:
      return False
    if self.placement == "stage":
      return True
    # Pipeline placement: the pattern of node boundaries repeats every lcm(pp*tp, dpn) devices,
    # so the first dpn pipelines show every case.
    for d in range(min(self.dp, self.devices_per_node)):
      for s in range(self.pp - 1):
        if self.node_of_worker((d, s)) != self.node_of_worker((d, s + 1)):
          return True
    return False

  def stage_nodes(self, stage: int) -> tuple[int, ...]:
    """How many of `stage`'s workers each node holding any of them holds, in node order."""
    counts: dict[int, int] = {}
    for d in range(self.dp):
      node = self.node_of_worker((d, stage))
      counts[node] = counts.get(node, 0) + 1
    return tuple(counts[n] for n in sorted(counts))
