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
from jax.extend import core as jcore

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
      out.append(f"it has no `{part}` (a model needs `embed`, a list `blocks` and `head`)"
                 + _suggest(model, part))
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


def _suggest(model: Any, part: str) -> str:
  """How to supply a missing part from what the model has, by its own attribute names: an
  `nnx.Embed` for `embed`, a list of modules for `blocks`, a `nnx.Linear` (or a module named
  like a head) for `head`; "" when nothing fits."""
  found = []
  for name, value in sorted(vars(model).items()):
    if name.startswith("_") or name in ("embed", "blocks", "head"):
      continue
    if part == "embed" and isinstance(value, nnx.Embed):
      found.append(f"`{name}` (an nnx.Embed)")
    elif part == "blocks" and isinstance(value, (nnx.List, list, tuple)) and value and all(
        isinstance(b, nnx.Module) for b in value):
      found.append(f"`{name}` (a list of {len(value)} {type(value[0]).__name__})")
    elif part == "head" and (isinstance(value, nnx.Linear) or (
        isinstance(value, nnx.Module) and any(k in name.lower()
                                              for k in ("head", "unembed", "output", "logits")))):
      found.append(f"`{name}` (a {type(value).__name__})")
  if not found:
    return ""
  names = " or ".join(found)
  return (f"; {names} looks like it: set `self.{part} = self.{found[0].split('`')[1]}` in "
          "__init__ (the same module under a second name, nothing copied)")


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
  return _unused_params(model, seq_len, batch) or _own_forward_differs(model, seq_len)


def _composed(model: Any, tokens: jax.Array) -> jax.Array:
  """What the stages compute together: `head(blocks(embed(tokens)))`."""
  x = model.embed(tokens)
  for block in model.blocks:
    x = block(x)
  return model.head(x)


def _unused_params(model: Any, seq_len: int, batch: int) -> list[str]:
  """Parameters that `embed`, `blocks` and `head` never read: no stage would train them (and
  a forward of the model's own that uses them would silently lose them)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  named = [(".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path), leaf)
           for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]

  rest_leaves, rest_def = jax.tree.flatten(rest)

  def composed(leaves: list[jax.Array], tokens: jax.Array) -> jax.Array:
    # Both states rebuilt inside the trace: a layer that draws (dropout) counts its draws.
    state = jax.tree.unflatten(jax.tree.structure(params), leaves)
    return _composed(nnx.merge(graphdef, state, jax.tree.unflatten(rest_def, rest_leaves)),
                     tokens)

  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  closed = jax.make_jaxpr(composed)([leaf for _, leaf in named], tokens)
  jaxpr = closed.jaxpr
  used = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
  for eqn in reversed(jaxpr.eqns):  # a sub-program counts as reading all its inputs
    if any(v in used for v in eqn.outvars) or eqn.effects:
      used.update(v for v in eqn.invars if isinstance(v, jcore.Var))
  unused = [name for (name, _), v in zip(named, jaxpr.invars, strict=False) if v not in used]
  if not unused:
    return []
  listed = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
  return [f"parameter(s) {listed} are never read by embed -> blocks -> head, so no stage would "
          "train them: move what uses them into `embed` (before the blocks) or `head` (after), "
          "or delete them"]


def _defines_call(model: Any) -> bool:
  return any("__call__" in vars(c) for c in type(model).__mro__
             if c not in (nnx.Module, object) and issubclass(c, nnx.Module))


def _own_forward_differs(model: Any, seq_len: int) -> list[str]:
  """A model's own `__call__(tokens)` that computes something `embed -> blocks -> head` does
  not (a positional embedding or a final norm added in `__call__`): the pipeline would train
  another network. Compared on one sequence, in eval mode (no dropout); a `__call__` that does
  not take token ids alone is not compared."""
  if not _defines_call(model):
    return []
  copy = nnx.merge(*nnx.split(model))
  copy.eval()
  tokens = (jnp.arange(seq_len, dtype=jnp.int32) % 2)[None]
  try:
    own = jnp.asarray(copy(tokens), jnp.float32)
  except Exception:  # noqa: BLE001 - it needs more than token ids: nothing to compare
    return []
  staged = jnp.asarray(_composed(copy, tokens), jnp.float32)
  if own.shape != staged.shape:
    return [f"{type(model).__name__}.__call__ returns {list(own.shape)} but embed -> blocks -> "
            f"head returns {list(staged.shape)}: the pipeline trains embed -> blocks -> head, "
            "not __call__; make them compute the same"]
  diff = float(jnp.max(jnp.abs(own - staged)))
  if not diff <= 1e-3 * max(1.0, float(jnp.max(jnp.abs(own)))):
    return [f"{type(model).__name__}.__call__ computes something embed -> blocks -> head does "
            f"not (outputs differ by up to {diff:.3g}): the pipeline trains embed -> blocks -> "
            "head, so whatever __call__ adds (a positional embedding, a final norm) would be "
            "lost; move it into `embed` (before the blocks) or `head` (after)"]
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
