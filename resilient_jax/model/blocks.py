"""Where a model keeps its repeated blocks, and the mark a traced loss carries where each
begins (`model.cut` cuts there).

A block list is an `nnx.List` (or list) of modules: `model.layers` names it, else `blocks`,
else the longest such list in the model. While the loss is traced each block is called through
`_Marked`, which first binds `pipeline_boundary(index=i)`: an equation that computes nothing and
records, in program order, where block `i` begins (and after the last block, where they end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import nnx
from jax.extend import core as jcore

from resilient_jax.model.staging import run_block


class CutError(ValueError):
  """The loss cannot be traced or cut into stages (the message says why and what to change)."""


# ---------------------------------------------------------------- the boundary mark

boundary_p = jcore.Primitive("pipeline_boundary")
boundary_p.multiple_results = True
boundary_p.def_abstract_eval(lambda *, index: [])
boundary_p.def_impl(lambda *, index: [])


class _Marked:
  """Block `index` of the model as its forward sees it: every attribute the block's own, and a
  call that marks where the block begins, then runs it (rematerialised as `model.remat`); the
  last block also marks where the blocks end (boundary `index + 1`: a stage of no blocks after
  them holds what follows)."""

  def __init__(self, block: Any, index: int, remat: str, last: bool, mark: bool = True):
    object.__setattr__(self, "_block", block)
    object.__setattr__(self, "_index", index)
    object.__setattr__(self, "_remat", remat)
    object.__setattr__(self, "_last", last)
    object.__setattr__(self, "_mark", mark)  # False: only rematerialised (the reference)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._block, name)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if self._mark:
      boundary_p.bind(index=self._index)
    out = run_block(self._block, *args, remat=self._remat, **kwargs)
    if self._mark and self._last:
      boundary_p.bind(index=self._index + 1)
    return out


def _is_block_list(value: Any) -> bool:
  return isinstance(value, (nnx.List, list, tuple)) and len(value) > 0 and all(
    isinstance(b, nnx.Module) for b in value)


def _get(model: Any, path: Sequence[Any]) -> Any:
  node = model
  for p in path:
    node = node[p] if isinstance(p, int) else getattr(node, p)
  return node


def layers_path(model: Any, named: str = "") -> tuple[Any, ...]:
  """Where the model keeps its repeated blocks: `named` (dotted, `transformer.blocks`), else
  `blocks`, else the longest list of modules in the model (the only one that long).

  Raises:
    CutError: nothing found, or two lists equally long (then `model.layers` must name one).
  """
  if named:
    path = tuple(int(p) if p.isdigit() else p for p in named.split("."))
    try:
      node = _get(model, path)
    except (AttributeError, IndexError, KeyError, TypeError):
      node = None
    if not _is_block_list(node):
      raise CutError(f"model.layers={named!r} is not a list of modules in the model")
    return path
  if _is_block_list(getattr(model, "blocks", None)):
    return ("blocks",)
  found = [(len(n), p) for p, n in nnx.iter_graph(model) if _is_block_list(n) and p]
  if not found:
    stacked = _stacked_hint(model)
    raise CutError("it has no list of blocks (an nnx.List of modules, e.g. `self.layers = "
                   "nnx.List([Block(...) for _ in range(n)])`) to cut into pipeline stages"
                   + stacked)
  longest = max(n for n, _ in found)
  paths = sorted(".".join(map(str, p)) for n, p in found if n == longest)
  if len(paths) > 1:
    raise CutError(f"it has {len(paths)} lists of {longest} modules ({', '.join(paths)}): "
                   f"say which are the blocks with model.layers=\"{paths[0]}\"")
  return next(p for n, p in found if n == longest)


def _stacked_hint(model: Any) -> str:
  """What to change when the blocks are one module with stacked parameters (`nnx.scan`,
  `nnx.vmap` over a layer axis): a stage runs a list of blocks, not a slice of one module. A
  stack: a module of two or more parameters, all with one leading axis of the same size (the
  largest such module)."""
  best = None
  for path, node in nnx.iter_graph(model):
    if not (isinstance(node, nnx.Module) and path):
      continue
    shapes = [v[...].shape for _, v in nnx.iter_graph(node) if isinstance(v, nnx.Param)]
    leading = {s[0] for s in shapes if len(s) >= 2}
    if len(shapes) >= 2 and len(leading) == 1 and all(len(s) >= 2 for s in shapes) and (
        best is None or len(shapes) > best[0]):
      best = (len(shapes), ".".join(map(str, path)), next(iter(leading)))
  if best is None or best[2] < 2:
    return ""
  _, name, n = best
  return (f"; {name} looks like a stack of {n} layers with stacked parameters (an "
          "`nnx.scan`/`nnx.vmap` over a layer axis): build the layers as a list of modules "
          "(`nnx.List`) and loop over them in `__call__`, so that a stage can hold a part of "
          "them")


def blocks_at(model: Any, path: Sequence[Any]) -> list[Any]:
  """The blocks at `path` (`layers_path`)."""
  return list(_get(model, path))


def swap_blocks(model: Any, path: Sequence[Any], value: Any) -> None:
  """Replaces the block list at `path` of a module the caller owns (a fresh `nnx.merge`)."""
  parent = _get(model, path[:-1])
  if isinstance(path[-1], int):
    parent[path[-1]] = value
  else:
    object.__setattr__(parent, path[-1], value)


