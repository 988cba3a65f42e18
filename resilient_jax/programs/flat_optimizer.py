"""An optax optimizer run on flat buffers, where its own traced program says that is exact.

A stage keeps its parameters, gradient accumulators and optimizer state as a few flat buffers
(`programs.packing.Layout`). An optimizer step over a tree of hundreds of arrays is hundreds of
kernels to compile and as many arrays to pass; over a buffer it is one fused loop. It is exact
when the optimizer updates every element of a buffer by the same elementwise function of that
element's gradient, parameter and per-parameter state, and of state shared by all parameters
(the step count, the learning rate): AdamW, Adam, SGD with momentum, Lion. Python cannot tell
(a mask is a function of the tree; Adafactor factors a moment by the parameter's shape; LAMB
scales by a per-tensor norm), so `FlatOptimizer.of` reads the traced update instead:

  - the update of `optimizer.update(grads, state, params)` on the stage's real shapes is traced
    once and its calls inlined (`jit`, custom derivatives);
  - every value gets a signature (its primitive, parameters and the signatures of its inputs,
    a parameter's own inputs named by their role: its gradient, itself, its state entry
    `0/mu/...`) and an owner (the parameter whose inputs it reads; none for shared state);
  - a parameter is flat when every value its update and new state read is elementwise (a
    whitelisted primitive, its inputs its own or shared scalars) and owned by it alone;
    parameters of equal dtype and signature form a class: the optimizer is the same function
    on each of their elements;
  - where any parameter is not flat (a reduction, a reshape, a value read across parameters),
    or the shared state's update reads a parameter, the optimizer runs per tensor
    (`FlatOptimizer.of` returns None): exact for every optimizer, at the old cost.

`FlatOptimizer.update` then replays each class's function (its representative's slice of the
traced update, with scalars broadcast to the buffer's length) on each buffer of the class: the
layout keeps one optimizer class to a buffer. The shared state is computed once per step.

Costs: the analysis is linear in the traced update's equations, once per stage build; the
compiled step is a loop per buffer (kernels identical for identical chunks are compiled once);
the state is the parameters' bytes per role, as a tree's would be, plus the shared scalars.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

from resilient_jax.checkpoint import universal

ELEMENTWISE = frozenset({
  "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "sqrt", "rsqrt", "cbrt",
  "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square", "tanh", "logistic",
  "select_n", "convert_element_type", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
  "xor", "is_finite", "floor", "ceil", "round", "clamp", "copy", "copy_p", "erf", "erf_inv",
  "sin", "cos", "atan2", "rem", "nextafter", "reduce_precision", "broadcast_in_dim",
})
"""Primitives that compute each output element from the same element of their inputs (and
scalars): the same function on a parameter's elements and on a buffer's."""

_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr"}
"""Primitives that call a jaxpr (inlined by the analysis), and the parameter holding it."""

Ref = Any
"""A value of the inlined update: an int (a variable) or `("lit", value)` (a constant)."""


class _Inlined:
  """A closed jaxpr with its calls inlined: one list of equations over integer variables."""

  def __init__(self, closed: jcore.ClosedJaxpr):
    self.avals: list[Any] = []
    self.eqns: list[tuple[Any, dict, list[Ref], list[int]]] = []
    self.inputs = [self._new(a) for a in closed.in_avals]
    self.outputs = self._inline(closed.jaxpr, [("lit", c) for c in closed.consts], self.inputs)

  def _new(self, aval: Any) -> int:
    self.avals.append(aval)
    return len(self.avals) - 1

  def _inline(self, jaxpr: jcore.Jaxpr, consts: Sequence[Ref], ins: Sequence[Ref]) -> list[Ref]:
    env: dict[Any, Ref] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, ins, strict=True))

    def ref(a: Any) -> Ref:
      return ("lit", a.val) if isinstance(a, jcore.Literal) else env[a]

    for eqn in jaxpr.eqns:
      args = [ref(a) for a in eqn.invars]
      name = eqn.primitive.name
      if name in _CALLS and _CALLS[name] in eqn.params:
        sub = eqn.params[_CALLS[name]]
        closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
        outs = self._inline(closed.jaxpr, [("lit", c) for c in closed.consts], args)
      else:
        outs = [self._new(v.aval) for v in eqn.outvars]
        self.eqns.append((eqn.primitive, dict(eqn.params), args, outs))
      for v, o in zip(eqn.outvars, outs, strict=True):
        env[v] = o
    return [ref(a) for a in jaxpr.outvars]


def _info(r: Ref, sig: dict[int, tuple], owner: list[Any]) -> tuple[tuple, Any]:
  """A value's signature and owner (a constant's: its value, no owner)."""
  if isinstance(r, tuple):
    return _literal_sig(r[1]), None
  return sig[r], owner[r]


def _literal_sig(value: Any) -> tuple:
  arr = np.asarray(value)
  return ("lit", str(arr.dtype), arr.shape, arr.tobytes())


def _signatures(inl: _Inlined, shapes: list[tuple[int, ...]], sig: dict[int, tuple],
                owner: list[Any]) -> set[int]:
  """Fills `sig` and `owner` (the inputs' given) for every value of `inl`'s equations;
  returns the parameters whose values are not elementwise in their own inputs alone."""
  bad: set[int] = set()
  fresh = itertools.count()
  interned: dict[tuple, int] = {}

  def intern(key: tuple) -> tuple:
    return ("=", interned.setdefault(key, len(interned)))

  def info(r: Ref) -> tuple[tuple, Any]:
    return _info(r, sig, owner)

  for prim, params, args, outs in inl.eqns:
    got = [info(a) for a in args]
    owners = {o for _, o in got if o is not None}
    if not owners:  # shared state only: any computation
      try:
        key = (prim.name, repr(sorted(params.items())), tuple(s for s, _ in got))
      except Exception:  # noqa: BLE001 - parameters without a stable text: unique
        key = ("v", next(fresh))
      for j, o in enumerate(outs):
        sig[o], owner[o] = intern((key, j)), None
      continue
    mine = next(iter(owners)) if len(owners) == 1 else -1
    ok = mine != -1 and prim.name in ELEMENTWISE and all(
      tuple(inl.avals[o].shape) in ((), shapes[mine]) for o in outs)
    if ok and prim.name == "broadcast_in_dim":  # of a scalar, or to its own shape
      src = args[0]
      shape = tuple(inl.avals[src].shape) if isinstance(src, int) else np.shape(src[1])
      ok = shape in ((), tuple(inl.avals[outs[0]].shape))
    if not ok:
      bad.update(o for o in owners if o != -1)
      if mine == -1:
        bad.update(o for o in owners)
      for o in outs:
        sig[o], owner[o] = ("opaque", next(fresh)), mine
      continue
    kept = {k: v for k, v in params.items()
            if prim.name != "broadcast_in_dim" or k not in ("shape", "broadcast_dimensions")}
    key = (prim.name, repr(sorted(kept.items())), tuple(s for s, _ in got))
    for j, o in enumerate(outs):
      sig[o], owner[o] = intern((key, j)), mine
  return bad


class FlatOptimizer:
  """`optimizer` on a stage's flat buffers (see the module's docstring); built by `of`.

  Attributes:
    classes: each parameter's optimizer class (parameters of one class may share a buffer).
    template: the optimizer state's structure for the stage's tree (`optimizer.init`'s).
    shared: universal keys of the state entries no parameter owns (step counts).
    roles: each class's per-parameter state entries, as universal-key prefixes (`0/mu/`).
  """

  def __init__(self, optimizer: optax.GradientTransformation,
               abstract: Mapping[str, jax.ShapeDtypeStruct], template: Any,
               inlined: _Inlined, classes: dict[str, int], reps: list[str],
               roles: list[tuple[str, ...]], entry_refs: dict[str, int],
               update_refs: dict[str, Ref], out_refs: dict[str, Ref],
               input_of: dict[tuple, int], shared: tuple[str, ...], owner: list[Any]):
    self.optimizer = optimizer
    self.abstract = dict(abstract)
    self.template = template
    self.classes = classes
    self.shared = shared
    self.roles = roles
    self._inl = inlined
    self._reps = reps
    self._update = update_refs
    self._out = out_refs
    self._input_of = input_of
    self._owner = owner
    self._index = {n: i for i, n in enumerate(sorted(abstract))}
    plans = [self._needed([update_refs[nm]] + [out_refs[role + nm] for role in roles[c]])
             for c, nm in enumerate(reps)]
    everything = set(self._needed([out_refs[k] for k in shared])).union(*plans)
    self._plans = [[e for e in plan if self._owned(e)] for plan in plans]
    self._shared_plan = sorted(e for e in everything if not self._owned(e))

  # ------------------------------------------------------------------ analysis

  @classmethod
  def of(cls, optimizer: optax.GradientTransformation,
         abstract: Mapping[str, jax.ShapeDtypeStruct], template: Any = None
         ) -> FlatOptimizer | None:
    """The flat form of `optimizer` on parameters shaped as `abstract` (a dict by name), or
    None where its update is not the same elementwise function on each element of a class;
    `template`: `optimizer.init`'s state for `abstract` where the caller has it."""
    names = sorted(abstract)
    if not names:
      return None
    try:
      if template is None:
        template = jax.eval_shape(optimizer.init, dict(abstract))
      entries = universal.flatten_state(template)
      closed, out_shape = jax.make_jaxpr(optimizer.update, return_shape=True)(
        dict(abstract), template, dict(abstract))
    except Exception:  # noqa: BLE001 - an optimizer that cannot be traced abstractly
      return None
    index = {n: i for i, n in enumerate(names)}
    keys = list(entries)
    role_of: dict[str, tuple[str, int]] = {}  # entry key -> (role prefix, parameter)
    for k in keys:
      prefix, _, last = k.rpartition("/")
      if last in index and tuple(entries[k].shape) == tuple(abstract[last].shape):
        role_of[k] = (prefix + "/", index[last])
    shared = tuple(k for k in keys if k not in role_of)
    inl = _Inlined(closed)
    n, m = len(names), len(keys)
    if len(inl.inputs) != 2 * n + m:
      return None
    # Inputs: gradients (sorted names), state entries (tree order), parameters (sorted names).
    sig: dict[int, tuple] = {}
    owner: list[Any] = [None] * len(inl.avals)  # None: shared; int: a parameter; -1: several
    input_of: dict[tuple, int] = {}
    for i in range(n):
      g, p = inl.inputs[i], inl.inputs[n + m + i]
      sig[g], owner[g], input_of[("g", i)] = ("g",), i, g
      sig[p], owner[p], input_of[("p", i)] = ("p",), i, p
    for j, k in enumerate(keys):
      v = inl.inputs[n + j]
      if k in role_of:
        role, i = role_of[k]
        sig[v], owner[v], input_of[("s", role, i)] = ("s", role), i, v
      else:
        sig[v], input_of[("c", k)] = ("c", k), v
    bad = _signatures(inl, [tuple(abstract[nm].shape) for nm in names], sig, owner)

    def info(r: Ref) -> tuple[tuple, Any]:
      return _info(r, sig, owner)

    if -1 in owner:
      return None
    # The outputs: updates (sorted names), then the new state in the template's order.
    out_leaves = jax.tree_util.tree_flatten_with_path(out_shape)[0]
    if len(out_leaves) != len(inl.outputs):
      return None
    update_refs: dict[str, Ref] = {}
    out_refs: dict[str, Ref] = {}
    for (path, _), r in zip(out_leaves, inl.outputs, strict=True):
      key = universal._key(path)
      if key.startswith("0/"):
        update_refs[key[2:]] = r
      else:
        out_refs[key[2:]] = r
    if sorted(update_refs) != names or sorted(out_refs) != sorted(keys):
      return None
    for k in shared:  # the shared state's update reads no parameter
      if info(out_refs[k])[1] is not None:
        return None
    class_of: dict[tuple, int] = {}
    classes: dict[str, int] = {}
    reps: list[str] = []
    roles: list[tuple[str, ...]] = []
    for i, nm in enumerate(names):
      mine = sorted(role for k, (role, j) in role_of.items() if j == i)
      refs = [update_refs[nm]] + [out_refs[role + nm] for role in mine]
      if i in bad or any(info(r)[1] != i for r in refs):
        return None  # not elementwise, or an output not computed from its own inputs
      key = (str(abstract[nm].dtype), tuple(mine), tuple(info(r)[0] for r in refs))
      if key not in class_of:
        class_of[key] = len(reps)
        reps.append(nm)
        roles.append(tuple(mine))
      classes[nm] = class_of[key]
    return cls(optimizer, abstract, template, inl, classes, reps, roles,
               {k: inl.inputs[n + j] for j, k in enumerate(keys)}, update_refs, out_refs,
               input_of, shared, owner)

  def _owned(self, e: int) -> bool:
    return self._owner[self._inl.eqns[e][3][0]] is not None

  def _needed(self, refs: Sequence[Ref]) -> list[int]:
    """The equations (in order) computing `refs`."""
    produced = {o: e for e, (_, _, _, outs) in enumerate(self._inl.eqns) for o in outs}
    chosen: set[int] = set()
    stack = [r for r in refs if isinstance(r, int)]
    while stack:
      e = produced.get(stack.pop())
      if e is None or e in chosen:
        continue
      chosen.add(e)
      stack.extend(a for a in self._inl.eqns[e][2] if isinstance(a, int))
    return sorted(chosen)

  # ------------------------------------------------------------------ the step

  def update(self, grads: Sequence[jax.Array], params: Sequence[jax.Array],
             classes: Sequence[int], state: Mapping[str, Any]
             ) -> tuple[list[jax.Array], dict[str, Any]]:
    """One optimizer step on flat buffers (traceable): `grads`/`params` a buffer each, of
    optimizer class `classes[b]`; `state` {"shared": {key: value}, "buffers": [{role:
    buffer}]}. Returns the new parameter buffers and state (as `optax.apply_updates` would
    leave the tree's)."""
    shared_in = state["shared"]
    env: dict[int, Any] = {self._input_of[("c", k)]: shared_in[k] for k in self.shared}
    self._run(self._shared_plan, env, None)
    new_shared = {k: self._value(self._out[k], env) for k in self.shared}
    new_params, new_roles = [], []
    for b, (g, p, c) in enumerate(zip(grads, params, classes, strict=True)):
      nm = self._reps[c]
      i = self._index[nm]
      local = dict(env)
      local[self._input_of[("g", i)]] = g
      local[self._input_of[("p", i)]] = p
      for role in self.roles[c]:
        local[self._input_of[("s", role, i)]] = state["buffers"][b][role]
      self._run(self._plans[c], local, p.shape)
      u = self._value(self._update[nm], local, p.shape)
      new_params.append(jnp.asarray(p + u).astype(p.dtype))
      new_roles.append({role: self._value(self._out[role + nm], local, p.shape)
                        for role in self.roles[c]})
    return new_params, {"shared": new_shared, "buffers": new_roles}

  def _value(self, r: Ref, env: dict[int, Any], shape: tuple[int, ...] | None = None) -> Any:
    if isinstance(r, tuple):
      value = jnp.asarray(r[1])
      return value if shape is None else jnp.broadcast_to(value, shape)
    return env[r]

  def _run(self, plan: Sequence[int], env: dict[int, Any], shape: tuple[int, ...] | None
           ) -> None:
    for e in plan:
      prim, params, args, outs = self._inl.eqns[e]
      vals = [self._value(a, env) for a in args]
      if prim.name == "broadcast_in_dim" and shape is not None and \
          self._owner[outs[0]] is not None:
        if jnp.ndim(vals[0]):  # to its own shape: the buffer already is
          env[outs[0]] = vals[0]
          continue
        params = dict(params, shape=shape, broadcast_dimensions=())
      result = prim.bind(*vals, **params)
      for o, v in zip(outs, result if prim.multiple_results else [result], strict=True):
        env[o] = v
