"""The per-layer profile Oobleck plans from, and its errors."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable

import numpy as np

from resilient_jax.schedule.errors import ScheduleError

LayerRange = tuple[int, int]
"""Layers `[lo, hi)` of one stage."""


_PER_LAYER = (
  "forward",
  "backward_input",
  "backward_weight",
  "param_bytes",
  "state_bytes",
  "activation_bytes",
  "optimizer",
)
"""`LayerProfile`'s per-layer fields (the optimizer's last: it defaults to zeros)."""


class InstantiationError(ScheduleError):
  """No combination of the templates uses exactly the given nodes (with enough pipelines)."""


class LayersLostError(ScheduleError):
  """Some layer has no live replica left: only a restart from a checkpoint can recover."""


def _floats(name: str, values: Iterable[float], n: int | None) -> tuple[float, ...]:
  out = tuple(float(v) for v in values)
  if n is not None and len(out) != n:
    raise ValueError(f"LayerProfile.{name} has {len(out)} entries, expected {n}")
  for v in out:
    if not math.isfinite(v) or v < 0:
      raise ValueError(f"LayerProfile.{name}: {v!r} is not a finite non-negative number")
  return out


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """Per-layer costs of one micro-batch, the input of template planning.

  Attributes:
    forward: forward time of each layer.
    backward_input: input-gradient (B) time of each layer.
    backward_weight: weight-gradient (W) time of each layer; B + W is the fused backward.
    param_bytes: bytes of each layer's gradients, the volume of its data-parallel all-reduce.
    state_bytes: bytes resident on a node that owns the layer (parameters, gradients, optimizer
      state): what must be copied when the layer moves to another node.
    activation_bytes: bytes a layer stashes per micro-batch between its forward and backward.
    optimizer: optimizer-step time of each layer; None means zero.
    stage_overhead: fixed time added to every F and every B of a stage (launch, send/receive),
      which makes more stages cost more.
    stage_bytes: fixed memory of every node (runtime, workspace, communication buffers).
  """

  forward: tuple[float, ...]
  backward_input: tuple[float, ...]
  backward_weight: tuple[float, ...]
  param_bytes: tuple[float, ...]
  state_bytes: tuple[float, ...]
  activation_bytes: tuple[float, ...]
  optimizer: tuple[float, ...] | None = None
  stage_overhead: float = 0.0
  stage_bytes: float = 0.0

  def __post_init__(self):
    n = len(tuple(self.forward))
    if n < 1:
      raise ValueError("LayerProfile needs at least one layer")
    for name in _PER_LAYER[:-1]:
      object.__setattr__(self, name, _floats(name, getattr(self, name), n))
    opt = (0.0,) * n if self.optimizer is None else self.optimizer
    object.__setattr__(self, "optimizer", _floats("optimizer", opt, n))
    for name in ("stage_overhead", "stage_bytes"):
      object.__setattr__(self, name, _floats(name, (getattr(self, name),), 1)[0])

  @property
  def num_layers(self) -> int:
    return len(self.forward)

  @classmethod
  def uniform(
    cls,
    num_layers: int,
    *,
    forward: float = 1.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
    param_bytes: float = 1.0,
    state_bytes: float = 8.0,
    activation_bytes: float = 1.0,
    stage_overhead: float = 0.0,
    stage_bytes: float = 0.0,
  ) -> LayerProfile:
    """`num_layers` identical layers."""
    n = num_layers
    return cls(
      forward=(forward,) * n,
      backward_input=(backward_input,) * n,
      backward_weight=(backward_weight,) * n,
      param_bytes=(param_bytes,) * n,
      state_bytes=(state_bytes,) * n,
      activation_bytes=(activation_bytes,) * n,
      stage_overhead=stage_overhead,
      stage_bytes=stage_bytes,
    )

  @functools.cached_property
  def _prefix(self) -> dict[str, np.ndarray]:
    # Prefix sums make every stage quantity an O(1) difference, the DP's inner loop.
    return {n: np.concatenate([[0.0], np.cumsum(getattr(self, n))]) for n in _PER_LAYER}

  def range_sum(self, name: str, lo: int, hi: int) -> float:
    """Sum of the per-layer field `name` over layers `[lo, hi)`."""
    p = self._prefix[name]
    return float(p[hi] - p[lo])

  def stage_time(self, lo: int, hi: int) -> float:
    """F + B + W of one micro-batch on a stage holding layers `[lo, hi)`, overheads included."""
    return (
      self.range_sum("forward", lo, hi)
      + self.range_sum("backward_input", lo, hi)
      + self.range_sum("backward_weight", lo, hi)
      + 2 * self.stage_overhead
    )

  def stage_memory(self, lo: int, hi: int, inflight: int) -> float:
    """Peak bytes of a node holding layers `[lo, hi)` with `inflight` micro-batches stashed."""
    return (
      self.stage_bytes
      + self.range_sum("state_bytes", lo, hi)
      + inflight * self.range_sum("activation_bytes", lo, hi)
    )
