"""Parametric layers that let a pipeline stage split its backward into B and W.

Why: zero-bubble and re-routing schedules need the backward in two programs, B (gradient
w.r.t. the stage input, on the critical path) and W (gradient w.r.t. the parameters,
deferrable). Differentiating one closure twice makes W re-run the whole backward chain
(measured 1.49x the fused backward). Instead every parametric layer here reports to the active
`Tape`: the tape adds a zero "tap" to the layer's output, so the input-gradient pass yields the
layer's output cotangent as the tap's cotangent, and records the layer's input. W then needs
only each layer's local parameter-vjp (for a dense layer x^T g), no chain.

Every parameter of a stage must live in a `Tapped` layer; the stage programs check this.
Outside a tape the layers are ordinary NNX modules, so the single-device reference model and
the pipelined stages share one forward implementation.

Each tapped layer carries a global `name` (e.g. `blocks.3.mlp.fc`) fixed when the model is
built; parameter names are `<layer name>.<param>`, the same whatever the pipeline layout. Those
flat names are the keys of stage parameter dicts, optimizer states and checkpoints.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array

_active = threading.local()


class Tape:
  """Collects per-layer inputs and adds taps to outputs while active.

  In `discover` mode (taps=None) it records each tapped call's output shape; in tap mode it
  adds `taps[key]` to that output and keeps the input under the same key.
  """

  def __init__(self, taps: dict[str, Array] | None = None):
    self.taps = taps
    self.shapes: dict[str, jax.ShapeDtypeStruct] = {}
    self.inputs: dict[str, Array] = {}

  def __enter__(self) -> Tape:
    if getattr(_active, "tape", None) is not None:
      raise RuntimeError("tapes do not nest")
    _active.tape = self
    return self

  def __exit__(self, *exc) -> None:
    _active.tape = None

  def record(self, key: str, x: Array, y: Array) -> Array:
    if key in self.inputs or key in self.shapes:
      raise ValueError(f"layer call {key!r} happened twice in one stage forward")
    if self.taps is None:
      self.shapes[key] = jax.ShapeDtypeStruct(y.shape, y.dtype)
      self.inputs[key] = x
      return y
    self.inputs[key] = x
    return y + self.taps[key]


def _tape() -> Tape | None:
  return getattr(_active, "tape", None)


def tap_key(layer_name: str, kind: str) -> str:
  return f"{layer_name}:{kind}"


class Tapped(nnx.Module):
  """A layer whose parameter gradient is a local function of (input, output cotangent)."""

  name: str

  def param_values(self) -> dict[str, Array]:
    return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}

  def apply(self, params: dict[str, Array], x: Array, kind: str) -> Array:
    """The layer as a pure function of its parameters; `kind` picks the entry point."""
    raise NotImplementedError

  def _call(self, x: Array, kind: str) -> Array:
    y = self.apply(self.param_values(), x, kind)
    tape = _tape()
    return y if tape is None else tape.record(tap_key(self.name, kind), x, y)

  def param_grads(self, x: Array, g: Array, kind: str) -> dict[str, Array]:
    """Parameter gradient from the recorded input and the output cotangent (W's work)."""
    params = self.param_values()
    _, vjp = jax.vjp(lambda p: self.apply(p, x, kind), params)
    (grads,) = vjp(g)
    return grads


class Dense(Tapped):
  def __init__(self, din: int, dout: int, *, name: str, rngs: nnx.Rngs, std: float = 0.02):
    self.name = name
    self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), (din, dout), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((dout,), jnp.float32))

  def apply(self, params, x, kind):
    return x @ params["kernel"] + params["bias"]

  def param_grads(self, x, g, kind):
    # Written out rather than left to vjp + dead-code elimination: this is the whole of W for
    # most of a transformer, and the contraction over all leading axes is one matmul.
    xf = x.reshape(-1, x.shape[-1])
    gf = g.reshape(-1, g.shape[-1])
    return {"kernel": xf.T @ gf, "bias": gf.sum(0)}

  def __call__(self, x: Array) -> Array:
    return self._call(x, "dense")


class LayerNorm(Tapped):
  def __init__(self, dim: int, *, name: str, eps: float = 1e-5):
    self.name = name
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

  def _normalize(self, x):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + self.eps)

  def apply(self, params, x, kind):
    return self._normalize(x) * params["scale"] + params["bias"]

  def param_grads(self, x, g, kind):
    xhat = self._normalize(x)
    axes = tuple(range(x.ndim - 1))
    return {"scale": (g * xhat).sum(axes), "bias": g.sum(axes)}

  def __call__(self, x: Array) -> Array:
    return self._call(x, "norm")


class Embed(Tapped):
  """Token or position embedding; `attend` uses it as a tied output projection."""

  def __init__(self, num: int, dim: int, *, name: str, rngs: nnx.Rngs, std: float = 0.02):
    self.name = name
    self.embedding = nnx.Param(std * jax.random.normal(rngs.params(), (num, dim), jnp.float32))

  def apply(self, params, x, kind):
    table = params["embedding"]
    if kind == "lookup":
      return jnp.take(table, x, axis=0)
    return x @ table.T

  def param_grads(self, x, g, kind):
    table = self.embedding[...]
    if kind == "lookup":
      flat = g.reshape(-1, g.shape[-1])
      return {"embedding": jnp.zeros_like(table).at[x.reshape(-1)].add(flat)}
    hf = x.reshape(-1, x.shape[-1])
    gf = g.reshape(-1, g.shape[-1])
    return {"embedding": gf.T @ hf}

  def __call__(self, ids: Array) -> Array:
    return self._call(ids, "lookup")

  def attend(self, h: Array) -> Array:
    return self._call(h, "attend")


def tapped_layers(module: nnx.Module) -> dict[str, Tapped]:
  """Every tapped layer reachable from `module`, by global name (shared layers once)."""
  found: dict[str, Tapped] = {}
  for _, node in nnx.iter_graph(module):
    if isinstance(node, Tapped):
      if node.name in found and found[node.name] is not node:
        raise ValueError(f"two different layers are named {node.name!r}")
      found[node.name] = node
  return found


def flat_params(module: nnx.Module) -> dict[str, Any]:
  """`{"<layer>.<param>": value}` for every parameter of `module`.

  Raises:
    ValueError: a parameter lives outside a tapped layer (W could not compute its gradient).
  """
  layers = tapped_layers(module)
  owned = {id(v) for layer in layers.values() for v in vars(layer).values()}
  for path, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Param) and id(node) not in owned:
      raise ValueError(f"parameter {'/'.join(map(str, path))} is not in a Tapped layer")
  return {
    f"{name}.{k}": v for name, layer in layers.items() for k, v in layer.param_values().items()
  }


class FlatBinder:
  """Rebuilds a module from a flat parameter dict, inside or outside a trace.

  NNX state leaves are ordered by module structure; flat names by global layer name. The map
  between the two is found once by binding each leaf's index as its value.
  """

  def __init__(self, module: nnx.Module):
    self.graphdef, state = nnx.split(module)
    leaves, self.treedef = jax.tree.flatten(state)
    probe = nnx.merge(
      self.graphdef, jax.tree.unflatten(self.treedef, [np.array(i) for i in range(len(leaves))])
    )
    by_index = {int(v): name for name, v in flat_params(probe).items()}
    self.order = [by_index[i] for i in range(len(leaves))]

  def __call__(self, params: dict[str, Array]) -> nnx.Module:
    return nnx.merge(
      self.graphdef, jax.tree.unflatten(self.treedef, [params[n] for n in self.order])
    )


def load_flat_params(module: nnx.Module, params: dict[str, Array]) -> None:
  """Writes `params` (flat names) into `module`'s parameters, in place."""
  for name, layer in tapped_layers(module).items():
    for k, v in vars(layer).items():
      if isinstance(v, nnx.Param):
        v.set_value(params[f"{name}.{k}"])
