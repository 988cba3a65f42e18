"""The user's loss, traced once and cut into pipeline stages: what each stage computes.

The library never re-runs a model's Python per stage. It traces `loss_fn(model, batch)` once,
as a pure function of the model's parameters, the micro-batch and the per-sample seeds, with
the model's repeated blocks (`layers_path`) marked: calling block `i` first emits a
`pipeline_boundary` equation, which computes nothing and only records where in the program
block `i` begins. The trace is one flat list of equations in program order (calls that hold a
boundary, such as the model's own `jit`, are inlined), and a pipeline stage holding blocks
`a..b-1` is every equation from the boundary of block `a` to that of block `b` (the first stage
also everything before block 0, the last everything after its last block, the loss included).

**Every value live across a cut travels** to the stages that read it: the hidden state, and
equally what a model carries outside its blocks' results (a ReZero gate's product, the list of
earlier outputs DenseFormer averages, a LayerDrop decision, an RNG stream's count, a value
computed before the blocks and read after them). So the cut computes exactly the traced
program, whatever the forward does between its blocks: correct by construction, not checked
once against the whole. A value that depends only on the batch (positions, masks, rotary
tables, segment ids; no parameter, no matmul) is instead **recomputed** where it is read, from
the batch entries it needs, which every stage can read directly: a mask costs a sequence's
length per position to send and a few elementwise operations to rebuild. What does travel
crosses as one array (`Carry`): the values themselves when there is one, else packed.

Sharding annotations in the forward (`jax.lax.with_sharding_constraint`, `jax.sharding.reshard`)
are layout requests for the mesh the model was built under; a stage runs on its worker's own
devices, laid out by the library (`model.sharding`), so the loss is traced with them as
identities (`sharding.layout_requests_dropped`) and without that mesh.

Growth: tracing and cutting cost one trace of the whole loss per micro-batch size and a pass
over its equations per layout (O(equations)); per stage boundary the bytes that travel are those
of the values live across it, the same at any dp, pp or process count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jcore

from resilient_jax.model.blocks import (  # noqa: F401 (re-exported: the cut's vocabulary)
  CutError,
  _get,
  _Marked,
  blocks_at,
  boundary_p,
  layers_path,
  swap_blocks,
)
from resilient_jax.model.carry import Carry
from resilient_jax.model.sharding import layout_requests_dropped
from resilient_jax.model.split import eval_eqns, read_var
from resilient_jax.model.staging import Binder, token_cross_entropy, variable_names

Array = jax.Array
Batch = Mapping[str, Any]
LossFn = Callable[[Any, Batch], Any]


# ---------------------------------------------------------------- the loss's own form

def default_loss_fn(model: Any) -> LossFn:
  """The loss of a model that brings none: `model(batch["tokens"])` against
  `batch["targets"]`, its own `loss(logits, targets)` or `loss(logits, batch)` if it has one,
  else `token_cross_entropy`; a model without a `__call__` runs `head(blocks(embed(x)))`."""
  import inspect

  own = getattr(model, "loss", None)
  sees_batch = False
  if own is not None:
    try:
      sees_batch = "batch" in inspect.signature(own).parameters
    except (TypeError, ValueError):
      pass
  calls = defines_call(model)

  def loss_fn(m: Any, batch: Batch) -> Any:
    tokens = batch["tokens"]
    if calls:
      logits = m(tokens)
    else:
      x = m.embed(tokens)
      for block in m.blocks:
        x = block(x)
      logits = m.head(x)
    loss = getattr(m, "loss", None)
    if loss is None:
      return token_cross_entropy(logits, batch["targets"])
    return loss(logits, batch) if sees_batch else loss(logits, batch["targets"])

  return loss_fn


def defines_call(model: Any) -> bool:
  """Whether the model's class (not `nnx.Module`) defines `__call__`."""
  return any("__call__" in vars(c) for c in type(model).__mro__
             if c not in (nnx.Module, object) and issubclass(c, nnx.Module))


def loss_terms(out: Any) -> tuple[Array, Array | None]:
  """`loss_fn`'s result as `(losses, weights or None)`: a scalar mean loss; an array of
  per-example (or per-token) losses, averaged over all its elements; or `(losses, weights)`,
  the weighted mean `sum(w * l) / sum(w)` over the global batch. A trailing dict of auxiliary
  metrics (`(loss, aux)`) is set aside.

  Raises:
    CutError: anything else.
  """
  if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
    out = out[0]
  if isinstance(out, tuple) and len(out) == 2 and all(hasattr(o, "shape") for o in out):
    losses, weights = out
    return losses, jnp.broadcast_to(weights, losses.shape).astype(jnp.float32)
  if hasattr(out, "shape") and jnp.issubdtype(out.dtype, jnp.floating):
    return out, None
  raise CutError(f"loss_fn returned {_describe(out)}: it must return a scalar mean loss, an "
                 "array of per-example losses, or (per-example losses, weights), optionally "
                 "followed by a dict of metrics")


def _describe(value: Any) -> str:
  if hasattr(value, "shape"):
    return f"a {value.dtype}{list(value.shape)} array"
  if isinstance(value, tuple):
    return f"a tuple of {len(value)} ({', '.join(_describe(v) for v in value)})"
  return f"a {type(value).__name__}"


# ---------------------------------------------------------------- tracing

_INLINE = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
"""Equations whose nested jaxpr is inlined when it holds a boundary (a call computes the same
inlined; a custom derivative around blocks would not, and is refused)."""
_HEAVY = ("dot_general", "conv_general_dilated")
"""Primitives that make a value worth sending rather than recomputing."""


def _inner(eqn: jcore.JaxprEqn) -> list[jcore.ClosedJaxpr]:
  out = []
  for p in eqn.params.values():
    for q in (p if isinstance(p, (tuple, list)) else [p]):
      if isinstance(q, jcore.ClosedJaxpr):
        out.append(q)
      elif isinstance(q, jcore.Jaxpr):
        out.append(jcore.ClosedJaxpr(q, ()))
  return out


def _has_boundary(jaxpr: jcore.Jaxpr) -> bool:
  return any(e.primitive is boundary_p or any(_has_boundary(j.jaxpr) for j in _inner(e))
             for e in jaxpr.eqns)


def _heavy(eqn: jcore.JaxprEqn) -> bool:
  return eqn.primitive.name in _HEAVY or any(
    _heavy(e) for j in _inner(eqn) for e in j.jaxpr.eqns)


@dataclasses.dataclass
class _Flat:
  """A flat program: equations in program order over variables, boundaries among them."""

  invars: list[Any]
  outvars: list[Any]
  eqns: list[Any]  # jcore.JaxprEqn, or ("boundary", index)
  consts: dict[Any, Any]


def _flatten(closed: jcore.ClosedJaxpr, where: str) -> _Flat:
  """Inlines every call that holds a boundary, so the boundaries stand at the top level.

  Raises:
    CutError: a boundary inside a loop or branch (`scan`, `while`, `cond`), or an equation with
      a side effect.
  """
  eqns: list[Any] = []
  consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))

  def walk(jaxpr: jcore.Jaxpr, env: dict) -> None:
    def sub(v: Any) -> Any:
      return v if isinstance(v, jcore.Literal) else env.get(v, v)

    for eqn in jaxpr.eqns:
      if eqn.primitive is boundary_p:
        eqns.append(("boundary", eqn.params["index"]))
        continue
      inner = _inner(eqn)
      if any(_has_boundary(j.jaxpr) for j in inner):
        if eqn.primitive.name not in _INLINE or len(inner) != 1:
          raise CutError(f"{where} runs inside a `{eqn.primitive.name}` (a loop or branch "
                         "over the blocks, e.g. `nnx.scan` or `jax.lax.fori_loop`): a stage "
                         "must hold whole calls of its blocks, so call them one after the "
                         "other in Python (`for block in self.layers: x = block(x)`)")
        j = inner[0]
        consts.update(zip(j.jaxpr.constvars, j.consts, strict=True))
        local = {v: sub(a) for v, a in zip(j.jaxpr.invars, eqn.invars, strict=True)}
        walk(j.jaxpr, local)
        for v, o in zip(eqn.outvars, j.jaxpr.outvars, strict=True):
          env[v] = local.get(o, o) if not isinstance(o, jcore.Literal) else o
        continue
      if eqn.effects:
        raise CutError(f"its loss has a side effect (`{eqn.primitive.name}`, e.g. "
                       "`jax.debug.print` or a callback): a traced program run in pieces on "
                       "other devices cannot carry it; remove it")
      eqns.append(eqn.replace(invars=[sub(v) for v in eqn.invars]))

  env: dict = {}
  walk(closed.jaxpr, env)
  outvars = [env.get(v, v) if not isinstance(v, jcore.Literal) else v
             for v in closed.jaxpr.outvars]
  return _Flat(list(closed.jaxpr.invars), outvars, eqns, consts)


# ---------------------------------------------------------------- one stage's piece

@dataclasses.dataclass(frozen=True)
class Segment:
  """The equations of one stage and what they read and hand on.

  `__call__(params, xs, batch, seeds)` evaluates them: `params` by name (those of
  `param_names`), `xs` the values carried in (`carry_in`), `batch` the micro-batch's entries
  (those of `batch_keys`), `seeds` per sample where the model draws random numbers; it returns
  the values carried out, or on the last stage the loss's `(losses, weights or None)`.
  """

  eqns: tuple[Any, ...]
  param_names: tuple[str, ...]
  batch_keys: tuple[str, ...]
  reads_seeds: bool
  carry_in: Carry | None
  carry_out: Carry | None  # None on the last stage
  _ins: tuple[Any, ...]
  _outs: tuple[Any, ...]
  _inputs: tuple[tuple[Any, tuple], ...]  # (jaxpr input variable, ("param"|"batch"|"seeds", key))
  _consts: tuple[tuple[Any, Any], ...]
  weighted: bool

  def __call__(self, params: Mapping[str, Array], xs: Sequence[Array], batch: Batch,
               seeds: Array | None) -> Any:
    env: dict = dict(self._consts)
    for v, (kind, key) in self._inputs:
      env[v] = params[key] if kind == "param" else batch[key] if kind == "batch" else seeds
    env.update(zip(self._ins, xs, strict=True))
    eval_eqns(self.eqns, env)
    outs = [read_var(env, v) for v in self._outs]
    if self.carry_out is not None:
      return outs
    return (outs[0], outs[1] if self.weighted else None)


class LossCut:
  """`loss_fn(model, batch)` traced once on one micro-batch's shapes, cut by layer split.

  Args:
    model: the model (its structure and initial values; left unchanged).
    loss_fn: the user's `loss_fn(model, batch)`; None: `default_loss_fn(model)`.
    batch: one micro-batch's entries, `{key: ShapeDtypeStruct}` (leading axis: samples).
    layers: `model.layers`, the dotted path of the blocks ("" finds them).
    remat: `model.remat` for every block.

  Raises:
    CutError: the loss cannot be traced or cut (one line, what to change).
  """

  def __init__(self, model: Any, loss_fn: LossFn | None, batch: Mapping[str, Any],
               layers: str = "", remat: str = "none"):
    self.path = layers_path(model, layers)
    self.name = ".".join(map(str, self.path))
    self.num_blocks = len(_get(model, self.path))
    self.names = variable_names(model)
    self.binder = Binder(model, self.names)
    self.uses_rng = self.binder.uses_rng
    self.batch_specs = {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype) for k, v in batch.items()}
    self.microbatch = _samples(self.batch_specs)
    loss_fn = loss_fn or default_loss_fn(model)
    path, remat_, n = self.path, remat, self.num_blocks
    weighted = []

    def whole(params: dict, b: dict, seeds: Array | None) -> Any:
      def fn(m: Any, one: dict) -> Any:
        swap_blocks(m, path, [_Marked(blk, i, remat_, i == n - 1)
                              for i, blk in enumerate(_get(m, path))])
        losses, weights = loss_terms(loss_fn(m, one))
        weighted.append(weights is not None)
        return (losses, weights) if weights is not None else (losses,)
      return self.binder.run(params, fn, (b,), seeds)

    params = self.binder.abstract_params()
    seeds = jax.ShapeDtypeStruct((self.microbatch, 2), jnp.int32) if self.uses_rng else None
    try:
      with layout_requests_dropped():
        closed = jax.make_jaxpr(whole)(params, self.batch_specs, seeds)
    except CutError:
      raise
    except KeyError as e:
      raise CutError(f"its loss reads batch[{e.args[0]!r}], which the data does not have "
                     f"(its entries: {', '.join(sorted(self.batch_specs))})") from None
    except jax.errors.ConcretizationTypeError as e:
      raise CutError("its loss reads a traced value as a Python value (an `if`, `bool()`, "
                     "`int()` or shape taken from an array): a training step is one traced "
                     f"program; use `jnp.where` or `jax.lax.cond` instead ({_first(e)})") from None
    except Exception as e:  # noqa: BLE001 - a user's code: named, not raised as is
      raise CutError(f"its loss fails on {_batch_text(self.batch_specs)}: "
                     f"{type(e).__name__}: {_first(e)}") from None
    self.weighted = bool(weighted and weighted[0])
    self._flat = flat = _flatten(closed, f"{self.name}[...]")
    order = sorted(params)
    keys = sorted(self.batch_specs)
    kinds = [("param", n) for n in order] + [("batch", k) for k in keys]
    if seeds is not None:
      kinds.append(("seeds", None))
    self._kinds = dict(zip(flat.invars, kinds, strict=True))
    self.boundaries: dict[int, int] = {}
    for at, e in enumerate(flat.eqns):
      if isinstance(e, tuple):
        if e[1] in self.boundaries:
          raise CutError(f"the forward calls {self.name}[{e[1]}] more than once: a block "
                         "reused is a layer trained as one weight in two stages; give each "
                         "call its own block")
        self.boundaries[e[1]] = at
    missing = [i for i in range(n + 1) if i not in self.boundaries]
    if missing:
      raise CutError(f"the forward never calls {self.name}[{missing[0]}]: every block must run "
                     "once per forward")
    if [self.boundaries[i] for i in range(n + 1)] != sorted(self.boundaries.values()):
      raise CutError(f"the forward calls {self.name} out of order: a pipeline runs its blocks "
                     "in their list's order")
    self._producer = {v: i for i, e in enumerate(flat.eqns) if not isinstance(e, tuple)
                      for v in e.outvars}
    self._cheap = self._recomputable()
    self._segments: dict[tuple[tuple[int, int], ...], list[Segment]] = {}
    self.loss_spec = closed.out_avals[0]

  # -- analysis

  def block_of(self, name: str) -> int:
    """The block a parameter (global name) belongs to, by its path (`blocks.3.mlp.fc.kernel`:
    3); -1 for one outside the blocks (embeddings, the head, a final norm)."""
    head, _, rest = name.partition(self.name + ".") if self.name else ("", "", name)
    index = rest.split(".", 1)[0]
    return int(index) if not head and rest and index.isdigit() else -1

  def _recomputable(self) -> set[Any]:
    """Variables that depend only on the batch, the seeds and constants, through no matmul."""
    flat = self._flat
    ok = {v for v, (kind, _) in self._kinds.items() if kind != "param"} | set(flat.consts)
    for e in flat.eqns:
      if isinstance(e, tuple) or _heavy(e):
        continue
      if all(isinstance(v, jcore.Literal) or v in ok for v in e.invars):
        ok.update(e.outvars)
    return ok

  def unused_params(self) -> list[str]:
    """Parameters the loss never reads: no stage would train them."""
    flat = self._flat
    live = {v for v in flat.outvars if isinstance(v, jcore.Var)}
    for e in reversed(flat.eqns):
      if not isinstance(e, tuple) and any(v in live for v in e.outvars):
        live.update(v for v in e.invars if isinstance(v, jcore.Var))
    return [key for v, (kind, key) in self._kinds.items() if kind == "param" and v not in live]

  def weights_read_params(self) -> bool:
    """Whether the loss's weights depend on a parameter (they must come from the batch)."""
    if not self.weighted:
      return False
    flat = self._flat
    live = {flat.outvars[1]} if isinstance(flat.outvars[1], jcore.Var) else set()
    for e in reversed(flat.eqns):
      if not isinstance(e, tuple) and any(v in live for v in e.outvars):
        live.update(v for v in e.invars if isinstance(v, jcore.Var))
    return any(kind == "param" and v in live for v, (kind, _) in self._kinds.items())

  def weight_sum(self) -> Callable[[Batch, Array | None], Array]:
    """`(batch, seeds) -> sum of the loss's weights` over one micro-batch (no parameter)."""
    flat = self._flat
    target = flat.outvars[1]
    eqns = _slice(flat.eqns, [target])

    def total(batch: Batch, seeds: Array | None) -> Array:
      env = dict(flat.consts)
      for v, (kind, key) in self._kinds.items():
        if kind == "batch":
          env[v] = batch[key]
        elif kind == "seeds":
          env[v] = seeds
      eval_eqns(eqns, env)
      return read_var(env, target).sum()

    return total

  # -- the cut

  def segments(self, split: Sequence[range]) -> list[Segment]:
    """Each stage's `Segment` for a layer split (ranges of blocks covering them in order)."""
    key = tuple((r.start, r.stop) for r in split)
    if key not in self._segments:
      self._segments[key] = self._cut([r.start for r in split])
    return self._segments[key]

  def _cut(self, starts: Sequence[int]) -> list[Segment]:
    flat = self._flat
    n_st = len(starts)
    cuts = [self.boundaries[a] for a in starts[1:]]

    def stage_at(pos: int) -> int:
      return sum(pos > c for c in cuts)

    own: list[list[int]] = [[] for _ in range(n_st)]
    for i, e in enumerate(flat.eqns):
      if not isinstance(e, tuple):
        own[stage_at(i)].append(i)
    defined = {v: stage_at(i) for v, i in self._producer.items()}
    # What each stage reads (its own equations' inputs; the last stage also the loss), where it
    # was defined, and so what travels across each cut.
    reads: list[list[Any]] = []
    for s in range(n_st):
      seen: dict = {}
      for i in own[s]:
        for v in flat.eqns[i].invars:
          if isinstance(v, jcore.Var):
            seen.setdefault(v)
      if s == n_st - 1:
        for v in flat.outvars:
          if isinstance(v, jcore.Var):
            seen.setdefault(v)
      reads.append(list(seen))
    live: list[set[Any]] = [set() for _ in range(n_st - 1)]
    recompute: list[set[Any]] = [set() for _ in range(n_st)]
    for s, vs in enumerate(reads):
      for v in vs:
        d = defined.get(v)
        if d is None or d == s:
          continue
        if v in self._cheap:
          recompute[s].add(v)
        else:
          for b in range(d, s):
            live[b].add(v)
    by_pos = lambda v: self._producer[v]  # noqa: E731 - program order
    carries = [sorted(vs, key=by_pos) for vs in live]
    segments = []
    for s in range(n_st):
      ins = carries[s - 1] if s else []
      outs = carries[s] if s < n_st - 1 else list(flat.outvars[:1 + self.weighted])
      body = set(own[s]) | self._closure(recompute[s])
      eqns = _slice([flat.eqns[i] for i in sorted(body)], outs, stop_at=set(ins))
      segments.append(self._segment(s, eqns, ins, outs, last=s == n_st - 1))
    return segments

  def _closure(self, values: set[Any]) -> set[int]:
    """The equations that recompute `values` (cheap: from the batch, seeds and constants)."""
    picked: set[int] = set()
    todo = [self._producer[v] for v in values]
    while todo:
      i = todo.pop()
      if i in picked:
        continue
      picked.add(i)
      todo += [self._producer[v] for v in self._flat.eqns[i].invars
               if isinstance(v, jcore.Var) and v in self._producer]
    return picked

  def _segment(self, s: int, eqns: list, ins: list, outs: list, last: bool) -> Segment:
    flat = self._flat
    used: dict = {}
    for e in eqns:
      for v in e.invars:
        if isinstance(v, jcore.Var):
          used.setdefault(v)
    for v in outs:
      if isinstance(v, jcore.Var):
        used.setdefault(v)
    inputs = tuple((v, self._kinds[v]) for v in used if v in self._kinds)
    consts = tuple((v, flat.consts[v]) for v in used if v in flat.consts)

    def spec(v: Any) -> jax.ShapeDtypeStruct:
      return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)

    carry_in = Carry(tuple(map(spec, ins))) if ins else None
    carry_out = None if last else Carry(tuple(map(spec, outs)))
    where = f"after {self.name}[{s}]"
    if s and carry_in is None:
      raise CutError(f"the stage from {self.name}[...] at stage {s} reads nothing its previous "
                     "stage computes: the loss does not flow through every block")
    if carry_out is not None and not any(jnp.issubdtype(x.dtype, jnp.floating)
                                         for x in carry_out.specs):
      raise CutError(f"no float value crosses the cut {where}: gradients cannot flow back")
    return Segment(
      eqns=tuple(eqns),
      param_names=tuple(sorted(k for _, (kind, k) in inputs if kind == "param")),
      batch_keys=tuple(sorted(k for _, (kind, k) in inputs if kind == "batch")),
      reads_seeds=any(kind == "seeds" for _, (kind, _) in inputs),
      carry_in=carry_in, carry_out=carry_out, _ins=tuple(ins), _outs=tuple(outs),
      _inputs=inputs, _consts=consts, weighted=self.weighted)

  def whole(self) -> Segment:
    """The whole loss as one stage (what one device runs)."""
    return self.segments([range(self.num_blocks)])[0]


def _slice(eqns: Sequence[Any], targets: Sequence[Any], stop_at: set[Any] = frozenset()
           ) -> list[Any]:
    """The equations of `eqns` (in order) that `targets` depend on, not looking past
    `stop_at` (values given)."""
    live = {v for v in targets if isinstance(v, jcore.Var) and v not in stop_at}
    picked = []
    for e in reversed(eqns):
      if isinstance(e, tuple):
        continue
      if any(v in live for v in e.outvars):
        picked.append(e)
        live.update(v for v in e.invars if isinstance(v, jcore.Var) and v not in stop_at)
    return picked[::-1]


def _samples(specs: Mapping[str, jax.ShapeDtypeStruct]) -> int:
  sizes = {s.shape[0] if s.shape else None for s in specs.values()}
  if len(sizes) != 1 or None in sizes:
    raise CutError(f"the batch's entries must share a leading samples axis: "
                   f"{_batch_text(specs)}")
  return int(next(iter(sizes)))


def _batch_text(specs: Mapping[str, jax.ShapeDtypeStruct]) -> str:
  return "{" + ", ".join(f"{k!r}: {s.dtype}{list(s.shape)}" for k, s in sorted(specs.items())) \
    + "}"


def _first(e: Exception) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:300] if text else type(e).__name__
