"""The backward of a stage, split into B (input gradient) and W (weight gradient) automatically.

Zero-bubble and re-routing schedules run a stage's backward as two programs: B, the gradient
with respect to the stage input, on the pipeline's critical path, and W, the parameter gradient,
deferrable into bubbles. Differentiating the stage twice would make W re-run the whole backward
chain. Instead the stage's backward is traced once (a jaxpr of primitive operations) and its
equations are partitioned:

* B is every equation the input gradient depends on;
* W is every other equation the parameter gradients depend on;
* what W reads of B's values (the cotangents flowing back through the stage, e.g. the output
  cotangent of every dense layer) is handed from B to W, so W never recomputes B's work.

This works for any layer JAX can differentiate: stock `nnx` layers, user layers, custom VJPs
(an equation with a nested jaxpr, like `jit`, is inlined first; other higher-order equations such
as `scan` stay whole, on whichever side needs them first). A rematerialised block
(`jax.checkpoint`, `model.remat`) leaves one `remat` equation in the backward holding both the
recomputed forward and the block's backward: it is inlined too, so B runs the recompute once,
as part of its equations, and hands W what W reads of it (the recomputed activations a weight
gradient multiplies) instead of W recomputing the forward a third time. Its barrier against
common-subexpression elimination has nothing to guard here: F, B and W are separate programs,
so the recompute cannot be merged back into a forward. The fused backward is B and W in one
program, so all three compute exactly the same values as `jax.vjp`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

_INLINE = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
"""Equations whose nested jaxpr is evaluated inline (`remat2` is `jax.checkpoint`'s)."""


_LAYOUT = ("sharding_constraint", "reshard", "mesh_cast")
"""Layout requests: identities on a stage's own devices, which the library lays out itself
(`model.cut`: a forward written for another mesh)."""


def read_var(env: dict, v: Any) -> Any:
  """The value of `v` (a variable or a literal) in `env`."""
  return v.val if isinstance(v, jcore.Literal) else env[v]


def eval_eqns(eqns: Sequence[jcore.JaxprEqn], env: dict) -> None:
  """Evaluates `eqns` in order, reading and writing `env` (variables to values): each bound
  again, so a trace around it (differentiation, a jit) sees them; layout requests pass their
  values through."""
  for eqn in eqns:
    invals = [read_var(env, v) for v in eqn.invars]
    if eqn.primitive.name in _LAYOUT:
      outs = invals[: len(eqn.outvars)]
    else:
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for v, o in zip(eqn.outvars, outs, strict=True):
      if not isinstance(v, jcore.DropVar):
        env[v] = o


def _inline_eval(jaxpr: jcore.Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
  """Evaluates `jaxpr`, descending into nested `jit` calls instead of binding them."""
  env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    inner = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINE else None
    if isinstance(inner, jcore.Jaxpr):  # `remat2` holds an open jaxpr (no constants)
      inner = jcore.ClosedJaxpr(inner, ())
    if isinstance(inner, jcore.ClosedJaxpr):
      outs = _inline_eval(inner.jaxpr, inner.consts, *[read_var(env, v) for v in eqn.invars])
      for v, o in zip(eqn.outvars, outs, strict=True):
        if not isinstance(v, jcore.DropVar):
          env[v] = o
    else:
      eval_eqns([eqn], env)
  return [read_var(env, v) for v in jaxpr.outvars]


def _needed(jaxpr: jcore.Jaxpr, outs: Sequence[Any], skip: set[int] = frozenset()) -> list[int]:
  """Indices of the equations (not in `skip`) that `outs` depend on, in program order."""
  live = {v for v in outs if isinstance(v, jcore.Var)}
  picked = []
  for i in range(len(jaxpr.eqns) - 1, -1, -1):
    eqn = jaxpr.eqns[i]
    if i in skip or not (eqn.effects or any(v in live for v in eqn.outvars)):
      continue
    picked.append(i)
    live.update(v for v in eqn.invars if isinstance(v, jcore.Var))
  return picked[::-1]


def _handover(
  j: jcore.Jaxpr, n_res: int, b_eqns: Sequence[int], w_eqns: Sequence[int], weights: Sequence[Any]
) -> list[Any]:
  """What W reads of B's values and of the cotangents (it reads residuals directly)."""
  b_defined = {v for i in b_eqns for v in j.eqns[i].outvars}
  w_defined = {v for i in w_eqns for v in j.eqns[i].outvars}
  cotangents = set(j.invars[n_res:])
  return [
    v for v in _uses(j, w_eqns, weights)
    if v not in w_defined and (v in b_defined or v in cotangents)
  ]


def _nbytes(vs: Sequence[Any]) -> int:
  return sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in vs)


# Primitives W keeps whatever it would save: the weight-gradient products themselves (what the
# split defers) and anything holding a program of its own.
_KEEP_IN_W = ("dot_general", "conv_general_dilated")
_SMALL = 8
"""Cheap W work on a value that stays in the hand-over moves into B if it adds at most
1/_SMALL of the value's bytes to the hand-over (a reduction over tokens adds 1/tokens)."""


def _absorb_small_reductions(
  j: jcore.Jaxpr, n_res: int, b_eqns: list[int], weights: Sequence[Any]
) -> list[int]:
  """B's equations, plus the cheap W work on values B has just computed.

  A norm's scale and bias gradients are reductions over every token of a cotangent B computes
  (`sum(g * xhat)`, `sum(g)`): left in W, B must hand over the full-size `g` (and `xhat`, when
  the backward recomputes it) to get two vectors back. So for each value B would hand over,
  the work W does on it without a matmul moves into B whenever the hand-over shrinks; B then
  hands over the small results instead.

  A dense layer's bias gradient is such a reduction too (`sum(g)` over tokens), of a `g` that
  W's weight-gradient matmul still needs, so the hand-over cannot shrink. Left in W it reads
  `g` a second time from memory (W runs later, and XLA:CPU schedules the reductions after all
  of W's matmuls); in B it reads `g` right after computing it, while it is in cache. So the
  cheap readers of a value that stays in the hand-over move into B too when they add at most
  `1 / _SMALL` of that value's bytes to it (docs/benchmark_results.md: on the GPT stage B + W about
  1% cheaper, B 1.5% dearer; their sum is what a zero-bubble stage runs per micro-batch).
  Weight-gradient matmuls always stay in W: deferring them is the point of the split.
  """
  b_set = set(b_eqns)
  available = {v for i in b_eqns for v in j.eqns[i].outvars} | set(j.invars) | set(j.constvars)
  producer = {v: i for i, e in enumerate(j.eqns) for v in e.outvars}
  w_eqns = _needed(j, weights, skip=b_set)
  computable: set[int] = set()
  for i in w_eqns:  # program order: an equation's inputs come before it
    e = j.eqns[i]
    if e.primitive.name in _KEEP_IN_W or any(
      isinstance(p, (jcore.Jaxpr, jcore.ClosedJaxpr)) for p in e.params.values()
    ):
      continue
    if all(not isinstance(v, jcore.Var) or v in available or producer.get(v) in computable
           for v in e.invars):
      computable.add(i)
  handover = _handover(j, n_res, b_eqns, w_eqns, weights)
  best = _nbytes(handover)
  # One candidate per handed-over value that W reads without a matmul somewhere: everything W
  # computes from it without a matmul, with what that needs.
  for v in sorted(handover, key=lambda v: -_nbytes([v])):
    readers = [i for i in w_eqns if v in j.eqns[i].invars]
    cheap = [i for i in readers if i in computable]
    if not cheap:
      continue
    # All readers cheap: `v` leaves the hand-over if the work moves. Otherwise it stays (a
    # matmul reads it) and the move may only add small results (a reduction's) to it.
    allowance = 0 if len(cheap) == len(readers) else _nbytes([v]) // _SMALL
    group = set(cheap)
    for i in sorted(computable):
      if any(producer.get(u) in group for u in j.eqns[i].invars if isinstance(u, jcore.Var)):
        group.add(i)
    closure, todo = set(), list(group)
    while todo:
      k = todo.pop()
      if k in closure or k in b_set:
        continue
      closure.add(k)
      todo += [producer[u] for u in j.eqns[k].invars
               if isinstance(u, jcore.Var) and producer.get(u) in computable]
    trial = sorted(b_set | closure)
    size = _nbytes(_handover(j, n_res, trial, _needed(j, weights, skip=set(trial)), weights))
    if size < best + allowance:
      b_set, best = set(trial), size
  return sorted(b_set)


def _uses(jaxpr: jcore.Jaxpr, eqn_ids: Sequence[int], outs: Sequence[Any]) -> list[Any]:
  """Variables that `eqn_ids` and `outs` read, in first-use order (no duplicates)."""
  seen: dict[Any, None] = {}
  for i in eqn_ids:
    for v in jaxpr.eqns[i].invars:
      if isinstance(v, jcore.Var):
        seen.setdefault(v)
  for v in outs:
    if isinstance(v, jcore.Var):
      seen.setdefault(v)
  return list(seen)


@dataclasses.dataclass
class BackwardSplit:
  """A backward `(residuals, cotangents) -> gradients`, cut into B and W.

  Attributes:
    b_residuals: indices of the residual leaves B reads.
    w_residuals: indices of the residual leaves W reads.
    num_handover: how many values B hands to W.
  """

  jaxpr: jcore.Jaxpr
  consts: list[Any]
  num_residuals: int
  input_outs: list[int]
  weight_outs: list[int]
  b_residuals: list[int]
  w_residuals: list[int]
  num_handover: int
  _b_eqns: list[int]
  _w_eqns: list[int]
  _handover: list[Any]

  def backward_input(self, residuals: Sequence[Any], cotangents: Sequence[Any]
                     ) -> tuple[list[Any], list[Any]]:
    """B: `(residuals[b_residuals], cotangents) -> (input gradient leaves, hand-over)`."""
    j = self.jaxpr
    env = dict(zip(j.constvars, self.consts, strict=True))
    res_vars = j.invars[: self.num_residuals]
    env.update(zip([res_vars[i] for i in self.b_residuals], residuals, strict=True))
    env.update(zip(j.invars[self.num_residuals :], cotangents, strict=True))
    eval_eqns([j.eqns[i] for i in self._b_eqns], env)
    return ([self._out(env, j.outvars[k]) for k in self.input_outs],
            [env[v] for v in self._handover])

  def backward_weight(self, residuals: Sequence[Any], handover: Sequence[Any]) -> list[Any]:
    """W: `(residuals[w_residuals], hand-over) -> parameter gradient leaves`."""
    j = self.jaxpr
    env = dict(zip(j.constvars, self.consts, strict=True))
    res_vars = j.invars[: self.num_residuals]
    env.update(zip([res_vars[i] for i in self.w_residuals], residuals, strict=True))
    env.update(zip(self._handover, handover, strict=True))
    eval_eqns([j.eqns[i] for i in self._w_eqns], env)
    return [self._out(env, j.outvars[k]) for k in self.weight_outs]

  @staticmethod
  def _out(env: dict, v: Any) -> Any:
    if isinstance(v, jcore.Literal):
      return jnp.full(v.aval.shape, v.val, v.aval.dtype)
    return env[v]


def split_backward(
  backward: Any,
  residual_specs: Sequence[jax.ShapeDtypeStruct],
  cotangent_specs: Sequence[jax.ShapeDtypeStruct],
  input_outs: Sequence[int],
  weight_outs: Sequence[int],
) -> BackwardSplit:
  """Traces `backward(residual leaves, cotangent leaves) -> gradient leaves` and cuts it.

  Args:
    backward: the stage's backward as a function of flat leaf lists.
    residual_specs, cotangent_specs: shapes of its two arguments' leaves.
    input_outs: which gradient leaves are input gradients (B's outputs).
    weight_outs: which are parameter gradients (W's outputs).
  """
  traced = jax.make_jaxpr(backward)(list(residual_specs), list(cotangent_specs))
  flat = jax.make_jaxpr(lambda *a: _inline_eval(traced.jaxpr, traced.consts, *a))(
    *residual_specs, *cotangent_specs
  )
  j = flat.jaxpr
  n_res = len(residual_specs)
  weights = [j.outvars[k] for k in weight_outs]
  b_eqns = _needed(j, [j.outvars[k] for k in input_outs])
  b_eqns = _absorb_small_reductions(j, n_res, b_eqns, weights)
  w_eqns = _needed(j, weights, skip=set(b_eqns))
  handover = _handover(j, n_res, b_eqns, w_eqns, weights)
  res_vars = j.invars[:n_res]
  w_read_set = set(_uses(j, w_eqns, weights))
  b_reads = set(_uses(j, b_eqns, [j.outvars[k] for k in input_outs]))
  return BackwardSplit(
    jaxpr=j,
    consts=list(flat.consts),
    num_residuals=n_res,
    input_outs=list(input_outs),
    weight_outs=list(weight_outs),
    b_residuals=[i for i, v in enumerate(res_vars) if v in b_reads],
    w_residuals=[i for i, v in enumerate(res_vars) if v in w_read_set],
    num_handover=len(handover),
    _b_eqns=b_eqns,
    _w_eqns=w_eqns,
    _handover=handover,
  )
