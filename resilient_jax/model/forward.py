"""A model's own forward, cut at its blocks: what each pipeline stage runs.

The library does not ask for a model written for it. A stage runs the model's own
`__call__(tokens)` (a model without one: `head(blocks(embed(tokens)))`) with its repeated
blocks, a list of modules found in the model (`layers_path`) or named by `model.layers`,
replaced by stand-ins for the one call:

* the blocks of the stage run as they are;
* the last block of an earlier stage returns what that stage sent (the activation); the blocks
  before it return zeros of their output's shape, which nothing reads;
* after the stage's last block the call stops, and what that block returned is the stage's
  output; on the last stage the call runs to its end (final norm, a tied head, a soft-cap:
  whatever the model does after its blocks).

Everything the model computes before its first block (the prologue: embeddings, positions,
masks, rotary tables, segment ids from the tokens) therefore runs on every stage that needs it,
and XLA drops what a stage does not read (a middle stage never looks up the embedding). What a
block needs besides the hidden state is **recomputed** rather than sent: the token ids (4 bytes
a position) travel to every stage that reads them, where a causal or padding mask would cost a
sequence's length in bytes per position and a rotary table the hidden size; the work
recomputed is elementwise, next to a block's matmuls. The one array a block returns (its hidden
state; a block may return a tuple whose other entries are None, such as Gemma's `(cache, x)`)
is what travels.

Why stand-ins rather than cutting a traced program: the blocks are the only place the cut can
be, and replacing them is exact whatever the forward does around them, control flow included;
a cut of a jaxpr would have to rediscover block boundaries that inlining erased. The limit:
values carried from block to block outside the blocks' arguments and results (`x = x +
block(x)` in the forward) cannot be cut there; `check_stageable` runs the stages one after the
other against the model's own forward and refuses such a model by name.

Randomness: streams that live inside one block are that block's own; a stream shared with
anything else (an `nnx.Rngs` held by the model and used by every block) has its count set to a
value of the block's index before and after each block, so block `i` draws the same numbers
whichever stage runs it and whatever ran before it on that stage.

Growth: a stage traces the whole forward once per program build (a stand-in costs nothing), so
tracing grows with the prologue and epilogue, not with the depth of other stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from resilient_jax.model.staging import run_block

Array = jax.Array

_BLOCK_COUNT_STRIDE = 1 << 20
"""A shared stream's count before block `i` is `(i + 1) * stride` (after it, half a stride
more): up to 4,095 blocks and half a million draws per block fit its 32 bits."""


class ForwardError(ValueError):
  """The model's forward cannot be cut at its blocks (the message says why and how to fix)."""


class _Stop(Exception):  # noqa: N818 - a control-flow signal, not an error
  """Raised by the stage's last block to end the forward there, carrying its result."""

  def __init__(self, out: Any):
    super().__init__("stage output")
    self.out = out


def defines_call(model: Any) -> bool:
  """Whether the model's class (not `nnx.Module`) defines `__call__`."""
  return any("__call__" in vars(c) for c in type(model).__mro__
             if c not in (nnx.Module, object) and issubclass(c, nnx.Module))


def composed(model: Any, tokens: Array) -> Array:
  """The forward of a model without a `__call__`: `head(blocks(embed(tokens)))`."""
  x = model.embed(tokens)
  for block in model.blocks:
    x = block(x)
  return model.head(x)


def own_forward(model: Any) -> Callable[[Any, Array], Any]:
  """`(module, tokens) -> logits`: the model's `__call__`, else `composed`."""
  if defines_call(model):
    return lambda m, tokens: m(tokens)
  return composed


def _is_block_list(value: Any) -> bool:
  return isinstance(value, (nnx.List, list, tuple)) and len(value) > 0 and all(
    isinstance(b, nnx.Module) for b in value)


def layers_path(model: Any, named: str = "") -> tuple[Any, ...]:
  """Where the model keeps its repeated blocks: `named` (dotted, `transformer.blocks`), else
  `blocks`, else the longest list of modules in the model (the only one that long).

  Raises:
    ForwardError: nothing found, or two lists equally long (then `model.layers` must name one).
  """
  if named:
    path = tuple(int(p) if p.isdigit() else p for p in named.split("."))
    try:
      node = _get(model, path)
    except (AttributeError, IndexError, KeyError, TypeError):
      node = None
    if not _is_block_list(node):
      raise ForwardError(f"model.layers={named!r} is not a list of modules in the model")
    return path
  if _is_block_list(getattr(model, "blocks", None)):
    return ("blocks",)
  found = [(len(n), p) for p, n in nnx.iter_graph(model) if _is_block_list(n) and p]
  if not found:
    raise ForwardError("it has no list of blocks (an nnx.List of modules, e.g. "
                       "`self.layers = nnx.List([Block(...) for _ in range(n)])`) to cut into "
                       "pipeline stages")
  longest = max(n for n, _ in found)
  paths = sorted(".".join(map(str, p)) for n, p in found if n == longest)
  if len(paths) > 1:
    raise ForwardError(f"it has {len(paths)} lists of {longest} modules ({', '.join(paths)}): "
                       f"say which are the blocks with model.layers=\"{paths[0]}\"")
  return next(p for n, p in found if n == longest)


def _get(model: Any, path: Sequence[Any]) -> Any:
  node = model
  for p in path:
    node = node[p] if isinstance(p, int) else getattr(node, p)
  return node


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


def shared_rng_counts(model: Any, path: Sequence[Any]) -> list[Any]:
  """The RNG count variables of `model` not owned by exactly one block (see the docstring)."""
  owner: dict[int, int] = {}
  for i, block in enumerate(_get(model, path)):
    for _, node in nnx.iter_graph(block):
      if isinstance(node, nnx.RngCount):
        owner[id(node)] = -1 if owner.get(id(node), i) != i else i
  out = []
  blocks_ids = {id(n) for b in _get(model, path) for _, n in nnx.iter_graph(b)}
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.RngCount) and (owner.get(id(node), -1) < 0 or id(node) not in
                                           blocks_ids):
      out.append(node)
  return out


def _set_counts(counts: Sequence[Any], value: int) -> None:
  for c in counts:
    c[...] = jnp.asarray(value, dtype=c[...].dtype)


@dataclasses.dataclass(frozen=True)
class BlockIO:
  """What block `i` returns on one micro-batch: its tree and the one array in it."""

  tree: Any
  spec: jax.ShapeDtypeStruct


def block_outputs(model: Any, path: Sequence[Any], tokens: jax.ShapeDtypeStruct
                  ) -> tuple[list[BlockIO], Any]:
  """Every block's output (one abstract run of the whole forward) and the forward's own.

  Raises:
    ForwardError: a block returns more than one array (the stage output must be one).
  """
  graphdef, state = nnx.split(model)
  # Shapes only: a model built under a mesh holds values typed with its shardings.
  state = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)
  seen: list[Any] = []

  def run(st: Any, t: Array) -> Any:
    m = nnx.merge(graphdef, st)
    blocks = list(_get(m, path))

    def recording(i: int) -> Callable:
      def call(*args: Any, **kwargs: Any) -> Any:
        try:
          out = blocks[i](*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a user's block: named, not raised as is
          took = ", ".join(f"{a.dtype}{list(a.shape)}" for a in jax.tree.leaves((args, kwargs))
                           if hasattr(a, "shape"))
          first = str(e).strip().splitlines()[0] if str(e).strip() else ""
          raise ForwardError(f"{name}[{i}] fails on {took}: {type(e).__name__}: {first}"
                             ) from None
        seen.append((i, out))
        return out
      return call

    swap_blocks(m, path, [recording(i) for i in range(len(blocks))])
    return own_forward(model)(m, t)

  name = ".".join(map(str, path))
  final = jax.eval_shape(run, state, tokens)
  io: dict[int, BlockIO] = {}
  for i, out in seen:
    leaves, tree = jax.tree.flatten(out)
    arrays = [leaf for leaf in leaves if hasattr(leaf, "shape")]
    if len(arrays) != 1 or len(leaves) != 1:
      raise ForwardError(f"{name}[{i}] returns {len(leaves)} values; a block must return one "
                         "array (or a tuple whose other entries are None): it is what one "
                         "stage hands the next")
    io.setdefault(i, BlockIO(tree, jax.ShapeDtypeStruct(arrays[0].shape, arrays[0].dtype)))
  missing = [i for i in range(len(_get(model, path))) if i not in io]
  if missing:
    raise ForwardError(f"the forward never calls {name}[{missing[0]}]: every block must run "
                       "once per forward")
  return [io[i] for i in range(len(io))], final


@dataclasses.dataclass(frozen=True)
class StageForward:
  """One stage's slice of the forward: `(module, x, tokens) -> out` for the module bound to
  parameters (`staging.Binder`), `x` the previous stage's output (None on the first stage)."""

  path: tuple[Any, ...]
  layers: range
  first: bool
  last: bool
  io: tuple[BlockIO, ...]
  forward: Callable[[Any, Array], Any]
  remat: str = "none"

  def __call__(self, m: Any, x: Array | None, tokens: Array) -> Any:
    blocks = list(_get(m, self.path))
    counts = shared_rng_counts(m, self.path)
    a, b = self.layers.start, self.layers.stop

    def stand_in(i: int) -> Callable:
      def call(*args: Any, **kwargs: Any) -> Any:
        base = (i + 1) * _BLOCK_COUNT_STRIDE
        if i < a:
          spec = self.io[i].spec
          leaf = x if i == a - 1 else jnp.zeros((x.shape[0], *spec.shape[1:]), spec.dtype)
          out = jax.tree.unflatten(self.io[i].tree, [leaf])
        else:
          _set_counts(counts, base)
          out = run_block(blocks[i], *args, remat=self.remat, **kwargs)
        _set_counts(counts, base + _BLOCK_COUNT_STRIDE // 2)
        if i == b - 1 and not self.last:
          raise _Stop(jax.tree.leaves(out)[0])
        return out
      return call

    swap_blocks(m, self.path, [stand_in(i) for i in range(len(blocks))])
    try:
      return self.forward(m, tokens)
    except _Stop as stop:
      return stop.out


class ModelCut:
  """A model's forward and its blocks, found once per model: every stage's `StageForward`.

  Args:
    model: the model (its structure; values are the caller's).
    seq_len: the token sequence length (block outputs are recorded on one sequence).
    layers: `model.layers`, the dotted path of the blocks ("" finds them).
    remat: `model.remat` for every block (`staging.run_block`).
  """

  def __init__(self, model: Any, seq_len: int, layers: str = "", remat: str = "none"):
    self.path = layers_path(model, layers)
    self.num_blocks = len(_get(model, self.path))
    self.forward = own_forward(model)
    self.remat = remat
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    io, self.logits = block_outputs(model, self.path, tokens)
    self.io = tuple(io)

  def stage(self, layers: range, *, first: bool, last: bool) -> StageForward:
    return StageForward(self.path, layers, first, last, self.io, self.forward, self.remat)

  def whole(self) -> StageForward:
    """The whole forward as one stage (what a single device runs)."""
    return self.stage(range(self.num_blocks), first=True, last=True)

  def hidden(self, i: int, batch: int) -> jax.ShapeDtypeStruct:
    """What block `i` hands on, for `batch` sequences."""
    spec = self.io[i].spec
    return jax.ShapeDtypeStruct((batch, *spec.shape[1:]), spec.dtype)


def live_inputs(jaxpr: Any) -> list[bool]:
  """Per input of `jaxpr` (a `Jaxpr`), whether any output depends on it (an equation holding a
  program of its own counts as reading all its inputs)."""
  from jax.extend import core as jcore

  live = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if isinstance(v, jcore.Var))
  return [v in live for v in jaxpr.invars]


def stage_reads(binder: Any, stage: StageForward, x: jax.ShapeDtypeStruct | None,
                tokens: jax.ShapeDtypeStruct) -> tuple[tuple[str, ...], bool]:
  """The parameters a stage's forward reads (by global name, sorted) and whether it reads the
  token ids besides its input: what the stage holds, trains and is sent."""
  seeds = jax.ShapeDtypeStruct((tokens.shape[0], 2), jnp.int32) if binder.uses_rng else None
  params = binder.abstract_params()

  def run(p: dict, xs: Any, t: Array, s: Any) -> Any:
    return binder.run(p, stage, (xs, t), s)

  closed = jax.make_jaxpr(run)(params, x, tokens, seeds)
  live = live_inputs(closed.jaxpr)
  order = sorted(params)  # a dict's leaves come in sorted key order
  used = tuple(n for n, u in zip(order, live[:len(order)], strict=True) if u)
  reads_tokens = not stage.first and live[len(order) + (x is not None)]
  return used, bool(reads_tokens)
