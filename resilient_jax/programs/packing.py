"""Many arrays as a few flat buffers, so a program call passes a few arrays, not hundreds.

JAX's call of a compiled program costs about a microsecond of host time per argument and per
result array (measured here: 243 us for 200 arrays against 5 us for one buffer of the same
bytes). A stage's forward hands its backward every residual as an array of its own (161 for the
tiny GPT's whole model, 4 layers), and its gradient accumulator is one array per parameter; with
eight workers in one process the host then spends most of an op's time passing arrays. Packed,
the small ones share a buffer per dtype and each large one is a buffer of its own
(`PACK_MAX_BYTES`, `Layout`): the programs unpack them inside the trace (a slice and a reshape:
a copy, or nothing for a buffer of its own) and pack their results (a concatenation).

`Packed` is a read-only mapping of names to arrays and a pytree whose leaves are its buffers:
`jax.tree.map` over it maps the buffers (zeros, NaN injection, a scale), a program takes and
returns it, and `packed[name]` slices one array out (inside a trace as outside; outside, each is
an op of its own: for tests, tied-weight reductions and other rare readers, not per-op paths).

Growth: a program's host cost falls from O(arrays) to O(dtypes x chunks + large arrays) per
call; packing adds no program (it happens inside the stage programs) and no bytes kept beyond
the arrays' own (buffers are the concatenation, residuals read by both halves of a split
backward are packed apart so each half frees its own when it ends); the scratch it adds is the
small arrays' bytes, at most `PACK_MAX_BYTES` each.

The cost is compile time. XLA:CPU compiles every distinct kernel (~7 ms each at backend
optimization level 0, ~14 ms at the default) and reuses one kernel for identical ones; a slice
at another offset is another kernel, so a backward reading all its residuals out of one buffer
compiled 3.2x as long (the tiny GPT's whole-model BW: 1.97 s against 0.61 s unpacked, at the
default level; its OPT, reading gradients out of one buffer, 2.10 s against 0.81 s). Residuals
and gradients are therefore packed per repeat of the model's blocks (`repeats`: identical
blocks read identical offsets of identically laid-out chunks, and their kernels stay shared):
BW 0.79 s, OPT 1.10 s. The rest of the difference is paid once per program and process (the
library keeps compiled programs on disk), the host time saved at every op.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PACK_MAX_BYTES = 64 * 1024
"""Arrays up to this size share their dtype's buffer; a larger one is a buffer of its own
(packing it costs no copy: a reshape). Passing an array costs the host ~2.5 us (out of one
program, into the next); packing costs a copy in and out of the buffer and the buffer itself as
scratch memory, which for a large array is more than the host time it saves (64 KiB copied
twice is ~10 us of one CPU core; measured on an 8-layer, d_model=128 stage, packing every
residual took the forward's scratch memory from 1 MB to 25 MB and the stage's peak up 20%).
Small arrays are what a host-bound step passes in the hundreds (a tiny model's every residual;
a large model's norms' statistics and biases)."""


class Layout:
  """Where each named array lies in its buffer (one per chunk and dtype for the arrays up to
  `PACK_MAX_BYTES`, one each for larger ones): built once per set of shapes, compared by value
  (it is part of a program's argument structure, by which its executable is looked up)."""

  __slots__ = ("names", "shapes", "dtypes", "chunks", "classes", "groups", "where", "sizes",
               "order", "regions", "_key", "_hash")

  def __init__(self, names: Sequence[Any], shapes: Sequence[tuple[int, ...]],
               dtypes: Sequence[Any], chunks: Sequence[int] | None = None,
               classes: Sequence[int] | None = None):
    self.names = tuple(names)
    self.shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    self.dtypes = tuple(np.dtype(d) for d in dtypes)
    self.chunks = tuple(chunks) if chunks is not None else (0,) * len(self.names)
    """Each array's chunk (`repeats`): a shared buffer holds one chunk's arrays of one dtype."""
    self.classes = tuple(classes) if classes is not None else None
    """A state layout's (`of_state`): each array's optimizer class; every array shares its
    chunk's buffer of its dtype, however large, each class a region of its own in it (None:
    large arrays have buffers of their own)."""
    n = len(self.names)
    self.order = tuple(sorted(range(n), key=lambda i: (self.classes[i], i))) \
      if self.classes is not None else tuple(range(n))
    """The arrays in the order they lie in their buffers (class by class in a state layout)."""
    keys: list[Any] = [None] * n  # a buffer's (chunk, dtype) (shared), or (dtype, index) (own)
    for i in self.order:
      shape, dtype = self.shapes[i], self.dtypes[i]
      small = self.classes is not None or math.prod(shape) * dtype.itemsize <= PACK_MAX_BYTES
      keys[i] = (self.chunks[i], dtype, -1) if small else (-1, dtype, i)
    buffers = list(dict.fromkeys(keys[i] for i in self.order))
    self.groups = tuple(k[1] for k in buffers)
    """The buffers' dtypes, in the order of their first array."""
    at = [0] * len(buffers)
    where: list[Any] = [None] * n
    index = {k: g for g, k in enumerate(buffers)}
    regions: list[list[tuple[int, int, int]]] = [[] for _ in buffers]
    for i in self.order:
      g = index[keys[i]]
      size = math.prod(self.shapes[i])
      where[i] = (g, at[g], size)
      c = self.classes[i] if self.classes is not None else 0
      if regions[g] and regions[g][-1][0] == c:
        regions[g][-1] = (c, regions[g][-1][1], at[g] + size)
      else:
        regions[g].append((c, at[g], at[g] + size))
      at[g] += size
    self.where = tuple(where)
    """Per array: its buffer, its offset there and its element count."""
    self.sizes = tuple(at)
    """Each buffer's element count."""
    self.regions = tuple(tuple(r) for r in regions)
    """Per buffer, its runs of one optimizer class: (class, start, stop)."""
    self._key = (self.names, self.shapes, tuple(str(d) for d in self.dtypes), self.chunks,
                 self.classes)
    self._hash = hash(self._key)

  @classmethod
  def of(cls, tree: Mapping[Any, Any]) -> Layout:
    """The layout of a mapping of arrays (or shape/dtype structs), in sorted-name order, its
    small arrays' buffers cut where their shapes and dtypes repeat (a model's blocks:
    `repeats`), so that a program reading them reads identical offsets of identical buffers
    for identical blocks, and XLA compiles their kernels once."""
    names = tuple(sorted(tree))
    shapes = tuple(tuple(tree[n].shape) for n in names)
    dtypes = tuple(str(np.dtype(tree[n].dtype)) for n in names)
    chunks = [0] * len(names)
    for c, span in enumerate(repeats(list(zip(shapes, dtypes, strict=True)))):
      for i in span:
        chunks[i] = c
    return _layout(names, shapes, dtypes, tuple(chunks))

  @classmethod
  def of_state(cls, tree: Mapping[Any, Any], classes: Mapping[Any, int],
               blocks: Mapping[Any, int]) -> Layout:
    """The layout of a stage's state (parameters, gradients, optimizer moments): arrays in
    sorted-name order, one buffer per block (`blocks`, by name: the model's block an array
    belongs to, -1 for those outside them), dtype and optimizer class (`classes`, by name:
    `programs.flat_optimizer`), large arrays too, so a program passes a few buffers a block
    whatever the arrays in it, and identical blocks read identical offsets of identical
    buffers (their kernels compile once)."""
    names = tuple(sorted(tree))
    shapes = tuple(tuple(tree[n].shape) for n in names)
    dtypes = tuple(str(np.dtype(tree[n].dtype)) for n in names)
    return _layout(names, shapes, dtypes, tuple(blocks[n] for n in names),
                   tuple(classes[n] for n in names))

  def buffer_names(self, b: int) -> tuple[Any, ...]:
    """The names of the arrays buffer `b` holds, in their order there."""
    return _buffer_names(self)[b]

  @classmethod
  def of_avals(cls, avals: Sequence[Any]) -> Layout:
    """The layout of a list of arrays' avals, named by their positions."""
    return _layout(tuple(range(len(avals))), tuple(tuple(a.shape) for a in avals),
                   tuple(str(np.dtype(a.dtype)) for a in avals))

  def __eq__(self, other: object) -> bool:
    return self is other or (isinstance(other, Layout) and self._key == other._key)

  def __hash__(self) -> int:
    return self._hash

  def __repr__(self) -> str:
    return f"Layout({len(self.names)} arrays in {len(self.groups)} buffers)"

  def index(self, name: Any) -> int:
    return self._positions()[name]

  def _positions(self) -> dict[Any, int]:
    return _positions(self)

  def pack(self, leaves: Sequence[Any]) -> tuple[jax.Array, ...]:
    """`leaves` (in `names` order) as one flat buffer per dtype (traceable; a dtype holding
    one array is that array reshaped, no copy)."""
    parts: list[list[Any]] = [[] for _ in self.groups]
    leaves = list(leaves)
    if len(leaves) != len(self.names):
      raise ValueError(f"{len(leaves)} arrays for a layout of {len(self.names)}")
    for i in self.order:
      parts[self.where[i][0]].append(jnp.ravel(leaves[i]))
    return tuple(p[0] if len(p) == 1 else jnp.concatenate(p) if p else
                 jnp.zeros((0,), self.groups[g]) for g, p in enumerate(parts))

  def unpack(self, buffers: Sequence[Any]) -> list[Any]:
    """The arrays, in `names` order, sliced out of `buffers` (traceable)."""
    return [self.slice(buffers, i) for i in range(len(self.names))]

  def slice(self, buffers: Sequence[Any], i: int) -> Any:
    g, at, size = self.where[i]
    buf = buffers[g]
    part = buf if size == buf.shape[0] else jax.lax.slice(buf, (at,), (at + size,))
    return part.reshape(self.shapes[i])


@functools.cache
def _layout(names: tuple, shapes: tuple, dtypes: tuple, chunks: tuple | None = None,
            classes: tuple | None = None) -> Layout:
  return Layout(names, shapes, dtypes, chunks, classes)


@functools.cache
def _buffer_names(layout: Layout) -> tuple[tuple[Any, ...], ...]:
  out: list[list[Any]] = [[] for _ in layout.groups]
  for i in layout.order:
    out[layout.where[i][0]].append(layout.names[i])
  return tuple(tuple(x) for x in out)


@functools.cache
def _positions(layout: Layout) -> dict[Any, int]:
  return {n: i for i, n in enumerate(layout.names)}


@jax.tree_util.register_pytree_node_class
class Packed(Mapping):
  """A mapping of names to arrays held as `layout`'s buffers (see the module's docstring)."""

  __slots__ = ("layout", "buffers")

  def __init__(self, layout: Layout, buffers: Sequence[Any]):
    self.layout = layout
    self.buffers = tuple(buffers)

  @classmethod
  def from_dict(cls, tree: Mapping[Any, Any]) -> Packed:
    """`tree` packed (inside a trace, or eagerly)."""
    layout = Layout.of(tree)
    return cls(layout, layout.pack([tree[n] for n in layout.names]))

  def tree_flatten(self) -> tuple[tuple[Any, ...], Layout]:
    return self.buffers, self.layout

  @classmethod
  def tree_unflatten(cls, layout: Layout, buffers: Sequence[Any]) -> Packed:
    return cls(layout, buffers)

  def __getitem__(self, name: Any) -> Any:
    i = self.layout.index(name)
    g, at, size = self.layout.where[i]
    if isinstance(self.buffers[g], jax.core.Tracer):
      return self.layout.slice(self.buffers, i)
    return read(self.buffers[g], at, size, self.layout.shapes[i])

  def __iter__(self) -> Iterator[Any]:
    return iter(self.layout.names)

  def __len__(self) -> int:
    return len(self.layout.names)

  def __contains__(self, name: object) -> bool:
    return name in self.layout._positions()

  def unpacked(self) -> dict[Any, Any]:
    """Every array by name (traceable; eagerly, one op per array)."""
    return dict(zip(self.layout.names, self.layout.unpack(self.buffers), strict=True))

  def replace(self, values: Mapping[Any, Any]) -> Packed:
    """A copy with the arrays of `values` (some of its names) written in (traceable)."""
    buffers = list(self.buffers)
    for name, v in values.items():
      g, at, size = self.layout.where[self.layout.index(name)]
      buffers[g] = jax.lax.dynamic_update_slice(
        buffers[g], jnp.ravel(v).astype(buffers[g].dtype), (at,))
    return Packed(self.layout, buffers)

  def __repr__(self) -> str:
    return f"Packed({self.layout!r})"


def read(buf: jax.Array, at: int, size: int, shape: tuple[int, ...]) -> jax.Array:
  """`size` elements of `buf` from `at`, shaped `shape`, outside a trace: one program per
  shape, not per offset (`_read`); the buffer itself when it is all of it."""
  if size == buf.shape[0]:
    return buf.reshape(shape)
  return _read(buf, np.int32(at), size, shape)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _read(buf: jax.Array, at: jax.Array, size: int, shape: tuple[int, ...]) -> jax.Array:
  """One array of a buffer, outside a trace: its offset an argument, so reading every array
  of a stage compiles a program per distinct shape, not one per array."""
  return jax.lax.dynamic_slice(buf, (at,), (size,)).reshape(shape)


def repeats(keys: Sequence[Any]) -> list[range]:
  """`keys` (arrays' shapes and dtypes, in order: a stage's residuals in F's order, its
  parameters by name) cut into chunks: a run repeating one sequence k >= 2 times (a model's
  blocks) one chunk per repeat, what is before and after it a chunk each; all of it one chunk
  if nothing repeats.

  Why: XLA:CPU compiles each distinct kernel once (~7-14 ms each here) and reuses it for every
  identical one. A program reading identical blocks' arrays at the same offsets of
  identically laid-out chunks keeps their kernels identical, as they were unpacked; slices of
  one buffer for the whole stage made every block's kernels distinct. Arrays passed per call
  grow with the repeats (a chunk per block), not with the arrays (~40 residuals a block).

  The longest-covering repeat (at equal cover the shorter period: a chunk per block rather
  than per pair of blocks shares the most kernels), found per period in O(n) with NumPy:
  O(n^2) for n arrays, once per stage at build.
  """
  n = len(keys)
  ids = np.unique(np.array([hash(k) for k in keys], np.int64), return_inverse=True)[1]
  best = (0, 0, 0, 0)  # (cover, period, start, repeats)
  for period in range(1, n // 2 + 1):
    same = np.concatenate(([False], ids[:-period] == ids[period:], [False]))
    edges = np.flatnonzero(np.diff(same.astype(np.int8)))
    starts, ends = edges[::2], edges[1::2]
    runs = ends - starts
    if runs.size == 0 or runs.max() < period:
      continue
    i = int(np.argmax(runs))
    k = int(runs[i]) // period + 1
    if k * period > best[0]:
      best = (k * period, period, int(starts[i]), k)
  cover, period, start, k = best
  if cover == 0:
    return [range(0, n)] if n else []
  cuts = [range(0, start)] + [range(start + i * period, start + (i + 1) * period)
                              for i in range(k)] + [range(start + cover, n)]
  return [c for c in cuts if len(c)]
