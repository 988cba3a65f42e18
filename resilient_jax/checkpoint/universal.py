"""The universal state layout: one entry per parameter, whatever the pipeline layout.

Stage parameters are already flat dicts keyed by global names (`blocks.3.mlp.fc.kernel`), and a
stage's optax state is the same transformation's state restricted to those names. Flattening an
optimizer state with its tree paths gives keys like `0/mu/blocks.3.mlp.fc.kernel` (per
parameter) or `0/count` (shared by all stages): the union over stages is the state of the whole
model, and a stage of any other layout picks its entries by key. So saving is done in the
distributed layout (each stage writes its own entries) and loading onto another layout is a
lookup, with no conversion step in between — DeepSpeed UCP's idea without its offline pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax


def _key(path: tuple) -> str:
  parts = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
    else:
      parts.append(str(entry))
  return "/".join(parts)


def flatten_state(tree: Any) -> dict[str, Any]:
  """`{path key: leaf}` of an optimizer state (or any pytree)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  out = {}
  for path, leaf in leaves:
    key = _key(path)
    if key in out:
      raise ValueError(f"two leaves share the state key {key!r}")
    out[key] = leaf
  return out


def unflatten_state(template: Any, entries: Mapping[str, Any], *, what: str = "state") -> Any:
  """A tree shaped like `template` whose leaves are `entries[path key]`.

  Raises:
    KeyError: an entry the template needs is missing (names it).
  """
  leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
  values = []
  for path, _ in leaves:
    key = _key(path)
    if key not in entries:
      raise KeyError(f"{what} entry {key!r} is missing from the checkpoint")
    values.append(entries[key])
  return jax.tree_util.tree_unflatten(treedef, values)


def merge(stage_entries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
  """Union of per-stage flat entries; entries several stages hold are taken from the first.

  Stages agree on shared entries (step counters, tied parameters) because they apply the same
  updates to the same reduced gradients.
  """
  out: dict[str, Any] = {}
  for entries in stage_entries:
    for k, v in entries.items():
      out.setdefault(k, v)
  return out
