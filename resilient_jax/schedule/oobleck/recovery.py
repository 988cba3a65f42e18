"""Re-instantiation after failures, and what it costs to move the layers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from resilient_jax.schedule.oobleck.instances import (
  OobleckInstance,
  _assign,
  _build,
  _choose,
  _max_pipelines,
  _templates_list,
)
from resilient_jax.schedule.oobleck.profile import InstantiationError, LayersLostError
from resilient_jax.schedule.oobleck.templates import PipelineTemplate, TemplateSet


@dataclasses.dataclass(frozen=True)
class RecoveryCost:
  """State to copy when re-instantiating.

  Attributes:
    total_bytes: bytes copied over all nodes.
    per_node: bytes each node receives (nodes receiving nothing are left out).
    moves: `(node, lo, hi)`: node receives layers `[lo, hi)` (one contiguous run per entry).
  """

  total_bytes: float
  per_node: dict[int, float]
  moves: tuple[tuple[int, int, int], ...]


def oobleck_recovery_cost(old: OobleckInstance, new: OobleckInstance) -> RecoveryCost:
  """The parameters and optimizer state to copy to go from `old` to `new`.

  A node of `new` needs every layer of its new stage it did not hold in `old` (all of them if it
  was not in `old`); the bytes are the profile's `state_bytes`.

  Args:
    old: the instance before the failures.
    new: the re-instantiated one, on surviving nodes.

  Returns:
    The copy volume.

  Raises:
    LayersLostError: when a needed layer has no holder among `new`'s nodes in `old`.
  """
  prefix = old.profile._prefix["state_bytes"]
  before = old.layers_of()
  live = set(new.nodes)
  holders = [False] * old.profile.num_layers
  for node, (lo, hi) in before.items():
    if node in live:
      for layer in range(lo, hi):
        holders[layer] = True
  per_node: dict[int, float] = {}
  moves = []
  for node, (lo, hi) in sorted(new.layers_of().items()):
    olo, ohi = before.get(node, (0, 0))
    # The new range minus the old one is at most two runs: below and above the kept overlap.
    runs = [(lo, hi)] if ohi <= lo or olo >= hi or olo >= ohi else [(lo, olo), (ohi, hi)]
    for a, b in runs:
      if a >= b:
        continue
      missing = [layer for layer in range(a, b) if not holders[layer]]
      if missing:
        raise LayersLostError(f"layers {missing} have no surviving replica")
      per_node[node] = per_node.get(node, 0.0) + float(prefix[b] - prefix[a])
      moves.append((node, a, b))
  return RecoveryCost(sum(per_node.values()), per_node, tuple(moves))


def reinstantiate(
  instance: OobleckInstance,
  failed: Iterable[int],
  templates: TemplateSet,
  *,
  tolerate: int | None = None,
) -> OobleckInstance:
  """Re-plans after `failed` nodes died, on all survivors, with the same global batch.

  Two candidates are built and the faster (then the cheaper to reach) is returned:

  * local repair, as Oobleck does first: pipelines that lost no node are kept as they are; the
    survivors of the damaged ones are pooled and re-cut into the best templates for their count;
  * a global re-plan: `instantiate`'s best combination for the survivors.

  Survivors are then placed on stages by a maximum-retention assignment, and the batch is dealt
  again in proportion to speed. It keeps `tolerate + 1` pipelines when the survivors allow it,
  else as many as they allow (the new instance's `tolerate` says which).

  Args:
    instance: the running instance.
    failed: failed node ids.
    templates: the template set it was built from.
    tolerate: failures the new instance should survive; default the old instance's.

  Returns:
    The new instance (the old one if nothing failed).

  Raises:
    LayersLostError: when some layer lost every replica.
    InstantiationError: when the survivors cannot be covered by templates at all.
    ValueError: for unknown node ids.
  """
  dead = set(failed)
  unknown = dead - set(instance.nodes)
  if unknown:
    raise ValueError(f"failed nodes {sorted(unknown)} are not in the instance")
  if not dead:
    return instance
  survivors = [n for n in instance.nodes if n not in dead]
  covered = [False] * instance.profile.num_layers
  for node, (lo, hi) in instance.layers_of().items():
    if node not in dead:
      covered[lo:hi] = [True] * (hi - lo)
  if not all(covered):
    lost = [i for i, c in enumerate(covered) if not c]
    raise LayersLostError(f"layers {lost} lost every replica: restart from a checkpoint")
  total_mb = instance.global_microbatches
  sizes = templates.sizes
  most = _max_pipelines(sizes, len(survivors))
  if most[len(survivors)] < 1:
    raise InstantiationError(
      f"{len(survivors)} surviving nodes cannot be covered by pipelines of sizes {sizes}"
    )
  want = (instance.tolerate if tolerate is None else tolerate) + 1
  want = max(1, min(want, int(most[len(survivors)]), total_mb))
  tlist = _templates_list(templates)

  candidates: list[list[PipelineTemplate]] = []
  glob = _choose(tlist, len(survivors), want, total_mb)
  if glob is not None:
    candidates.append(glob)
  kept = [p.template for p in instance.pipelines if not dead.intersection(p.nodes)]
  pooled = sum(p.template.num_nodes for p in instance.pipelines if dead.intersection(p.nodes))
  pooled -= len(dead)
  if pooled == 0:
    if len(kept) >= want:
      candidates.append(kept)
  else:
    need = max(1, want - len(kept))
    local = _choose(tlist, pooled, need, max(need, total_mb - len(kept)))
    if local is not None:
      candidates.append(sorted(kept + local, key=lambda t: (-t.num_nodes, t.stages)))
  if not candidates:
    raise InstantiationError(f"no combination of sizes {sizes} covers {len(survivors)} nodes")

  built = [
    _build(chosen, _assign(chosen, survivors, instance), want - 1, total_mb, instance.profile)
    for chosen in candidates
  ]
  # The faster, then the cheaper to reach; the first of equals.
  return min(
    built, key=lambda new: (new.step_time, oobleck_recovery_cost(instance, new).total_bytes)
  )
