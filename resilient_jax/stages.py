"""Per-stage programs: F, B, W, BW and OPT, each its own jitted function.

One `StagePrograms` serves every worker of a stage: the programs are traced once and run on
whichever device holds their (committed) inputs, so a data-parallel peer that takes over a
failed worker's micro-batches runs the very same programs on its own device.

- `forward(params, x, targets) -> (out, residuals, saved)`: `out` is the stage output, or for
  the last stage the micro-batch's share of the global mean loss. `residuals` (opaque) is what
  B needs, `saved` the per-layer inputs W needs. A parameter or the stage input among them is
  the caller's array itself, not a copy, and residuals B never reads are not kept.
- `backward_input(residuals, g) -> (dx, taps)`: the input gradient and every tapped layer's
  output cotangent (see `models.layers`); the first stage has no input gradient (dx is None).
- `backward_weight(params, saved, taps, acc) -> acc + grads`: local per-layer parameter vjps,
  no backward chain. Accumulates into `acc` (donated) so a deferred W adds no extra op.
- `backward_fused(residuals, saved, params, g, acc)`: B then W in one program (GPipe, 1F1B).
- `optimizer_step(params, opt_state, grads) -> (params, opt_state)`: this stage's optax update.

Parameters are flat dicts keyed by global parameter names (`blocks.3.mlp.fc.kernel`), so a
stage's parameters, gradients and optimizer state do not depend on how the model was cut.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.extend import core as jcore

from models.layers import FlatBinder, Tape, flat_params, tapped_layers

Array = jax.Array
Params = dict[str, Array]


@dataclasses.dataclass(frozen=True)
class StageInfo:
  index: int
  num_stages: int
  layers: range

  @property
  def first(self) -> bool:
    return self.index == 0

  @property
  def last(self) -> bool:
    return self.index == self.num_stages - 1


def _live_inputs(jaxpr: jcore.Jaxpr, live_out: Sequence[bool] | None = None) -> list[bool]:
  """Which inputs of `jaxpr` its (live) outputs depend on, looking inside nested jits."""
  outs = jaxpr.outvars
  live = {v for v, keep in zip(outs, live_out or [True] * len(outs), strict=True) if keep}
  live = {v for v in live if isinstance(v, jcore.Var)}
  for eqn in reversed(jaxpr.eqns):
    needed = [v in live for v in eqn.outvars]
    if not any(needed) and not eqn.effects:
      continue
    inner = eqn.params.get("jaxpr")
    if eqn.primitive.name in ("jit", "pjit") and isinstance(inner, jcore.ClosedJaxpr):
      used = _live_inputs(inner.jaxpr, needed)
    else:
      used = [True] * len(eqn.invars)
    live.update(v for v, u in zip(eqn.invars, used, strict=True) if u and isinstance(v, jcore.Var))
  return [v in live for v in jaxpr.invars]


class StagePrograms:
  """The jitted programs of one pipeline stage.

  Args:
    model: a `models.gpt.StageableModel` (its current parameter values are the initial ones).
    info: which stage and which layers.
    input_spec: shape/dtype of one micro-batch's stage input.
    target_spec: shape/dtype of one micro-batch's targets (used by the last stage).
    optimizer: any optax transformation; applied per stage, so it must act per parameter
      (AdamW, SGD, schedules; not global-norm clipping across stages).
    loss_scale: multiplies the last stage's summed token losses (1 / tokens in the global
      batch), so summing micro-batch losses and gradients gives the global mean.
  """

  def __init__(
    self,
    model: Any,
    info: StageInfo,
    input_spec: jax.ShapeDtypeStruct,
    target_spec: jax.ShapeDtypeStruct,
    optimizer: optax.GradientTransformation,
    loss_scale: float,
  ):
    self.info = info
    self.optimizer = optimizer
    module = model.make_stage(info.layers, first=info.first, last=info.last)
    self._binder = FlatBinder(module)
    self.param_names: tuple[str, ...] = tuple(sorted(self._binder.order))
    self._initial = {n: np.asarray(v) for n, v in flat_params(module).items()}
    self.input_spec = input_spec
    self.target_spec = target_spec
    loss_fn = model.loss

    def apply(tape: Tape, params: Params, x: Array, targets: Array | None) -> Array:
      with tape:
        out = self.bind(params)(x)
      if info.last:
        out = loss_fn(out, targets).sum() * jnp.float32(loss_scale)
      return out

    def run(params: Params, x: Array, taps: dict[str, Array], targets: Array | None):
      tape = Tape(taps)
      return apply(tape, params, x, targets), tape.inputs

    discovered = Tape()
    self.output_spec: jax.ShapeDtypeStruct = jax.eval_shape(
      lambda p, x, t: apply(discovered, p, x, t), self.abstract_params(), input_spec, target_spec
    )
    tap_specs = dict(discovered.shapes)

    argnums = (2,) if info.first else (1, 2)
    fwd, bwd = jax.fwd_and_bwd(run, argnums=argnums, has_aux=True, jitted=False)

    def forward_all(params, x, targets):
      zeros = {k: jnp.zeros(s.shape, s.dtype) for k, s in tap_specs.items()}
      return fwd(params, x, zeros, targets)

    def backward_all(residuals, g):
      grads = bwd(residuals, g)
      return (None, grads[0]) if info.first else (grads[0], grads[1])

    # What F hands to B and W is trimmed once, on F's jaxpr, rather than copied out of a jit as
    # is: a parameter or the stage input among the residuals would come back as a fresh copy
    # per micro-batch (the residuals of `x @ kernel` include the kernel), and some residuals
    # are dead in B (XLA drops them from B, but F would still keep them alive until B).
    targets_spec = target_spec if info.last else None
    closed, (out_tree, res_tree, saved_tree) = jax.make_jaxpr(forward_all, return_shape=True)(
      self.abstract_params(), input_spec, targets_spec
    )
    res_def = jax.tree.structure(res_tree)
    res_specs = jax.tree.leaves(res_tree)
    n_out, n_res = len(jax.tree.leaves(out_tree)), len(res_specs)
    b_jaxpr = jax.make_jaxpr(
      lambda leaves, g: backward_all(jax.tree.unflatten(res_def, leaves), g)
    )(res_specs, self.output_spec)
    res_live = _live_inputs(b_jaxpr.jaxpr)[:n_res]
    # Per output leaf of F: ("input", i) forwards input leaf i, ("kept", j) is output j of the
    # trimmed program, ("dead", spec) a residual B never reads (B gets zeros, which XLA drops).
    in_index = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    kept: list[int] = []  # positions of the outputs the trimmed program returns
    first_at: dict[Any, int] = {}  # each distinct variable is returned once
    sources: list[tuple[str, Any]] = []
    for k, v in enumerate(closed.jaxpr.outvars):
      is_var = isinstance(v, jcore.Var)
      if n_out <= k < n_out + n_res and not res_live[k - n_out]:
        sources.append(("dead", res_specs[k - n_out]))
      elif is_var and v in in_index:
        sources.append(("input", in_index[v]))
      elif is_var and v in first_at:
        sources.append(("kept", first_at[v]))
      else:
        if is_var:
          first_at[v] = len(kept)
        sources.append(("kept", len(kept)))
        kept.append(k)
    forward_all_flat = jcore.jaxpr_as_fun(closed)

    def stage_forward(*inputs):
      outs = forward_all_flat(*inputs)
      return [outs[k] for k in kept]

    forward_program = jax.jit(stage_forward)
    out_def, saved_def = jax.tree.structure(out_tree), jax.tree.structure(saved_tree)
    not_dead = [src for src in sources if src[0] != "dead"]
    n_live = sum(res_live)
    dead_specs = [src[1] if src[0] == "dead" else None for src in sources[n_out : n_out + n_res]]

    def forward(params, x, targets):
      inputs = jax.tree.leaves((params, x, targets if info.last else None))
      outs = forward_program(*inputs)
      leaves = [outs[i] if kind == "kept" else inputs[i] for kind, i in not_dead]
      out = jax.tree.unflatten(out_def, leaves[:n_out])
      residuals = tuple(leaves[n_out : n_out + n_live])
      saved = jax.tree.unflatten(saved_def, leaves[n_out + n_live :])
      return out, residuals, saved

    def backward_input(residuals, g):
      live = iter(residuals)
      leaves = [next(live) if d is None else jnp.zeros(d.shape, d.dtype) for d in dead_specs]
      return backward_all(jax.tree.unflatten(res_def, leaves), g)

    def weight_grads(params, saved, taps, acc):
      layers = tapped_layers(self.bind(params))
      out = dict(acc)
      for key, g in taps.items():
        name, kind = key.rsplit(":", 1)
        for k, v in layers[name].param_grads(saved[key], g, kind).items():
          out[f"{name}.{k}"] = out[f"{name}.{k}"] + v
      return out

    def backward_fused(residuals, saved, params, g, acc):
      dx, taps = backward_input(residuals, g)
      return dx, weight_grads(params, saved, taps, acc)

    def optimizer_step(params, opt_state, grads):
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    self.forward: Callable = forward
    self.backward_input: Callable = jax.jit(backward_input)
    self.backward_weight: Callable = jax.jit(weight_grads, donate_argnums=(3,))
    self.backward_fused: Callable = jax.jit(backward_fused, donate_argnums=(4,))
    # Not donated: a step whose worker dies after some optimizer steps ran is re-run from the
    # committed parameters, so the old ones must survive until the step commits.
    self.optimizer_step: Callable = jax.jit(optimizer_step)
    self._init_opt = jax.jit(optimizer.init)
    self._zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))

  def bind(self, params: Params) -> nnx.Module:
    """The stage module with `params` as its parameters (usable inside a trace)."""
    return self._binder(params)

  def abstract_params(self) -> dict[str, jax.ShapeDtypeStruct]:
    return {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in self._initial.items()}

  def initial_params(self, device: jax.Device) -> Params:
    return {n: jax.device_put(v, device) for n, v in self._initial.items()}

  # Outputs that do not depend on input values come back uncommitted; placing them on the
  # worker's device keeps every later call on the same compiled program.
  def init_opt_state(self, params: Params, device: jax.Device) -> Any:
    return jax.device_put(self._init_opt(params), device)

  def zero_grads(self, params: Params, device: jax.Device) -> Params:
    return jax.device_put(self._zeros(params), device)


def build_stage_programs(
  model: Any,
  partition: Sequence[range],
  microbatch_size: int,
  seq_len: int,
  optimizer: optax.GradientTransformation,
  global_tokens: int,
) -> list[StagePrograms]:
  """Programs for every stage, chaining each stage's output shape into the next one's input."""
  tokens = jax.ShapeDtypeStruct((microbatch_size, seq_len), jnp.int32)
  spec = tokens
  programs = []
  for s, layers in enumerate(partition):
    info = StageInfo(index=s, num_stages=len(partition), layers=layers)
    prog = StagePrograms(model, info, spec, tokens, optimizer, 1.0 / global_tokens)
    programs.append(prog)
    spec = prog.output_spec
  return programs
