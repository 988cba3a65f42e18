"""`check_stageable`: every reason a model cannot be cut into stages, in one message, before
anything is compiled; and `describe`, the cost description of a user's model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from resilient_jax.config import ConfigError
from resilient_jax.model.config import CustomModelConfig
from resilient_jax.model.staging import loss_fn, path_name, variable_names

_ALLOWED_STATE = (nnx.Param, nnx.RngState)


class NotStageableError(ConfigError):
  """The model does not follow the protocol of `resilient_jax.model`; the message lists why."""


def _pure(part: Any) -> Any:
  """`part` as a pure function of its input (its state split off and captured as values), so
  tracing it does not touch the module (dropout layers count their draws)."""
  graphdef, state = nnx.split(part)
  leaves, treedef = jax.tree.flatten(state)
  return lambda v: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(v)


def _params(module: Any) -> dict[int, str]:
  return {id(n): path_name(p) for p, n in nnx.iter_graph(module) if isinstance(n, nnx.Param)}


def _problems(model: Any, num_stages: int | None, seq_len: int | None, batch: int) -> list[str]:
  if not isinstance(model, nnx.Module):
    return [f"the model is a {type(model).__name__}, not a flax.nnx.Module"]
  out = []
  for part in ("embed", "blocks", "head"):
    if getattr(model, part, None) is None:
      out.append(f"it has no `{part}` (a model needs `embed`, a list `blocks` and `head`)")
  if out:
    return out
  blocks = model.blocks
  if not isinstance(blocks, nnx.List) and (not isinstance(blocks, Sequence)
                                            or isinstance(blocks, str)):
    return [f"`blocks` is a {type(blocks).__name__}, not a list of modules (use nnx.List)"]
  if len(blocks) == 0:
    return ["`blocks` is empty: there is nothing to split into stages"]
  for i, b in enumerate(blocks):
    if not isinstance(b, nnx.Module):
      out.append(f"blocks[{i}] is a {type(b).__name__}, not an nnx.Module")
  for part in ("embed", "head"):
    if not isinstance(getattr(model, part), nnx.Module):
      out.append(f"`{part}` is a {type(getattr(model, part)).__name__}, not an nnx.Module")
  if out:
    return out
  if num_stages is not None and num_stages > len(blocks):
    out.append(f"{num_stages} stages but only {len(blocks)} blocks: every stage needs a block")
  owner: dict[int, str] = {}
  for i, b in enumerate(blocks):
    for j in range(i):
      if blocks[j] is b:
        out.append(f"blocks[{j}] and blocks[{i}] are the same module: a layer reused across "
                   "stages would be trained as two copies; give each block its own layers")
        break
    else:
      for pid, name in _params(b).items():
        if pid in owner and owner[pid] != f"blocks[{i}]":
          out.append(f"blocks[{i}].{name} is also a parameter of {owner[pid]}: a layer reused "
                     "across stages would be trained as two copies")
          break
        owner[pid] = f"blocks[{i}]"
  for part in ("embed", "head"):
    for pid, name in _params(getattr(model, part)).items():
      if pid in owner and owner[pid].startswith("blocks"):
        out.append(f"{part}.{name} is also a parameter of {owner[pid]}: only `embed` and "
                   "`head` may share weights (a tied embedding)")
        break
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Variable) and not isinstance(node, _ALLOWED_STATE):
      out.append(f"{'.'.join(map(str, path))} is a {type(node).__name__}: state updated by the "
                 "forward pass (e.g. batch statistics) is not supported, only parameters and "
                 "RNG streams")
      break
  if not any(isinstance(n, nnx.Param) for _, n in nnx.iter_graph(model)):
    out.append("it has no nnx.Param to train")
  loss = getattr(model, "loss", None)
  if loss is not None and not callable(loss):
    out.append("`loss` is not callable: it must be loss(logits, targets) -> per-token losses")
  if out or seq_len is None:
    return out
  return _trial(model, seq_len, batch)


def _trial(model: Any, seq_len: int, batch: int) -> list[str]:
  """Runs the parts in order on abstract inputs; the first that fails is reported."""
  x = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  parts = [("embed", model.embed)] + [(f"blocks[{i}]", b) for i, b in enumerate(model.blocks)] \
    + [("head", model.head)]
  for name, part in parts:
    try:
      y = jax.eval_shape(_pure(part), x)
    except Exception as e:  # noqa: BLE001 - any failure of user code is reported, not raised
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      return [f"{name} fails on {x.dtype}{list(x.shape)}: {type(e).__name__}: {first}"]
    if not isinstance(y, jax.ShapeDtypeStruct):
      return [f"{name} returns a {type(y).__name__}, not one array"]
    if name.startswith("blocks") and (y.shape, y.dtype) != (x.shape, x.dtype):
      return [f"{name} maps {x.dtype}{list(x.shape)} to {y.dtype}{list(y.shape)}: a block "
              "must keep the hidden states' shape"]
    x = y
  targets = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  try:
    jax.eval_shape(loss_fn(model), x, targets)
  except Exception as e:  # noqa: BLE001
    return [f"loss fails on logits {x.dtype}{list(x.shape)}: {type(e).__name__}: {e}"]
  return []


def check_stageable(model: Any, *, num_stages: int | None = None, seq_len: int | None = None,
                    batch: int = 1) -> None:
  """Checks that `model` follows the protocol of `resilient_jax.model`.

  Args:
    model: the model.
    num_stages: the pipeline depth it will be cut into, if known.
    seq_len: if given, every part is also run on abstract token ids `[batch, seq_len]`.

  Raises:
    NotStageableError: listing every problem found.
  """
  problems = _problems(model, num_stages, seq_len, batch)
  if problems:
    raise NotStageableError("the model cannot be cut into pipeline stages: "
                            + "; ".join(problems))


def _flops(fn: Any, spec: jax.ShapeDtypeStruct) -> float:
  """Multiply-adds of `fn` on `spec`, from XLA's cost analysis (0 when unknown)."""
  try:
    cost = jax.jit(fn).lower(spec).cost_analysis()
  except Exception:  # noqa: BLE001 - a cost estimate never stops a run
    return 0.0
  cost = cost[0] if isinstance(cost, list) else cost
  return float((cost or {}).get("flops", 0.0)) / 2


def describe(model: Any, seq_len: int) -> CustomModelConfig:
  """The cost description of a stageable user model, measured from the model itself: FLOPs
  from XLA's cost analysis of one sequence, parameter counts, and a fingerprint of its
  parameter names and shapes."""
  x = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  hidden = jax.eval_shape(_pure(model.embed), x)
  logits = jax.eval_shape(_pure(model.head), hidden)
  h = jax.ShapeDtypeStruct(hidden.shape, hidden.dtype)
  names = variable_names(model)

  def count(module: Any) -> int:
    return sum(int(n[...].size) for _, n in nnx.iter_graph(module) if isinstance(n, nnx.Param))

  shapes = sorted((names[id(n)], tuple(n[...].shape)) for _, n in nnx.iter_graph(model)
                  if isinstance(n, nnx.Param))
  block = model.blocks[0]
  return CustomModelConfig(
    vocab_size=int(logits.shape[-1]),
    seq_len=seq_len,
    num_layers=len(model.blocks),
    block_flops=max(_flops(_pure(block), h), 1.0),
    head_flops=_flops(_pure(model.head), h),
    embed_params=count(model.embed),
    block_params=count(block),
    head_params=count(model.head),
    hidden=int(hidden.shape[-1]),
    fingerprint=hashlib.sha256(repr(shapes).encode()).hexdigest()[:16],
  )
