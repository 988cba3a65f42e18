"""How an array crosses processes: in the layout its receiver keeps it in.

A transfer-server pull (`jax.experimental.transfer`, `runtime.cluster.Cluster.pull`) copies the
offered array's device buffers one by one, in order, into the buffers of the sharding the
receiver asks for, so both sides must agree on the layout (platform facts, jax 0.10, CPU): a
replicated array pulled with one replicated over the receiver's sub-mesh arrives whole on every
device (`tp` copies over the network); one pulled onto a single device takes the first buffer;
a split array pulled with the same split over a sub-mesh of the same shape arrives piece by
piece; a pull asking for more buffers, or buffers of other sizes, than were offered fails.

So a whole array (on one device, or replicated over a worker's sub-mesh: activations, their
gradients, gradient buffers, replicated parameters) travels as one replica and is copied to the
receiver's other devices after it arrived; a split one (tensor-parallel parameters and optimizer
entries) travels as its pieces, named by its spec's sharding over the abstract sub-mesh
(`model.sharding.abstract_mesh`), onto the same split of the receiver's sub-mesh.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from resilient_jax.model.sharding import Where


def split_of(spec: jax.ShapeDtypeStruct | None) -> PartitionSpec | None:
  """How `spec` splits its array over a worker's sub-mesh (a `NamedSharding` over the abstract
  sub-mesh, `model.sharding.abstract_mesh`); None for a whole array."""
  sharding = None if spec is None else spec.sharding
  if isinstance(sharding, NamedSharding) and any(sharding.spec):
    return sharding.spec
  return None


def offered(x: jax.Array, spec: jax.ShapeDtypeStruct | None) -> jax.Array:
  """What crosses the network for `x`, which a receiver pulls with `spec`: `x` itself on one
  device; a split array as `spec` splits it over its sub-mesh (no copy when it already is);
  else one replica (no copy when `x` is replicated; a gather onto one device when not)."""
  devices = x.sharding.device_set
  if len(devices) == 1:
    return x
  split = split_of(spec)
  if split is not None:
    return jax.device_put(x, NamedSharding(x.sharding.mesh, split))
  if x.sharding.is_fully_replicated:
    return x.addressable_shards[0].data
  return jax.device_put(x, min(devices, key=lambda d: d.id))


def landing(spec: jax.ShapeDtypeStruct, where: Where) -> jax.sharding.Sharding:
  """Where a pull puts the array `offered` sends for `spec`: its split over the sub-mesh of
  `where`, else `where`'s first device (one replica)."""
  if isinstance(where, jax.Device):
    return jax.sharding.SingleDeviceSharding(where)
  split = split_of(spec)
  if split is not None:
    return NamedSharding(where.mesh, split)
  return jax.sharding.SingleDeviceSharding(min(where.device_set, key=lambda d: d.id))
