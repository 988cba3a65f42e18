"""A stage's state on one device as a few flat buffers: parameters, gradients, optimizer state.

`StateLayout` says where each of a stage's parameters lies (`packing.Layout.of_state`: a buffer
per block of the model, dtype and optimizer class) and how its optimizer state is held:

  - flat (`programs.flat_optimizer` finds the optimizer's traced update elementwise on each
    class): per buffer, one buffer of the same length per state role (`0/mu/`, `0/nu/`), and
    the shared entries (step counts) as they are: `{"shared": {key: value}, "buffers":
    [{role: buffer}]}`;
  - per tensor (Adafactor's factored moments, LAMB's per-tensor norms, anything reading across
    parameters): the optimizer's own tree, stepped on the buffers' views inside OPT.

Gradients accumulate in the parameters' layout, so OPT, the norm's sum of squares, the NaN
check, the replica digest and the reduction read the buffers as they are. The programs see the
parameters by name through views (a slice of a buffer, inside the trace). Checkpoints and state
hand-overs see names and universal keys (`checkpoint.universal`): `opt_entries` reads a flat
state's entries lazily, `StagePrograms.state_from` packs any holder's entries into this layout
(or takes a holder of the same layout's buffers whole).

Growth: a program passes O(blocks x dtypes x classes) arrays for the state, not O(parameters);
OPT is a fused loop per buffer, identical for identical blocks (compiled once); the bytes are the
tree's own. On one device only: a sub-mesh (`mesh.tp > 1`) keeps every array apart, split as its
parameter is.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from resilient_jax.checkpoint import universal
from resilient_jax.programs import packing
from resilient_jax.programs.compiled import OnEachDevice
from resilient_jax.programs.flat_optimizer import FlatOptimizer


class StateLayout:
  """How a stage's state lies in buffers (see the module's docstring).

  Args:
    abstract: the stage's parameters' shapes and dtypes, by name.
    optimizer: the stage's optax transformation.
    block_of: the model's block each parameter belongs to (-1: outside the blocks).
    opt_template: `optimizer.init`'s state for `abstract` (shapes and dtypes).
  """

  def __init__(self, abstract: Mapping[str, jax.ShapeDtypeStruct],
               optimizer: optax.GradientTransformation, block_of: Mapping[str, int],
               opt_template: Any):
    self.opt_template = opt_template
    self.opt_keys: tuple[str, ...] = tuple(universal.flatten_state(opt_template))
    self.flat: FlatOptimizer | None = FlatOptimizer.of(optimizer, abstract, opt_template)
    classes = self.flat.classes if self.flat is not None else dict.fromkeys(abstract, 0)
    self.layout = packing.Layout.of_state(abstract, classes, block_of)
    self.buffers = len(self.layout.groups)
    self.regions: list[tuple[int, int, int, int]] = [
      (b, c, lo, hi) for b in range(self.buffers) for c, lo, hi in self.layout.regions[b]]
    """Every buffer's runs of one optimizer class, (buffer, class, start, stop): a flat state
    holds a buffer per region and role."""
    at = {n: self.layout.where[self.layout.index(n)] for n in abstract}
    self._region_of = {n: next(r for r, (b, _, lo, hi) in enumerate(self.regions)
                               if b == at[n][0] and lo <= at[n][1] < hi) for n in abstract}

  def names(self, b: int) -> tuple[str, ...]:
    return self.layout.buffer_names(b)

  def pack_host(self, values: Mapping[str, Any]) -> packing.Packed:
    """`values` (by name, host arrays) as this layout's buffers, packed on the host."""
    host = {n: np.asarray(v) for n, v in values.items()}
    return packing.Packed(self.layout, [np.concatenate([host[n].reshape(-1) for n in
                                                        self.names(b)])
                                        for b in range(self.buffers)])

  def opt_from_entries(self, entries: Mapping[str, Any]) -> Any:
    """The optimizer state as the stage holds it, from its universal entries (traceable)."""
    flat = self.flat
    if flat is None:
      return universal.unflatten_state(self.opt_template, entries, what="optimizer state")
    return {"shared": {k: entries[k] for k in flat.shared},
            "buffers": [{role: jnp.concatenate([jnp.ravel(entries[role + n])
                                                for n in self.region_names(r)])
                         for role in flat.roles[c]}
                        for r, (_, c, _, _) in enumerate(self.regions)]}

  def region_names(self, r: int) -> list[str]:
    """The names of region `r`'s arrays, in their order there."""
    b, _, lo, hi = self.regions[r]
    return [n for n in self.names(b) if lo <= self.layout.where[self.layout.index(n)][1] < hi]

  def opt_entries(self, opt_state: Any) -> Mapping[str, Any]:
    """`opt_state`'s entries by universal key; a flat state's are read when asked for."""
    if self.flat is None:
      return universal.flatten_state(opt_state)
    return FlatEntries(self, opt_state)

  def step(self, optimizer: optax.GradientTransformation, params: packing.Packed,
           opt_state: Any, grads: packing.Packed, owned: jax.Array,
           scale: jax.Array | None = None) -> tuple[packing.Packed, Any, jax.Array]:
    """OPT on the buffers (traceable): the gradients times `scale` (the global clip factor)
    when given, the optimizer's step (flat, or per tensor on the views), and the sum of squares
    of the buffers `owned` weighs 1 (this slot's share of the global norm)."""
    layout = self.layout
    sumsq = sum(owned[b] * jnp.sum(jnp.square(g.astype(jnp.float32)))
                for b, g in enumerate(grads.buffers))
    buffers = grads.buffers if scale is None else \
      [g * scale.astype(g.dtype) for g in grads.buffers]
    if self.flat is not None:  # each buffer's class regions, stepped and put back together
      part = lambda x, lo, hi: x if (lo, hi) == (0, x.shape[0]) else \
        jax.lax.slice(x, (lo,), (hi,))  # noqa: E731
      stepped, opt_state = self.flat.update(
        [part(buffers[b], lo, hi) for b, _, lo, hi in self.regions],
        [part(params.buffers[b], lo, hi) for b, _, lo, hi in self.regions],
        [c for _, c, _, _ in self.regions], opt_state)
      whole = [[x for (b, _, _, _), x in zip(self.regions, stepped, strict=True) if b == g]
               for g in range(self.buffers)]
      return packing.Packed(layout, [x[0] if len(x) == 1 else jnp.concatenate(x)
                                     for x in whole]), opt_state, sumsq
    tree = params.unpacked()
    updates, opt_state = optimizer.update(packing.Packed(layout, buffers).unpacked(), opt_state,
                                          tree)
    stepped = optax.apply_updates(tree, updates)
    return packing.Packed(layout, layout.pack([stepped[n] for n in layout.names])), opt_state, \
      sumsq

  def norm_weights(self, owned: Iterable[str]) -> np.ndarray:
    """OPT's `owned`: a weight per buffer, 1 where this slot counts every array of it into the
    global norm (a grid's first holder of a stage: all of them)."""
    names = set(owned)
    return np.array([all(n in names for n in self.names(b)) for b in range(self.buffers)],
                    np.float32)

  def owned_apart(self, owned: Iterable[str]) -> tuple[str, ...]:
    """The names of `owned` in buffers this slot owns only in part (`norm_weights` weighs such
    a buffer 0): their share of the norm is summed apart (`sumsq_of`). None in a grid; a tied
    parameter that another stage counts can make one."""
    names = set(owned)
    return tuple(n for b in range(self.buffers) for n in self.names(b)
                 if n in names and not all(m in names for m in self.names(b)))


class FlatEntries(Mapping):
  """A flat optimizer state's entries by universal key (`StateLayout.opt_entries`), each read
  out of its buffer when asked for (`packing.Packed`: one program per shape)."""

  def __init__(self, state_layout: StateLayout, state: Any):
    self.layout = state_layout.layout
    self.state = state
    self._of = state_layout
    self._keys = state_layout.opt_keys
    self._key_set = frozenset(state_layout.opt_keys)
    self._shared = frozenset(state_layout.flat.shared)

  def __getitem__(self, key: str) -> Any:
    if key in self._shared:
      return self.state["shared"][key]
    name = key.rsplit("/", 1)[-1]
    if name not in self.layout._positions():
      raise KeyError(key)
    r = self._of._region_of[name]
    _, at, size = self.layout.where[self.layout.index(name)]
    buf = self.state["buffers"][r][key[:len(key) - len(name)]]
    return packing.read(buf, at - self._of.regions[r][2], size,
                        self.layout.shapes[self.layout.index(name)])

  def __iter__(self) -> Iterator[str]:
    return iter(self._keys)

  def __len__(self) -> int:
    return len(self._keys)

  def __contains__(self, key: object) -> bool:  # by key: `Mapping`'s would read the entry
    return key in self._key_set


@functools.cache
def sumsq_of(names: tuple[str, ...]) -> OnEachDevice:
  """One program: the sum of squares of `names`' gradients (of packed gradients)."""
  return OnEachDevice(lambda g: sum(jnp.sum(jnp.square(g[n].astype(jnp.float32)))
                                    for n in names))


def params_of(a: Any, b: Any) -> Any:
  """The parameters B's and W's residuals read, once (packed: the stage's buffers)."""
  if isinstance(a, packing.Packed):
    return a
  if isinstance(b, packing.Packed):
    return b
  return {**a, **b}
