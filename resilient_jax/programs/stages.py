"""Per-stage programs: F, B, W, BW and OPT, each its own jitted function.

One `StagePrograms` serves every worker of a stage: the programs are traced and compiled once
and loaded on whichever device holds their (committed) inputs (`compiled.OnEachDevice`), so a
data-parallel peer that takes over a failed worker's micro-batches runs the very same programs
on its own device, and the compile count does not grow with data parallelism.

- `forward(params, x, batch, seeds) -> (out, residuals, saved)`: `x` is what the previous
  stage handed on (None on the first), `batch` the micro-batch's entries the stage reads
  (`batch_keys`: the first stage's inputs, the last stage's targets, and wherever a value is
  recomputed from the batch rather than sent, its sources); `out` is the values live across
  the stage's cut as one array (`model.cut`), or for the last stage the micro-batch's share of
  the global mean loss. `residuals` are what B reads,
  `saved` what W reads (`model.split`), each a `Kept`: on one device the residuals F computed
  packed into a few buffers (`programs.packing`; JAX's call costs host time per array, and a
  stage has hundreds of residuals), a parameter or the stage input among them the caller's
  array itself, not a copy; residuals neither reads are not kept. `seeds`
  (`(step, sample id)` per sample) are read only by a model that draws random numbers.
- `backward_input(residuals, g) -> (dx, handover)`: the input gradient and the values W needs
  of B's work (the cotangents flowing back through the stage, packed on one device); the first
  stage has no input gradient (dx is None) and its B is empty: the whole backward is W's, off
  the critical path.
- `backward_weight(params, saved, handover, acc) -> acc + grads`: the rest of the backward,
  no recomputation of B's. Accumulates into `acc` (donated) so a deferred W adds no extra op.
  On one device `acc` is packed (`zero_grads` makes it; `acc[name]` reads one gradient).
- `backward_fused(residuals, saved, params, g, acc)`: B then W in one program (GPipe, 1F1B).
- `optimizer_step(params, opt_state, grads, owned, scale=None) -> (params, opt_state, sumsq)`:
  this stage's optax update, of the gradients times `scale` (the global clip factor) when given,
  and the sum of squares of the gradients whose `owned` weight is 1 (its share of the norm).
  On one device the parameters, gradients and optimizer state are flat buffers
  (`programs/state.py`): the optimizer steps each buffer as one loop where its traced update
  allows (`programs/flat_optimizer.py`), else per tensor on the buffers' views.

Each program traces under a named scope of its op (`F`, `B`, `W`, `BW`, `OPT`): its compiled ops
carry the name, so a `jax.profiler` trace shows which kind of op a device was running; the stage
and micro-batch are the host's annotation (`runtime/interpreter.py`). The scope leaves the stage
out on purpose: stages of the same shape (the middle stages of an even split) then lower to
the same program, which is compiled once and kept once (`compiled.OnEachDevice`), however many
stages run it.

Parameters are flat dicts keyed by global parameter names (their paths in the model,
`blocks.3.mlp.fc.kernel`), so a stage's parameters, gradients and optimizer state do not depend
on how the model was cut.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.extend import core as jcore

from resilient_jax.checkpoint import universal
from resilient_jax.model import sharding
from resilient_jax.model.cut import LossCut, Segment
from resilient_jax.model.sharding import Where
from resilient_jax.model.split import split_backward
from resilient_jax.model.staging import flat_params, variable_names
from resilient_jax.programs import packing
from resilient_jax.programs.compiled import RUN_ONCE, OnEachDevice
from resilient_jax.programs.residuals import Call, Residuals
from resilient_jax.programs.state import FlatEntries, StateLayout, params_of, sumsq_of

Array = jax.Array
Params = dict[str, Array]


@dataclasses.dataclass(frozen=True)
class StageInfo:
  index: int
  num_stages: int
  layers: range
  split: tuple[range, ...] = ()
  """Every stage's blocks (the whole layer split this stage is one of)."""

  @property
  def first(self) -> bool:
    return self.index == 0

  @property
  def last(self) -> bool:
    return self.index == self.num_stages - 1


class StagePrograms:
  """The jitted programs of one pipeline stage.

  Args:
    model: the model (see `resilient_jax.model`); its current parameter values are the
      initial ones.
    info: which stage and which blocks.
    cut: the model's loss traced on one micro-batch and cut at its blocks (`cut.LossCut`),
      shared by every stage of every split.
    optimizer: any optax transformation; applied per stage, so it must act per parameter
      (AdamW, SGD, schedules; not global-norm clipping across stages).
    global_batch: samples per step; the last stage scales its summed losses by one over the
      loss elements of the global batch, so summing micro-batch losses and gradients gives the
      step's mean loss.
    names: global variable names of `model` (`model.variable_names`), computed once per model.
    tp: devices of a worker's sub-mesh (tensor parallelism inside the stage).
  """

  def __init__(
    self,
    model: Any,
    info: StageInfo,
    cut: LossCut,
    optimizer: optax.GradientTransformation,
    global_batch: int,
    names: dict[int, str] | None = None,
    tp: int = 1,
  ):
    self.info = info
    self.tp = tp
    self.packed = tp == 1
    """Whether residuals and gradients travel packed (`programs.packing`): on one device."""
    self.optimizer = optimizer
    names = variable_names(model) if names is None else names
    self.segment: Segment = cut.segments(info.split)[info.index]
    seg = self.segment
    self.input_spec: jax.ShapeDtypeStruct | None = None if info.first else seg.carry_in.spec
    """What the stage receives from the previous one (the values live across the cut, as one
    array: `cut.Carry`); None on the first stage, which reads only the batch."""
    self.batch_specs = {k: cut.batch_specs[k] for k in seg.batch_keys}
    """The micro-batch entries the stage reads (by key), at one micro-batch's shapes."""
    self.batch_keys: tuple[str, ...] = seg.batch_keys
    self.uses_rng: bool = seg.reads_seeds
    """Whether the stage reads the per-sample seeds (it draws random numbers)."""
    self.microbatch = cut.microbatch
    self._init_parameters(model, names, seg.param_names, cut)
    apply, arg_specs = self._stage_function(cut, global_batch)
    self.output_spec: jax.ShapeDtypeStruct = jax.eval_shape(apply, *arg_specs)
    closed, out_tree = self._split_backward(apply, arg_specs)
    self._build_forward(closed, out_tree)
    self._build_backward_and_optimizer()

  def _init_parameters(self, model: nnx.Module, names: dict[int, str], used: Sequence[str],
                       cut: LossCut) -> None:
    """The stage's initial parameter values (those of `used`, the parameters its equations
    read), their shapes, and how they and the optimizer state split over a worker's
    sub-mesh."""
    self._initial = flat_params(model, names, only=set(used))
    self.param_names: tuple[str, ...] = tuple(sorted(self._initial))
    self._shapes = shapes = {n: v.shape for n, v in self._initial.items()}
    self._abstract = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in self._initial.items()}
    axes = sharding.logical_axes(model, names)
    self.param_specs = sharding.partition_specs({n: axes[n] for n in shapes}, shapes, self.tp)
    """Each parameter's split over the worker's sub-mesh (all replicated when `tp` is 1)."""
    self.opt_template = jax.eval_shape(self.optimizer.init, self.abstract_params())
    """The optimizer state's structure, shapes and dtypes (of the parameters as a tree: what
    checkpoints hold, by universal key, whatever the layout in memory)."""
    self.state: StateLayout | None = StateLayout(
      self._abstract, self.optimizer, {n: cut.block_of(n) for n in shapes},
      self.opt_template) if self.packed else None
    """On one device, how the stage's parameters, gradients and optimizer state lie in a few
    flat buffers (`programs.state`)."""
    self.layout: packing.Layout | None = self.state.layout if self.state else None
    self.flat_opt = self.state.flat if self.state else None
    """The optimizer on flat buffers (`programs.flat_optimizer`), where its traced update says
    that is exact; None: it runs per tensor (inside OPT, on the buffers' views)."""
    self.opt_keys: tuple[str, ...] = tuple(universal.flatten_state(self.opt_template))
    self.opt_specs = universal.unflatten_state(self.opt_template, {
      k: sharding.opt_entry_spec(k, v.shape, self.param_specs, shapes)
      for k, v in universal.flatten_state(self.opt_template).items()})

  def _stage_function(self, cut: LossCut, global_batch: int) -> tuple[Callable, tuple]:
    """What the stage computes, `apply(params, x, batch, seeds)`: its segment of the traced
    loss, the values carried in unpacked from `x` and those carried out packed into one array;
    on the last stage the micro-batch's share of the global mean loss.

    Returns:
      `apply` and the specs of its arguments (x None on the first stage, seeds None where the
      stage draws no random numbers).
    """
    seg, info = self.segment, self.info
    seeds_spec = jax.ShapeDtypeStruct((self.microbatch, 2), jnp.int32) if self.uses_rng \
      else None
    loss_scale = 0.0
    if info.last:
      loss_scale = self.microbatch / (global_batch * max(math.prod(cut.loss_spec.shape), 1))
    self.loss_scale: float = loss_scale
    """What F scales its micro-batch's summed losses by: one over the loss elements of the
    global batch."""
    self.weighted: bool = info.last and seg.weighted
    """Whether the loss weighs its elements (`cut.loss_terms`): then the step's loss and its
    gradients are scaled by `loss_factor`, known before the step."""
    if self.weighted:
      total = cut.weight_sum()
      self._weight_keys = tuple(cut.batch_specs)
      self.weight_sum = jax.jit(lambda b, s: jax.vmap(total)(b, s).sum())

    def apply(params: Params, x: Array | None, batch: dict, seeds: Array | None) -> Array:
      xs = [] if x is None else seg.carry_in.unpack(x)
      out = seg(params, xs, batch, seeds)
      if not info.last:
        return seg.carry_out.pack(out)
      losses, weights = out
      summed = (losses if weights is None else losses * weights).astype(jnp.float32).sum()
      return summed * jnp.float32(loss_scale)

    return apply, (self.abstract_params(), self.input_spec, self.batch_specs, seeds_spec)

  def loss_factor(self, batch: dict[str, np.ndarray], seeds: np.ndarray | None) -> float:
    """What a step's summed micro-batch losses (and so its loss gradient, the seed of the
    backward) are multiplied by to be the mean over the step's samples (`batch`: every entry
    `[micro-batches, samples, ...]`): 1, or for a weighted loss the loss elements over the sum
    of the weights (`sum(w * l) / sum(w)`). A host computation per step, on the whole step's
    batch: every process derives the same factor from the same samples."""
    if not self.weighted:
      return 1.0
    total = float(self.weight_sum({k: batch[k] for k in self._weight_keys}, seeds))
    return 1.0 / (self.loss_scale * total) if total > 0 else float("nan")

  def apply_stage(self, params: Params, x: Array | None, batch: dict,
                  seeds: Array | None = None) -> Array:
    """The stage's output (its carried values, as one array; the last stage's loss terms)
    for input `x` with `params`, inside or outside a trace."""
    xs = [] if x is None else self.segment.carry_in.unpack(x)
    out = self.segment(params, xs, batch, seeds)
    return out if self.info.last else self.segment.carry_out.pack(out)

  def _split_backward(self, apply: Callable, arg_specs: tuple) -> tuple[jcore.ClosedJaxpr, Any]:
    """Traces F and its backward once and cuts the backward into B and W (`model.split`,
    kept as `self.split`).

    Returns:
      F's closed jaxpr (its outputs: the stage output's leaves, then the residuals) and the
      stage output's tree.
    """
    argnums = (0,) if self.info.first else (0, 1)
    fwd, bwd = jax.fwd_and_bwd(apply, argnums=argnums, jitted=False)
    closed, (out_tree, res_tree) = jax.make_jaxpr(fwd, return_shape=True)(*arg_specs)
    res_def = jax.tree.structure(res_tree)
    n_params = len(self.param_names)
    self.split = split_backward(
      lambda res, g: jax.tree.leaves(bwd(jax.tree.unflatten(res_def, res), g[0])),
      jax.tree.leaves(res_tree),
      [self.output_spec],
      input_outs=[] if self.info.first else [n_params],
      weight_outs=list(range(n_params)),
    )
    return closed, out_tree

  def _build_forward(self, closed: jcore.ClosedJaxpr, out_tree: Any) -> None:
    """F as one compiled program returning only what B and W read, and `forward`, which puts
    the caller's own arrays back where F's outputs forward them (`programs.residuals`)."""
    split = self.split
    n_out = len(jax.tree.leaves(out_tree))
    self._kept = kept = Residuals(closed, n_out, split.b_residuals, split.w_residuals,
                                  self.param_names, self.packed)
    forward_all = jcore.jaxpr_as_fun(closed)
    out_def = jax.tree.structure(out_tree)
    n_params = len(self.param_names)

    layout = self.layout
    n_buf = len(layout.groups) if layout is not None else 0

    def stage_forward(*inputs):
      if layout is not None:  # the parameters' views of their buffers
        inputs = (*layout.unpack(inputs[:n_buf]), *inputs[n_buf:])
      return kept.outputs(forward_all(*inputs))

    forward_program = OnEachDevice(_scoped("F", stage_forward))
    held = {src for src in kept.sources[n_out:]
            if src is not None and (src[0] == "kept" or src[1] >= n_params)}
    avals = {("kept", j): closed.out_avals[k] for j, k in enumerate(kept.kept)}
    avals.update({("input", i): a for i, a in enumerate(closed.in_avals)})
    self.activation_bytes: int = sum(
      int(np.prod(avals[src].shape)) * avals[src].dtype.itemsize for src in held)
    """Bytes a micro-batch's forward leaves alive until its backward: the residuals B and W
    read, the stage input among them, not the parameters (whole arrays, however a sub-mesh
    splits them). What `model.remat` shrinks and what the planner's in-flight cap weighs."""

    keys = self.batch_keys

    def forward(params, x, batch, seeds=None):
      inputs = jax.tree.leaves((params, x, {k: batch[k] for k in keys},
                                seeds if self.uses_rng else None))
      outs = forward_program(*inputs)
      if layout is not None:  # F's inputs as its jaxpr numbers them (parameters by name)
        inputs = [None] * n_params + inputs[n_buf:]
      out, residuals, saved = kept.kept_for(inputs, params, *outs)
      return jax.tree.unflatten(out_def, out), residuals, saved

    self.forward: Callable = forward
    self._forward_program = forward_program

  def _build_backward_and_optimizer(self) -> None:
    """B, W, BW and OPT, and the optimizer-state and zero-gradient initializers, each compiled
    once for the stage and loaded on every replica's device.

    On one device the parameters and gradients are `packing.Packed` in the stage's state layout
    (`programs/state.py`: a buffer per block and dtype) and `owned` a weight per buffer; OPT
    steps the buffers (`StateLayout.step`).
    """
    split, optimizer, tp = self.split, self.optimizer, self.tp
    pin = self._pin  # outputs constrained to the sub-mesh split (identity when tp is 1)
    names = self.param_names
    grad_layout = self.layout

    def accumulate(acc, grads):
      if not self.packed:
        return pin({n: acc[n] + g for n, g in zip(names, grads, strict=True)}, self.param_specs)
      return jax.tree.map(jnp.add, acc, packing.Packed(grad_layout, grad_layout.pack(grads)))

    def input_grads(kept, g, params=None):
      dx, handover = split.backward_input(self._kept.read("b", kept, params), [g])
      return (dx[0] if dx else None), list(handover)

    def accumulated(kept, handover, acc, params=None):
      return accumulate(acc, split.backward_weight(self._kept.read("w", kept, params), handover))

    def backward_input(kept, g):
      dx, handover = input_grads(kept, g)
      if self.packed and handover:  # what W reads of B's work, as one buffer per dtype
        layout = packing.Layout.of_avals(handover)
        return dx, packing.Packed(layout, layout.pack(handover))
      return dx, tuple(handover)

    def weight_grads(kept, handover, acc):
      if isinstance(handover, packing.Packed):
        handover = handover.layout.unpack(handover.buffers)
      return accumulated(kept, list(handover), acc)

    def backward_fused(kept_b, kept_w, params, g, acc):
      dx, handover = input_grads(kept_b, g, params)
      return dx, accumulated(kept_w, handover, acc, params)

    def optimizer_step(params, opt_state, grads, owned, scale=None):
      # The sum of squares of the gradients `owned` weighs 1 (this slot's share of the global
      # norm) in the same program, so the gradients are read once; a traced weight, not a
      # static name list, so every replica of a stage shares one compiled program.
      if self.packed:
        return self.state.step(optimizer, params, opt_state, grads, owned, scale)
      sumsq = sum(owned[n] * jnp.sum(jnp.square(g.astype(jnp.float32))) for n, g in grads.items())
      if scale is not None:  # the global-norm clip factor (`Interpreter`)
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (pin(optax.apply_updates(params, updates), self.param_specs),
              pin(opt_state, self.opt_specs), sumsq)

    scoped = functools.partial(_scoped, tp=tp)
    b_program = OnEachDevice(scoped("B", backward_input))
    w_program = OnEachDevice(scoped("W", weight_grads), donate_argnums=(2,))
    bw_program = OnEachDevice(scoped("BW", backward_fused), donate_argnums=(4,))
    self._backward_programs = [b_program, w_program, bw_program]
    # The module docstring's signatures; W reads the parameters among its residuals
    # (`Kept.params`), BW those both halves read, once.
    self.backward_input: Callable = Call(b_program, lambda kept, g: (kept, g))
    self.backward_weight: Callable = Call(
      w_program, lambda params, kept, handover, acc: (kept, handover, acc))
    self.backward_fused: Callable = Call(
      bw_program, lambda kept_b, kept_w, params, g, acc: (
        kept_b._replace(params={}), kept_w._replace(params={}),
        params_of(kept_b.params, kept_w.params), g, acc))
    # Not donated: a step whose worker dies after some optimizer steps ran is re-run from the
    # committed parameters, so the old ones must survive until the step commits.
    self.optimizer_step: Callable = OnEachDevice(scoped("OPT", optimizer_step))
    self._build_state_programs()

  def _build_state_programs(self) -> None:
    """The optimizer-state and zero-gradient initializers, and on one device the programs that
    pack another layout's state into this one's."""
    optimizer, tp, pin, layout = self.optimizer, self.tp, self._pin, self.layout
    # On a sub-mesh they run there and make their outputs split (`keep_unused`); on one device
    # they stay the programs they were (their outputs are placed afterwards).
    self._init_opt = OnEachDevice(_on_submesh(
      lambda p: self.state.opt_from_entries(universal.flatten_state(optimizer.init(p.unpacked())))
      if self.packed else pin(optimizer.init(p), self.opt_specs), tp), keep_unused=tp > 1,
      compiler_options=RUN_ONCE)
    if self.packed:  # state from other layouts (a checkpoint, another split's slots): rare
      self._pack = OnEachDevice(lambda d: packing.Packed(
        layout, layout.pack([d[n] for n in layout.names])), compiler_options=RUN_ONCE)
      self._pack_opt = OnEachDevice(self.state.opt_from_entries, compiler_options=RUN_ONCE)
    # Kept arguments on one device too: its zeros then come back committed to the slot's
    # device, made there, instead of on the default device and copied (`zero_grads` runs for
    # every slot at every step, and placing a whole tree cost milliseconds of host time). On
    # one device it reads one buffer (to be placed with it) and makes the packed buffers.
    zeros = (lambda _: packing.Packed(layout, [jnp.zeros((n,), d) for n, d in zip(
      layout.sizes, layout.groups, strict=True)])) if self.packed else \
      _on_submesh(lambda p: pin(jax.tree.map(jnp.zeros_like, p), self.param_specs), tp)
    self._zeros = OnEachDevice(zeros, keep_unused=True, compiler_options=RUN_ONCE)  # a memset

  def abstract_state(self) -> tuple[packing.Packed, Any]:
    """The shapes and dtypes of the stage's packed parameters and optimizer state (one
    device)."""
    if not hasattr(self, "_abstract_state"):
      params = packing.Packed(self.layout, [jax.ShapeDtypeStruct((n,), d) for n, d in zip(
        self.layout.sizes, self.layout.groups, strict=True)])
      self._abstract_state = (params, jax.eval_shape(self._init_opt._jit, params))
    return self._abstract_state

  def opt_entries(self, opt_state: Any) -> Mapping[str, Any]:
    """`opt_state`'s entries by universal key (`checkpoint.universal`), whatever the layout;
    a flat state's are read lazily, each when asked for."""
    return universal.flatten_state(opt_state) if self.state is None else \
      self.state.opt_entries(opt_state)

  def state_from(self, params: Mapping[str, Any], entries: Mapping[str, Any], where: Where
                 ) -> tuple[Any, Any]:
    """The stage's parameters and optimizer state at `where` from another holder's
    (`params` by name, `entries` by universal key, any layout: another split's, a
    checkpoint's): one copy of the buffers when the holder's layout is this one, else
    gathered by name and packed here."""
    if not self.packed:
      raise ValueError("a sub-mesh's state is placed by name (`Interpreter.place`)")
    if isinstance(params, packing.Packed) and params.layout == self.layout:
      p = jax.device_put(params, where)
    else:
      p = self._pack(jax.device_put({n: params[n] for n in self.param_names}, where))
    if isinstance(entries, FlatEntries) and entries.layout == self.layout:
      opt = jax.device_put(entries.state, where)
    elif self.flat_opt is None:  # the optimizer's own tree: placed as it is, no program
      opt = jax.device_put(universal.unflatten_state(self.opt_template, entries,
                                                     what="optimizer state"), where)
    else:
      opt = self._pack_opt(jax.device_put({k: entries[k] for k in self.opt_keys}, where))
    return p, opt

  def _pin(self, tree: Any, specs: Any) -> Any:
    """`tree` constrained to `specs` on a sub-mesh; unchanged when `tp` is 1."""
    return tree if self.tp == 1 else sharding.constrain(tree, specs)

  def compiled_programs(self) -> list[OnEachDevice]:
    """The stage's jitted programs (each compiled once, loaded on every other device); one
    replaced by a wrapper of its own (a test poisoning a step) is not among them."""
    programs = [self._forward_program, *self._backward_programs, self.optimizer_step,
                self._init_opt, self._zeros]
    calls = {id(c.program) for c in (self.backward_input, self.backward_weight,
                                     self.backward_fused) if isinstance(c, Call)}
    return [p for p in programs if isinstance(p, OnEachDevice)
            and (p not in self._backward_programs or id(p) in calls)]

  def abstract_params(self) -> dict[str, jax.ShapeDtypeStruct]:
    return dict(self._abstract)

  def for_model(self, model: Any, names: dict[int, str]) -> StagePrograms:
    """These programs, starting from `model`'s parameter values (a model of the same
    `model_signature`): the compiled programs are shared, only the initial values differ."""
    other = copy.copy(self)
    other._initial = flat_params(model, names, only=self._shapes)
    return other

  # `where` is a worker's `model.sharding.Where`: its device (tp=1), or its sub-mesh, over
  # which whole arrays are replicated and parameter-shaped ones split by `param_specs`.

  def param_shardings(self, where: Where) -> Any:
    """Where each parameter (and its gradient) lives on the worker at `where` (one device:
    `where`, for every buffer)."""
    if self.packed:
      return where
    return {n: sharding.sharding_of(where, s) for n, s in self.param_specs.items()}

  def opt_shardings(self, where: Where) -> Any:
    """Where each optimizer state leaf lives on the worker at `where` (a tree like the state;
    one device: `where`)."""
    if self.packed:
      return where
    return jax.tree.map(lambda s: sharding.sharding_of(where, s), self.opt_specs,
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))

  def param_sharding(self, name: str, where: Where) -> Where:
    return sharding.sharding_of(where, self.param_specs[name])

  def opt_entry_sharding(self, key: str, shape: tuple[int, ...], where: Where) -> Where:
    """Where an optimizer entry (universal key) of `shape` lives on the worker at `where`."""
    return sharding.sharding_of(
      where, sharding.opt_entry_spec(key, shape, self.param_specs, self._shapes))

  def initial_params(self, where: Where) -> Any:
    """The model's initial values, at `where`: packed (`layout`) on one device, packed on the
    host (no program), then copied."""
    if not self.packed:
      return jax.device_put(self._initial, self.param_shardings(where))
    return jax.device_put(self.state.pack_host(self._initial), where)

  # Outputs that do not depend on input values come back uncommitted; placing them on the
  # worker's device keeps every later call on the same compiled program.
  def init_opt_state(self, params: Params, where: Where) -> Any:
    return jax.device_put(self._init_opt(params), self.opt_shardings(where))

  def norm_weights(self, owned: Iterable[str], where: Where) -> Any:
    """`optimizer_step`'s `owned`: 1 for the names this slot counts into the global norm (a
    weight per buffer on one device, `owned_apart` the rest; a weight per name on a
    sub-mesh)."""
    names = set(owned)
    if self.packed:  # a weight per buffer (`StateLayout.norm_weights`)
      return jax.device_put(self.state.norm_weights(names), where)
    return {n: jax.device_put(jnp.float32(n in names), where) for n in self.param_names}

  def owned_apart(self, owned: Iterable[str]) -> tuple[str, ...]:
    """`StateLayout.owned_apart` (none on a sub-mesh, whose weights are per name)."""
    return self.state.owned_apart(owned) if self.packed else ()

  def sumsq_of(self, grads: Any, names: tuple[str, ...]) -> jax.Array:
    """The sum of squares of `names`' gradients (one program per set of names)."""
    return sumsq_of(names)(grads)

  def zero_grads(self, params: Params, where: Where) -> Any:
    """Zero gradients for `params` (which live at `where`), made on their device: packed
    (`packing.Packed`) on one device, shaped and split as `params` on a sub-mesh."""
    if self.packed:  # one parameter says where; committed there already
      first = params.buffers[0] if isinstance(params, packing.Packed) and params.buffers else \
        next(iter(params.values()), None)
      return self._zeros(first if first is not None else
                         jax.device_put(np.float32(0), where))
    return jax.device_put(self._zeros(params), self.param_shardings(where))


def _scoped(name: str, fn: Callable, tp: int = 1) -> Callable:
  """`fn`, traced under `jax.named_scope(name)` (same name for `jax.jit`) and, with `tp > 1`,
  against the shape of a worker's sub-mesh."""

  @functools.wraps(fn)
  def scoped(*args):
    with jax.named_scope(name):
      return fn(*args)

  return _on_submesh(scoped, tp)


def _on_submesh(fn: Callable, tp: int) -> Callable:
  """`fn` traced under the abstract mesh of a `tp`-device sub-mesh (so its sharding constraints
  name the axis `tp`, not devices: every worker's sub-mesh runs the same program); `fn` itself
  when `tp` is 1."""
  if tp == 1:
    return fn
  mesh = sharding.abstract_mesh(tp)

  @functools.wraps(fn)
  def on_submesh(*args):
    with jax.sharding.use_abstract_mesh(mesh):
      return fn(*args)

  return on_submesh
