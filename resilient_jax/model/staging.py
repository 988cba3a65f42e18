"""The model protocol and how the library cuts a model into pipeline stages.

A model the runtime can train is any `flax.nnx.Module` with three parts:

* `embed`: a module mapping the step's inputs (token ids `[batch, seq]`) to hidden states;
* `blocks`: a list of modules (`nnx.List` or a Python list), each hidden -> hidden;
* `head`: a module mapping hidden states to logits.

and optionally `loss(logits, targets)`, the loss of every token (any shape; the step's loss is
its mean over the global batch; default: `token_cross_entropy`). The library cuts the model
itself: the first stage owns `embed`, the last owns `head`, and `pipeline.partition` splits
`blocks`. Stages share the model's submodules, so a weight that `embed` and `head` both use (a
tied embedding) is held by the first and the last stage under one name, and their gradients are
summed like any data-parallel replica's.

Randomness (`nnx.Dropout` and any layer drawing from an `nnx.Rngs` stream): sample `i` of step
`t` draws from every stream's key folded with `(t, i)` (`Binder.apply`), one sample at a time,
so a micro-batch draws the same masks whichever worker runs it, whatever the layout, and the
single-device reference draws them too.

Rematerialisation (`model.remat`): each block of a stage runs through `run_block`, which with
`full` or a `jax.checkpoint_policies` name wraps it in `jax.checkpoint`, so the forward keeps
only the block's input (plus what the policy saves) and the backward recomputes the rest; the
B/W split inlines the recompute into B (`model.split`).

Parameters are named by their path in the whole model (`blocks.3.mlp.fc.kernel`; a shared
weight by its first path), whatever the pipeline layout: these names key stage parameters,
optimizer states and checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
Path = tuple[Any, ...]


@runtime_checkable
class Stageable(Protocol):
  """What the pipeline runtime needs from a model (see the module docstring)."""

  embed: nnx.Module
  blocks: Sequence[nnx.Module]
  head: nnx.Module


def token_cross_entropy(logits: Array, targets: Array) -> Array:
  """Per-token softmax cross-entropy of integer `targets` (the default `loss`)."""
  logits = logits.astype(jnp.float32)  # in float32 whatever the compute dtype
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return logz - picked


def loss_fn(model: Any):
  """The model's per-token loss: its own `loss` if it has one, else `token_cross_entropy`."""
  return getattr(model, "loss", None) or token_cross_entropy


def run_block(block: Any, *args: Any, remat: str = "none") -> Any:
  """`block(*args)`, rematerialised as `remat` says (`model.remat`, checked by
  `model.config.check_remat`).

  `none`: as is; the forward keeps every activation the backward reads. `full`: under
  `jax.checkpoint`, the forward keeps only the block's inputs and the backward recomputes the
  block once. A `jax.checkpoint_policies` name (`dots_saveable`, ...): the forward also keeps
  what the policy saves. Lifted with `nnx.remat`, so a block drawing random numbers updates its
  RNG counts as it would unwrapped, and the recompute draws the same masks.
  """
  if remat == "none":
    return block(*args)
  policy = None if remat == "full" else getattr(jax.checkpoint_policies, remat)
  return nnx.remat(lambda module, *a: module(*a), policy=policy)(block, *args)


class Stage(nnx.Module):
  """A contiguous slice of a stageable model; the whole model is the stage that is both first
  and last. It holds the model's own submodules (no copies), and runs each block as `remat`
  says (`run_block`)."""

  def __init__(self, embed: nnx.Module | None, blocks: Sequence[nnx.Module],
               head: nnx.Module | None, remat: str = "none"):
    self.embed = embed
    self.blocks = nnx.List(list(blocks))
    self.head = head
    self.remat = remat

  def __call__(self, x: Array) -> Array:
    if self.embed is not None:
      x = self.embed(x)
    for block in self.blocks:
      x = run_block(block, x, remat=self.remat)
    if self.head is not None:
      x = self.head(x)
    return x


def cut(model: Any, layers: range, *, first: bool, last: bool, remat: str = "none") -> Stage:
  """The stage of `model` that runs `blocks[layers]` (with `embed` if first, `head` if last),
  each block rematerialised as `remat` says (`run_block`)."""
  return Stage(model.embed if first else None, [model.blocks[i] for i in layers],
               model.head if last else None, remat)


def whole(model: Any, remat: str = "none") -> Stage:
  """The whole model as one stage (what a single device runs)."""
  return cut(model, range(len(model.blocks)), first=True, last=True, remat=remat)


def path_name(path: Path) -> str:
  return ".".join(str(p) for p in path)


def variable_names(model: nnx.Module) -> dict[int, str]:
  """Global name of every variable of `model`, by `id` (a shared variable: its first path)."""
  return {id(node): path_name(path) for path, node in nnx.iter_graph(model)
          if isinstance(node, nnx.Variable)}


def flat_params(module: nnx.Module, names: dict[int, str] | None = None) -> dict[str, Array]:
  """`{global name: value}` of every `nnx.Param` of `module` (names from `names`, by default
  the module's own paths)."""
  out = {}
  for path, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Param):
      name = path_name(path) if names is None else names[id(node)]
      out[name] = node[...]
  return out


class Binder:
  """Rebuilds a module from a flat `{global name: value}` dict, inside or outside a trace.

  Variables that are not parameters (RNG stream keys and counts) keep their values unless
  `others` replaces them (by global name).
  """

  def __init__(self, module: nnx.Module, names: dict[int, str]):
    self.graphdef, state = nnx.split(module)
    by_path = {path: node for path, node in nnx.iter_graph(module)
               if isinstance(node, nnx.Variable)}
    self.leaves: list[tuple[str, bool, Any]] = []  # (global name, is a Param, value)
    self.rng_keys: list[str] = []
    self.rng_counts: list[str] = []
    for path, var in nnx.to_flat_state(state):
      node = by_path[tuple(path)]
      name = names[id(node)]
      # A parameter's value always comes from `apply`'s or `__call__`'s arguments: not kept,
      # so programs kept for reuse (`stages.build_stage_programs`) hold no model's weights.
      is_param = isinstance(node, nnx.Param)
      self.leaves.append((name, is_param, None if is_param else var[...]))
      if isinstance(node, nnx.RngKey):
        self.rng_keys.append(name)
      elif isinstance(node, nnx.RngCount):
        self.rng_counts.append(name)
    self.treedef = jax.tree.structure(state)
    self.param_names = tuple(n for n, is_param, _ in self.leaves if is_param)
    self._param_specs = {name: jax.ShapeDtypeStruct(node[...].shape, node[...].dtype)
                         for path, node in by_path.items()
                         if isinstance(node, nnx.Param) for name in (names[id(node)],)}

  def abstract_params(self) -> dict[str, jax.ShapeDtypeStruct]:
    """Shape and dtype of every parameter, by global name."""
    return dict(self._param_specs)

  @property
  def uses_rng(self) -> bool:
    """Whether the module draws random numbers (then `apply` needs seeds)."""
    return bool(self.rng_keys)

  def run(self, params: dict[str, Array], fn: Callable[..., Any], inputs: tuple,
          seeds: Array | None = None) -> Any:
    """`fn(module, *inputs)` with the module bound to `params` (a parameter missing from them
    is zeros: a stage passes only what it reads). With RNG streams, `seeds` `[batch, 2]` int32
    holds each sample's `(step, sample id)` and every input's leading axis is the batch: sample
    `i` runs alone, every stream's key folded with its seed and its count reset, so its draws
    do not depend on its batch-mates (nor on the layout: `forward.StageForward`)."""
    if not self.uses_rng:
      return fn(self(params), *inputs)
    if seeds is None:
      raise ValueError("this model draws random numbers (e.g. dropout): pass per-sample seeds")
    initial = {n: v for n, _, v in self.leaves}

    def one(xs: tuple, seed: Array) -> Any:
      others = {n: jax.random.fold_in(jax.random.fold_in(initial[n], seed[0]), seed[1])
                for n in self.rng_keys}
      others.update({n: jnp.zeros_like(initial[n]) for n in self.rng_counts})
      out = fn(self(params, others), *jax.tree.map(lambda a: a[None], xs))
      return jax.tree.map(lambda a: a[0], out)

    return jax.vmap(one)(inputs, seeds)

  def apply(self, params: dict[str, Array], x: Array, seeds: Array | None = None) -> Array:
    """The module on `x` with `params`. With RNG streams, `seeds` `[batch, 2]` int32 holds
    each sample's `(step, sample id)`: sample `i` runs alone, every stream's key folded with
    its seed and its count reset, so its draws do not depend on its batch-mates."""
    if not self.uses_rng:
      return self(params)(x)
    if seeds is None:
      raise ValueError("this model draws random numbers (e.g. dropout): pass per-sample seeds")
    initial = {n: v for n, _, v in self.leaves}

    def one(xi: Array, seed: Array) -> Array:
      others = {n: jax.random.fold_in(jax.random.fold_in(initial[n], seed[0]), seed[1])
                for n in self.rng_keys}
      others.update({n: jnp.zeros_like(initial[n]) for n in self.rng_counts})
      return self(params, others)(xi[None])[0]

    return jax.vmap(one)(x, seeds)

  def __call__(self, params: dict[str, Array], others: dict[str, Array] | None = None
               ) -> nnx.Module:
    others = others or {}
    specs = self._param_specs
    values = [(params[n] if n in params else jnp.zeros(specs[n].shape, specs[n].dtype))
              if is_param else others.get(n, v) for n, is_param, v in self.leaves]
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, values))
