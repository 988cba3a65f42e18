"""What every stage is built from: parameter names, a model bound to flat parameters
(`Binder`), each block's rematerialisation (`run_block`) and the default per-token loss.

A model the runtime can train is any `flax.nnx.Module` with a list of repeated blocks, trained
through the user's `loss_fn(model, batch)` or, without one, its own `__call__(tokens)` (a model
without one: `embed`, `blocks` and `head`, `Stageable`) and optional `loss(logits, targets)` or
`loss(logits, batch)`; `model/cut.py` traces that loss and cuts it at the blocks.

Randomness (`nnx.Dropout` and any layer drawing from an `nnx.Rngs` stream): sample `i` of step
`t` runs alone, every stream's key folded with `(t, i)` and its count reset (`Binder.run`), so
a micro-batch draws the same masks whichever worker runs it, whatever the layout, and a user's
own one-device loop draws them too by doing the same.

Rematerialisation (`model.remat`): each block of a stage runs through `run_block`, which with
`full` or a `jax.checkpoint_policies` name wraps it in `jax.checkpoint`, so the forward keeps
only the block's input (plus what the policy saves) and the backward recomputes the rest; the
B/W split inlines the recompute into B (`model.split`).

Parameters are named by their path in the whole model (`blocks.3.mlp.fc.kernel`; a shared
weight, such as a tied embedding, by its first path), whatever the pipeline layout: these names
key stage parameters, optimizer states and checkpoints, and a weight two stages read is one
weight whose gradients are summed like any data-parallel replica's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array
Path = tuple[Any, ...]


@runtime_checkable
class Stageable(Protocol):
  """The shortcut for a model without a `__call__` of its own: `embed`, a list `blocks` and
  `head`, run one after the other (see the module docstring)."""

  embed: nnx.Module
  blocks: Sequence[nnx.Module]
  head: nnx.Module


def token_cross_entropy(logits: Array, targets: Array) -> Array:
  """Per-token softmax cross-entropy of integer `targets` (the default `loss`)."""
  logits = logits.astype(jnp.float32)  # in float32 whatever the compute dtype
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return logz - picked


def run_block(block: Any, *args: Any, remat: str = "none", **kwargs: Any) -> Any:
  """`block(*args, **kwargs)`, rematerialised as `remat` says (`model.remat`, checked by
  `model.config.check_remat`). Arguments that are not arrays (None, flags) pass through as
  they are, not traced.

  `none`: as is; the forward keeps every activation the backward reads. `full`: under
  `jax.checkpoint`, the forward keeps only the block's inputs and the backward recomputes the
  block once. A `jax.checkpoint_policies` name (`dots_saveable`, ...): the forward also keeps
  what the policy saves. Lifted with `nnx.remat`, so a block drawing random numbers updates its
  RNG counts as it would unwrapped, and the recompute draws the same masks.
  """
  if remat == "none":
    return block(*args, **kwargs)
  policy = None if remat == "full" else getattr(jax.checkpoint_policies, remat)
  leaves, tree = jax.tree.flatten((args, kwargs))
  traced = [isinstance(leaf, jax.Array) for leaf in leaves]

  def call(module: Any, arrays: list[Array]) -> Any:
    given = iter(arrays)
    a, kw = jax.tree.unflatten(tree, [next(given) if t else leaf
                                      for leaf, t in zip(leaves, traced, strict=True)])
    return module(*a, **kw)

  return nnx.remat(call, policy=policy)(block, [x for x, t in zip(leaves, traced, strict=True)
                                                if t])


def path_name(path: Path) -> str:
  return ".".join(str(p) for p in path)


def variable_names(model: nnx.Module) -> dict[int, str]:
  """Global name of every variable of `model`, by `id` (a shared variable: its first path)."""
  return {id(node): path_name(path) for path, node in nnx.iter_graph(model)
          if isinstance(node, nnx.Variable)}


def flat_params(module: nnx.Module, names: dict[int, str] | None = None,
                only: Collection[str] | None = None) -> dict[str, np.ndarray]:
  """`{global name: value}` of every `nnx.Param` of `module` (names from `names`, by default
  the module's own paths; `only`: those names alone, e.g. what one stage reads), read to the
  host: the library places them on its own workers, whatever devices or mesh the model was
  built on. Bytes read: those of the parameters asked for, not the model's."""
  out = {}
  for path, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Param):
      name = path_name(path) if names is None else names[id(node)]
      if only is None or name in only:
        out[name] = _on_host(node[...])
  return out


def _on_host(value: Any) -> Any:
  """`value` as a host array (an RNG key as one too): what a program reads as a constant must
  not be an array placed on the devices of a mesh the model was built under."""
  if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(np.asarray(jax.random.key_data(value)),
                                    impl=jax.random.key_impl(value))
  return np.asarray(value)


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
      # so programs kept for reuse (`shared.build_stage_programs`) hold no model's weights.
      is_param = isinstance(node, nnx.Param)
      self.leaves.append((name, is_param, None if is_param else _on_host(var[...])))
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

  def __call__(self, params: dict[str, Array], others: dict[str, Array] | None = None
               ) -> nnx.Module:
    others = others or {}
    specs = self._param_specs
    values = [(params[n] if n in params else jnp.zeros(specs[n].shape, specs[n].dtype))
              if is_param else others.get(n, v) for n, is_param, v in self.leaves]
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, values))
