"""Value checks at every boundary that takes numbers from users (configs, specs, profiles,
plans): one rule, one wording.

A `bool` is an `int` in Python but never a count or an amount here, and an amount is finite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from resilient_jax.exit_codes import EXIT_BAD_CONFIG


class ConfigError(ValueError):
  """A configuration value is invalid; the message names the key."""

  exit_code = EXIT_BAD_CONFIG


def is_int(v: Any, minimum: int = 1) -> bool:
  """Whether `v` is an integer (not a bool) of at least `minimum`."""
  return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def is_number(v: Any, minimum: float = 0.0, *, above: bool = False) -> bool:
  """Whether `v` is a finite int or float (not a bool) of at least `minimum` (above it, with
  `above`)."""
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    return False
  return v > minimum if above else v >= minimum


def require_ints(
  owner: str, values: Mapping[str, Any], minimum: int = 1, error: type[Exception] = ValueError
) -> None:
  """Raises `error` naming `owner.key` for the first value that is not `is_int(v, minimum)`."""
  kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
  for key, v in values.items():
    if not is_int(v, minimum):
      raise error(f"{owner}{key} must be {kind}, got {v!r}")


def require_numbers(
  owner: str,
  values: Mapping[str, Any],
  *,
  positive: bool = False,
  error: type[Exception] = ValueError,
) -> None:
  """Raises `error` naming `owner.key` for the first value that is not a finite number >= 0
  (> 0 with `positive`)."""
  kind = "a positive number" if positive else "a non-negative number"
  for key, v in values.items():
    if not is_number(v, above=positive):
      raise error(f"{owner}{key} must be {kind}, got {v!r}")
