"""Sets of independent pipelines of different shapes: what the Oobleck and Bamboo policies run.

A `Schedule` is one DP x PP grid with the same stages in every pipeline. Oobleck and Bamboo run
something else: several pipelines that never exchange activations, each with its own split of
the layers into stages, its own nodes and its own share of the global batch. They meet only in
the gradient all-reduce, which sums every parameter over all the stages that hold it, keyed by
parameter name because the pipelines cut the model in different places.

A `PipelineSet` is that, as plain data (no JAX): per pipeline a `dp = 1` `Schedule` over its own
stages with local micro-batch ids, the layer range `[lo, hi)` and the node of every stage, and
the global ids of its micro-batches. Every micro-batch of the global batch belongs to exactly one
pipeline, so a step still trains on every sample once.

Two things only Bamboo uses:
* a node may run two consecutive stages of its pipeline (the predecessor that took over a failed
  stage; the stages form a ring, so the last stage takes over stage 0);
* a stage whose op list holds `FR` ops keeps a replica of its successor stage `(s + 1) % K` and
  runs that stage's forward of the micro-batch redundantly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from resilient_jax.schedule.core import FR, Schedule, Worker
from resilient_jax.schedule.errors import ScheduleError
from resilient_jax.schedule.generators import generate

LayerRange = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """One pipeline of a `PipelineSet`.

  Attributes:
    stages: the layers `[lo, hi)` of every stage, in order, covering the model (a stage may
      hold none: `pipeline.partition` allows a 0).
    nodes: the node running every stage (two consecutive stages may share one).
    microbatches: the global id of every local micro-batch (local id i is `microbatches[i]`).
    schedule: the op lists, `dp = 1`, `pp = len(stages)`, local micro-batch ids.
  """

  stages: tuple[LayerRange, ...]
  nodes: tuple[int, ...]
  microbatches: tuple[int, ...]
  schedule: Schedule

  def __post_init__(self):
    k, s = len(self.stages), self.schedule
    if len(self.nodes) != k or s.dp != 1 or s.pp != k or s.microbatches != len(self.microbatches):
      raise ScheduleError(
        f"pipeline with {k} stages, {len(self.nodes)} nodes and {len(self.microbatches)} "
        f"micro-batches does not match its schedule (dp={s.dp}, pp={s.pp}, m={s.microbatches})"
      )
    for a, b in zip(self.stages, self.stages[1:], strict=False):
      if a[1] != b[0] or a[0] > a[1]:
        raise ScheduleError(f"pipeline stages {list(self.stages)} are not contiguous")

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def replica_of(self, stage: int) -> int | None:
    """The stage whose replica `stage` keeps (it runs FR ops), or None."""
    if any(op.kind == FR for op in self.schedule.ops[(0, stage)]):
      return (stage + 1) % self.num_stages
    return None


@dataclasses.dataclass(frozen=True)
class PipelineSet:
  """Independent pipelines that together train on the whole global batch.

  Attributes:
    name: the policy that made it (`oobleck`, `bamboo`, ...).
    pipelines: the pipelines.
    num_layers: layers of the model (every pipeline covers `[0, num_layers)`).
  """

  name: str
  pipelines: tuple[Pipeline, ...]
  num_layers: int

  def __post_init__(self):
    mbs = sorted(mb for p in self.pipelines for mb in p.microbatches)
    if mbs != list(range(len(mbs))):
      raise ScheduleError(f"{self.name}: micro-batches {mbs} are not 0..n-1 each exactly once")
    for i, p in enumerate(self.pipelines):
      if p.stages[0][0] != 0 or p.stages[-1][1] != self.num_layers:
        raise ScheduleError(f"{self.name}: pipeline {i} does not cover layers 0..{self.num_layers}")
    owner: dict[int, int] = {}
    for i, p in enumerate(self.pipelines):
      for n in p.nodes:
        if owner.setdefault(n, i) != i:
          raise ScheduleError(f"{self.name}: node {n} runs stages of two pipelines")

  @property
  def nodes(self) -> list[int]:
    return sorted({n for p in self.pipelines for n in p.nodes})

  @property
  def num_microbatches(self) -> int:
    return sum(len(p.microbatches) for p in self.pipelines)

  @property
  def slots(self) -> list[Worker]:
    """Every `(pipeline, stage)`."""
    return [(i, s) for i, p in enumerate(self.pipelines) for s in range(p.num_stages)]

  def with_partition(self, partition: Sequence[LayerRange]) -> PipelineSet:
    """The same pipelines, every one cut into `partition`'s layers (a plan made on stage
    indices, given the model's layers to run)."""
    stages = tuple(partition)
    pipes = tuple(dataclasses.replace(p, stages=stages) for p in self.pipelines)
    return dataclasses.replace(self, pipelines=pipes, num_layers=stages[-1][1])

  def on_nodes(self, nodes: Sequence[int]) -> PipelineSet:
    """The same pipelines with each grid position `n` replaced by `nodes[n]`."""
    pipes = tuple(dataclasses.replace(p, nodes=tuple(nodes[n] for n in p.nodes))
                  for p in self.pipelines)
    return dataclasses.replace(self, pipelines=pipes)

  def to_text(self) -> str:
    lines = [
      f"pipeline set {self.name}: {len(self.pipelines)} pipelines on {len(self.nodes)} nodes, "
      f"{self.num_microbatches} micro-batches"
    ]
    for i, p in enumerate(self.pipelines):
      mbs = p.microbatches
      lines.append(
        f" pipeline {i}: micro-batches {mbs[0]}..{mbs[-1]} (m={len(mbs)}), "
        f"{p.num_stages} stages"
      )
      for s, ((lo, hi), n) in enumerate(zip(p.stages, p.nodes, strict=True)):
        rep = p.replica_of(s)
        extra = f", replica of stage {rep}" if rep is not None else ""
        ops = " ".join(str(op) for op in p.schedule.ops[(0, s)])
        lines.append(f"  s{s} layers {lo}..{hi - 1} on node {n}{extra} | {ops}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.to_text()


def oobleck_set(instance, num_layers: int, base: str = "1f1b") -> PipelineSet:
  """The pipelines of an `oobleck.OobleckInstance`, each running `base` on its micro-batches."""
  pipes = []
  for p in instance.pipelines:
    mbs = tuple(range(p.first_microbatch, p.first_microbatch + p.microbatches))
    sched = generate(base, 1, p.template.num_stages, p.microbatches)
    pipes.append(Pipeline(tuple(p.template.stages), tuple(p.nodes), mbs, sched))
  return PipelineSet("oobleck", tuple(pipes), num_layers)
