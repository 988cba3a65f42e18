"""Tensor parallelism inside a stage: parameters' logical axes, mapped onto a worker's sub-mesh.

A worker (dp, stage) with `mesh.tp > 1` is a sub-mesh of `tp` devices with one axis, `tp`. A
model says how its parameters split by naming their axes with Flax NNX sharding metadata
(`nnx.with_partitioning(init, ("embed", "mlp"), eager_sharding=False)`: metadata only, nothing
is placed when the model is built); `TP_RULES` maps the logical names onto the mesh axis, as
Megatron-LM splits a block: the attention heads and the MLP's hidden units. So the first matrix
of each pair (QKV, MLP up/gate) is split by columns and the second (attention output, MLP
down) by rows, and XLA's SPMD partitioner inserts the one all-reduce per pair. Everything else
(norms, embeddings, the head) is replicated over the sub-mesh.

A parameter without annotations, or whose split dimension `tp` does not divide, is replicated:
a user's model runs correctly on any `tp`, just not faster. The stage programs only constrain
their *outputs* (new parameters, optimizer state, accumulated gradients) to these specs
(`stages.py`); their jaxprs are the unsharded ones, so the automatic B/W split
(`model/split.py`) cuts the same backward whatever `tp` is, and the partitioner shards it
from the parameters' layout.

Checkpoints do not depend on `tp`: the names and the shapes of parameters and optimizer entries
are the unsharded ones; only where their pieces live differs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

TP_AXIS = "tp"
"""The one axis of a worker's sub-mesh."""

TP_RULES: dict[str, str] = {"heads": TP_AXIS, "kv_heads": TP_AXIS, "mlp": TP_AXIS, TP_AXIS: TP_AXIS}
"""Logical axis name -> mesh axis. Names not listed (`embed`, `vocab`, ...) stay replicated."""

Where = jax.Device | NamedSharding
"""Where a worker's whole (unsharded) arrays go (`jax.device_put`'s target): its device, or with
`tp > 1` replicated over its sub-mesh."""


def worker_mesh(devices: Sequence[jax.Device]) -> Mesh:
  """The sub-mesh of one worker: its devices along the axis `tp`."""
  return Mesh(np.array(list(devices)), (TP_AXIS,))


def as_mesh(placement: jax.Device | Mesh) -> Mesh:
  """A worker's placement as a mesh (a single device: a 1-device mesh)."""
  return placement if isinstance(placement, Mesh) else worker_mesh([placement])


def target(placement: jax.Device | Mesh) -> Where:
  """Where `jax.device_put` puts a worker's whole arrays: its one device itself (so a `tp=1`
  run places and compiles exactly as before sub-meshes), else replicated over the sub-mesh."""
  mesh = as_mesh(placement)
  if mesh.size == 1:
    return mesh.devices.item()
  return NamedSharding(mesh, PartitionSpec())


def where_key(where: Where) -> int:
  """A stable order of workers (every process the same): their lowest device id."""
  devices = where.device_set if isinstance(where, NamedSharding) else {where}
  return min(d.id for d in devices)


def logical_axes(module: nnx.Module, names: Mapping[int, str]) -> dict[str, tuple | None]:
  """`{global name: logical axes or None}` of every `nnx.Param` of `module`."""
  out: dict[str, tuple | None] = {}
  for _, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Param):
      axes = node.get_metadata().get("out_sharding")
      out[names[id(node)]] = tuple(axes) if axes else None
  return out


def partition_specs(
  axes: Mapping[str, tuple | None], shapes: Mapping[str, tuple[int, ...]], tp: int
) -> dict[str, PartitionSpec]:
  """Each parameter's split over a sub-mesh of `tp` devices (`TP_RULES`); replicated where it
  has no annotation, or the dimension is not a multiple of `tp`, or `tp` is 1."""
  specs = {}
  for name, shape in shapes.items():
    logical = axes.get(name)
    dims: list[str | None] = [None] * len(shape)
    if tp > 1 and logical is not None and len(logical) == len(shape):
      for i, (axis, size) in enumerate(zip(logical, shape, strict=True)):
        mapped = TP_RULES.get(axis) if axis is not None else None
        if mapped is not None and size % tp == 0 and mapped not in dims:
          dims[i] = mapped
    while dims and dims[-1] is None:  # the form jit gives its outputs: P("tp"), not P("tp", None)
      dims.pop()
    specs[name] = PartitionSpec(*dims)
  return specs


def opt_entry_spec(key: str, shape: tuple[int, ...], specs: Mapping[str, PartitionSpec],
                   shapes: Mapping[str, tuple[int, ...]]) -> PartitionSpec:
  """An optimizer entry's split: its parameter's (a universal key ends with the parameter's
  name, `0/mu/blocks.3.mlp.fc.kernel`) when shaped like it, else replicated (`0/count`)."""
  name = key.rsplit("/", 1)[-1]
  if name in specs and tuple(shapes[name]) == tuple(shape):
    return specs[name]
  return PartitionSpec()


def sharding_of(where: Where, spec: PartitionSpec) -> Where:
  """`spec` on the worker at `where` (its device itself when it has one)."""
  if isinstance(where, NamedSharding):
    return NamedSharding(where.mesh, spec)
  return where


def abstract_mesh(tp: int) -> AbstractMesh:
  """The shape of every worker's sub-mesh, for tracing programs shared by all of them."""
  return AbstractMesh((tp,), (TP_AXIS,))


def constrain(tree: Any, specs: Any) -> Any:
  """`tree`'s leaves constrained to `specs` (a matching tree of `PartitionSpec`s); to be traced
  under `jax.sharding.use_abstract_mesh(abstract_mesh(tp))`."""
  return jax.tree.map(jax.lax.with_sharding_constraint, tree, specs)


@contextlib.contextmanager
def no_ambient_mesh() -> Iterator[None]:
  """Runs the body with no mesh set by the caller (`jax.set_mesh`, thread-local).

  A model built under a user's mesh (a tutorial sets `jax.set_mesh` and builds its layers
  there) must not lend that mesh to the library's programs: traced under an explicit mesh, the
  default loss fails on sharding types, and every stage program, whose arguments live on one
  worker's device, would be compiled against the mesh's devices. The library places the
  model's values itself (`staging.flat_params` and `Binder` read them to the host), so its
  traces and compiles run as if no mesh were set, and the caller's comes back on exit.
  """
  if jax.sharding.get_abstract_mesh().empty:
    yield
    return
  with jax.set_mesh(None):
    yield


@contextlib.contextmanager
def layout_requests_dropped() -> Iterator[None]:
  """Traces the body with `jax.lax.with_sharding_constraint` and `jax.sharding.reshard`
  identities: a forward written for the mesh its model was built under (its activations
  constrained to `P("data", ...)`, its logits resharded) traces as it runs on one of a worker's
  devices, which the library lays out itself. Module attributes, replaced for the trace and
  put back after: a model that imported the functions by name (`from jax.lax import ...`)
  still calls them, and needs a mesh its trace does not have (refused in one line)."""
  saved = jax.lax.with_sharding_constraint, jax.sharding.reshard
  jax.lax.with_sharding_constraint = lambda x, *_, **__: x
  jax.sharding.reshard = lambda x, *_, **__: x
  try:
    yield
  finally:
    jax.lax.with_sharding_constraint, jax.sharding.reshard = saved


def outside_ambient_mesh(fn: Callable) -> Callable:
  """`fn` run under `no_ambient_mesh` (the library's entry points)."""

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    with no_ambient_mesh():
      return fn(*args, **kwargs)

  return wrapped

