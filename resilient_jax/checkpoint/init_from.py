"""`checkpoint.init_from`: start a new run from another run's parameters (fine-tuning).

Only parameters are taken; the new run has its own seed, data order, optimizer state and step
count. The source may be a universal checkpoint (a step folder, a `checkpoints/` folder or
a run's workdir: the newest checkpoint that verifies) or a plain orbax checkpoint of the same
model's NNX state (e.g. `ocp.StandardCheckpointer().save(path, nnx.state(model, nnx.Param))`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from resilient_jax.checkpoint.store import (
  CheckpointError,
  committed_steps,
  load,
  load_latest,
  meta_path,
)
from resilient_jax.model.staging import variable_names


def _flatten(tree: Any, prefix: tuple = ()) -> dict[str, np.ndarray]:
  """A nested mapping's leaves by dotted path (an NNX `{"value": array}` leaf by its owner)."""
  if isinstance(tree, Mapping):
    if set(tree) == {"value"}:
      return _flatten(tree["value"], prefix)
    out = {}
    for k, v in tree.items():
      out.update(_flatten(v, (*prefix, k)))
    return out
  return {".".join(map(str, prefix)): np.asarray(tree)}


def read_params(path: str | Path, log: Callable[[str], None] = lambda _: None
                ) -> tuple[dict[str, np.ndarray], str]:
  """Parameters by global name from a universal checkpoint or a plain orbax NNX state, and
  which checkpoint they came from (a folder of several: the newest that verifies; `log` gets a
  line for each newer one skipped, with why: corrupt, non-finite, damaged metadata).

  Raises:
    CheckpointError: nothing readable at `path` (the message says what was tried).
  """
  path = Path(path)
  if not path.exists():
    raise CheckpointError(f"checkpoint.init_from={str(path)!r} does not exist")
  if meta_path(path).exists():
    loaded = load(path)
    return loaded.params, f"step {loaded.step} ({loaded.path})"
  for root in (path, path / "checkpoints"):
    if root.is_dir() and committed_steps(root):
      skipped: list[str] = []
      loaded = load_latest(root, log=skipped.append)
      for line in skipped:
        log(f"checkpoint.init_from: {line}")
      if loaded is None:
        raise CheckpointError(f"checkpoint.init_from={str(path)!r}: no checkpoint verifies")
      newer = f", the {len(skipped)} newer one(s) skipped (above)" if skipped else ""
      return loaded.params, f"step {loaded.step} ({loaded.path}: the newest that verifies{newer})"
  import orbax.checkpoint as ocp

  try:
    tree = ocp.StandardCheckpointer().restore(path.absolute())
  except Exception as e:  # noqa: BLE001 - orbax raises many types for what it cannot read
    raise CheckpointError(
      f"checkpoint.init_from={str(path)!r} is neither a universal checkpoint nor an orbax "
      f"checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
    ) from None
  return _flatten(tree), f"the orbax checkpoint {path}"


def init_params(model: nnx.Module, params: Mapping[str, np.ndarray], source: str) -> int:
  """Writes `params` into `model`'s parameters (by global name); returns how many.

  Raises:
    CheckpointError: a parameter of the model is missing or has another shape.
  """
  names = variable_names(model)
  wanted = {names[id(n)]: n for _, n in nnx.iter_graph(model) if isinstance(n, nnx.Param)}
  missing = sorted(set(wanted) - set(params))
  if missing:
    raise CheckpointError(f"checkpoint.init_from={source!r} lacks {len(missing)} parameters of "
                          f"the model, e.g. {missing[0]!r}")
  for name, var in wanted.items():
    value = np.asarray(params[name])
    if value.shape != var[...].shape:
      raise CheckpointError(f"checkpoint.init_from={source!r}: {name} has shape {value.shape}, "
                            f"the model's is {var[...].shape}")
    var.set_value(value.astype(var[...].dtype))
  return len(wanted)
