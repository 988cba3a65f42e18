"""What crosses a cut: the values live across it, as the one array a stage hands the next.

Growth: per micro-batch and cut, the bytes of the values live across it (one copy into the
packed vector where there are several), the same at any dp, pp or process count.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Carry:
  """The values live across one cut, as the one array a stage hands the next.

  One value travels as itself. Several are packed into one vector of the widest float dtype
  among them: a float value converted (exactly: a narrower float widens without loss), an
  integer or boolean one as its bits (as int32, bit-cast), so the backward's cotangent is the
  same vector and the runtime moves one array per micro-batch and direction, whatever the
  model carries.
  """

  specs: tuple[jax.ShapeDtypeStruct, ...]

  @functools.cached_property
  def dtype(self) -> Any:
    floats = [s.dtype for s in self.specs if jnp.issubdtype(s.dtype, jnp.floating)]
    return max(floats, key=lambda d: jnp.dtype(d).itemsize) if floats else jnp.dtype(jnp.float32)

  def _width(self, spec: jax.ShapeDtypeStruct) -> int:
    n = math.prod(spec.shape)
    if jnp.issubdtype(spec.dtype, jnp.floating):
      return n
    return n * (4 // jnp.dtype(self.dtype).itemsize)

  @functools.cached_property
  def spec(self) -> jax.ShapeDtypeStruct:
    """What crosses: the one value's own spec, or the packed vector's."""
    if len(self.specs) == 1:
      return self.specs[0]
    return jax.ShapeDtypeStruct((sum(self._width(s) for s in self.specs),), self.dtype)

  @property
  def nbytes(self) -> int:
    return math.prod(self.spec.shape) * jnp.dtype(self.spec.dtype).itemsize

  def pack(self, values: Sequence[Array]) -> Array:
    if len(self.specs) == 1:
      return values[0]
    parts = []
    for v, s in zip(values, self.specs, strict=True):
      if jnp.issubdtype(s.dtype, jnp.floating):
        parts.append(v.astype(self.dtype).reshape(-1))
      else:
        bits = jax.lax.bitcast_convert_type(jax.lax.stop_gradient(v).astype(jnp.int32),
                                            self.dtype)
        parts.append(bits.reshape(-1))
    return jnp.concatenate(parts)

  def unpack(self, x: Array) -> list[Array]:
    if len(self.specs) == 1:
      return [x]
    out, at = [], 0
    for s in self.specs:
      n = self._width(s)
      part = x[at:at + n]
      at += n
      if jnp.issubdtype(s.dtype, jnp.floating):
        out.append(part.reshape(s.shape).astype(s.dtype))
      else:
        per = 4 // jnp.dtype(self.dtype).itemsize
        bits = jax.lax.stop_gradient(part).reshape(*s.shape, per) if per > 1 else \
          jax.lax.stop_gradient(part).reshape(s.shape)
        out.append(jax.lax.bitcast_convert_type(bits, jnp.int32).astype(s.dtype))
    return out


