"""`check_stageable`: every reason a model cannot be cut into stages, in one message, before
anything is compiled; and `describe`, the cost description of a user's model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from resilient_jax.config import ConfigError
from resilient_jax.model import forward
from resilient_jax.model.config import CustomModelConfig
from resilient_jax.model.sharding import outside_ambient_mesh
from resilient_jax.model.staging import Binder, flat_params, loss_terms, path_name, variable_names

_ALLOWED_STATE = (nnx.Param, nnx.RngState)


class NotStageableError(ConfigError):
  """The model does not follow the protocol of `resilient_jax.model`; the message lists why."""


def _params(module: Any) -> dict[int, str]:
  return {id(n): path_name(p) for p, n in nnx.iter_graph(module) if isinstance(n, nnx.Param)}


def _problems(model: Any, num_stages: int | None, seq_len: int | None, batch: int,
              layers: str) -> list[str]:
  if not isinstance(model, nnx.Module):
    return [f"the model is a {type(model).__name__}, not a flax.nnx.Module"]
  try:
    path = forward.layers_path(model, layers)
  except forward.ForwardError as e:
    return [str(e)]
  if not forward.defines_call(model) and any(
      getattr(model, part, None) is None for part in ("embed", "head")):
    return ["it has no `__call__(tokens)` (nor `embed` and `head` around its blocks): the "
            "library runs the model's own forward"]
  name = ".".join(map(str, path))
  blocks = forward.blocks_at(model, path)
  out = []
  if num_stages is not None and num_stages > len(blocks):
    out.append(f"{num_stages} stages but only {len(blocks)} blocks ({name}): every stage "
               "needs a block")
  out += _shared_blocks(model, blocks, name)
  for path_, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Variable) and not isinstance(node, _ALLOWED_STATE):
      out.append(f"{'.'.join(map(str, path_))} is a {type(node).__name__}: state updated by "
                 "the forward pass (e.g. batch statistics) is not supported, only parameters "
                 "and RNG streams")
      break
  if not any(isinstance(n, nnx.Param) for _, n in nnx.iter_graph(model)):
    out.append("it has no nnx.Param to train")
  loss = getattr(model, "loss", None)
  if loss is not None and not callable(loss):
    out.append("`loss` is not callable: it must be loss(logits, targets) -> per-token losses, "
               "or loss(logits, batch) -> per-token losses or (losses, weights)")
  if out or seq_len is None:
    return out
  return _trial(model, seq_len, batch, layers)


def _shared_blocks(model: Any, blocks: Sequence[Any], name: str) -> list[str]:
  """A block, or a parameter of one, that appears twice: trained as two copies."""
  out = []
  owner: dict[int, str] = {}
  for i, b in enumerate(blocks):
    for j in range(i):
      if blocks[j] is b:
        out.append(f"{name}[{j}] and {name}[{i}] are the same module: a layer reused across "
                   "stages would be trained as two copies; give each block its own layers")
        break
    else:
      for pid, pname in _params(b).items():
        if pid in owner and owner[pid] != f"{name}[{i}]":
          out.append(f"{name}[{i}].{pname} is also a parameter of {owner[pid]}: a layer "
                     "reused across stages would be trained as two copies")
          break
        owner[pid] = f"{name}[{i}]"
  # Parameters of a block that anything outside the blocks also holds: seen from a copy of
  # the model whose block list is set aside (`nnx.merge` keeps what is shared, shared).
  copy = nnx.merge(*nnx.split(model))
  path = tuple(forward.layers_path(copy, name))
  inside = {id(n): f"{name}[{i}]" for i, b in enumerate(forward.blocks_at(copy, path))
            for _, n in nnx.iter_graph(b) if isinstance(n, nnx.Param)}
  forward.swap_blocks(copy, path, [])
  for p, node in nnx.iter_graph(copy):
    if isinstance(node, nnx.Param) and id(node) in inside:
      out.append(f"{path_name(p)} is also a parameter of {inside[id(node)]}: only "
                 "parameters outside the blocks may be shared (a tied embedding)")
      break
  return out


def _error_line(e: Exception) -> str:
  first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  return f"{type(e).__name__}: {first}"


def _trial(model: Any, seq_len: int, batch: int, layers: str) -> list[str]:
  """Runs the model's forward on abstract token ids, cut at its blocks, then the loss."""
  try:
    cut = forward.ModelCut(model, seq_len, layers)
  except forward.ForwardError as e:
    return [str(e)]
  except Exception as e:  # noqa: BLE001 - any failure of user code is reported, not raised
    return [f"its forward fails on int32[1, {seq_len}]: {_error_line(e)}"]
  logits = cut.logits
  if not isinstance(logits, jax.ShapeDtypeStruct):
    return [f"its forward returns a {type(logits).__name__}, not one array of logits"]
  targets = jax.ShapeDtypeStruct(logits.shape[:-1], jnp.int32)
  terms = loss_terms(model)
  try:
    _, weights = jax.eval_shape(terms, logits, targets, targets)
  except Exception as e:  # noqa: BLE001
    return [f"loss fails on logits {logits.dtype}{list(logits.shape)}: {_error_line(e)}"]
  if weights is not None and forward.live_inputs(jax.make_jaxpr(
      lambda lg, t, k: terms(lg, t, k)[1])(logits, targets, targets).jaxpr)[0]:
    return ["the weights `loss(logits, batch)` returns depend on the logits: they must come "
            "from the batch (a pad mask, per-token weights), which is summed before the step"]
  return _unused_params(model, cut, seq_len) or _cut_differs(model, cut, seq_len)


def _unused_params(model: Any, cut: forward.ModelCut, seq_len: int) -> list[str]:
  """Parameters the model's forward never reads: no stage would train them."""
  binder = Binder(model, variable_names(model))
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  used, _ = forward.stage_reads(binder, cut.whole(), None, tokens)
  unused = [n for n in sorted(binder.abstract_params()) if n not in set(used)]
  if not unused:
    return []
  listed = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
  return [f"parameter(s) {listed} are never read by the model's forward, so no stage would "
          "train them: use them or delete them"]


def _cut_differs(model: Any, cut: forward.ModelCut, seq_len: int) -> list[str]:
  """The forward cut after every block, its stages run one after the other, against the
  model's own forward on one sequence (eval mode: no dropout). They differ when the forward
  carries values from block to block outside the blocks' arguments and results (`x = x +
  block(x)`): such a forward cannot be cut at its blocks."""
  copy = nnx.merge(*nnx.split(model))
  copy.eval()
  binder = Binder(copy, variable_names(copy))
  params = flat_params(copy)
  tokens = (jnp.arange(seq_len, dtype=jnp.int32) % 2)[None]
  seeds = jnp.zeros((1, 2), jnp.int32) if binder.uses_rng else None
  n = cut.num_blocks

  @jax.jit  # one compiled program: op by op, the chain cost seconds of a check
  def both(p: dict) -> tuple[jax.Array, jax.Array]:
    own = binder.run(p, lambda m, t: cut.forward(m, t), (tokens,), seeds)
    x = None
    for i in range(n):
      x = binder.run(p, cut.stage(range(i, i + 1), first=i == 0, last=i == n - 1),
                     (x, tokens), seeds)
    return jnp.asarray(own, jnp.float32), jnp.asarray(x, jnp.float32)

  own, staged = both(params)
  diff = float(jnp.max(jnp.abs(own - staged)))
  if own.shape == staged.shape and diff <= 1e-4 * max(1.0, float(jnp.max(jnp.abs(own)))):
    return []
  name = ".".join(map(str, cut.path))
  return [f"{type(model).__name__}'s forward cut after each of {name} differs from the whole "
          f"forward (by up to {diff:.3g}): it carries a value from block to block outside the "
          "blocks' arguments and results (e.g. `x = x + block(x)`); move that into the block "
          "(the block returns what the next one takes)"]


@outside_ambient_mesh
def check_stageable(model: Any, *, num_stages: int | None = None, seq_len: int | None = None,
                    batch: int = 1, layers: str = "") -> None:
  """Checks that `model` follows the protocol of `resilient_jax.model`.

  Args:
    model: the model.
    num_stages: the pipeline depth it will be cut into, if known.
    seq_len: if given, the forward is also run on abstract token ids `[1, seq_len]`, cut at
      its blocks, and the cut compared with the whole on one sequence.
    layers: `model.layers`, the dotted path of the blocks ("" finds them).

  Raises:
    NotStageableError: listing every problem found.
  """
  problems = _problems(model, num_stages, seq_len, batch, layers)
  if problems:
    raise NotStageableError("the model cannot be cut into pipeline stages: "
                            + "; ".join(problems))


def _flops(fn: Any, *specs: Any) -> float:
  """Multiply-adds of `fn` on `specs`, from XLA's cost analysis (0 when unknown)."""
  try:
    cost = jax.jit(fn).lower(*specs).cost_analysis()
  except Exception:  # noqa: BLE001 - a cost estimate never stops a run
    return 0.0
  cost = cost[0] if isinstance(cost, list) else cost
  return float((cost or {}).get("flops", 0.0)) / 2


@outside_ambient_mesh
def describe(model: Any, seq_len: int, layers: str = "") -> CustomModelConfig:
  """The cost description of a user's model, measured from the model itself: FLOPs from XLA's
  cost analysis of one sequence (a middle block's stage, the last block's stage less its
  block: the head), parameter counts by what each part of the cut forward reads, and a
  fingerprint of its parameter names and shapes."""
  cut = forward.ModelCut(model, seq_len, layers)
  names = variable_names(model)
  binder = Binder(model, names)
  params = binder.abstract_params()
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  n = cut.num_blocks
  hidden = cut.hidden(0, 1)

  def stage_flops(i: int) -> float:
    st = cut.stage(range(i, i + 1), first=i == 0, last=i == n - 1)
    x = None if i == 0 else cut.hidden(i - 1, 1)
    used, _ = forward.stage_reads(binder, st, x, tokens)
    seeds = jnp.zeros((1, 2), jnp.int32) if binder.uses_rng else None
    fn = (lambda p, t: binder.run(p, st, (None, t), seeds)) if x is None else \
      (lambda p, xs, t: binder.run(p, st, (xs, t), seeds))
    args = (({k: params[k] for k in used}, tokens) if x is None
            else ({k: params[k] for k in used}, x, tokens))
    return _flops(fn, *args), set(used)

  block = forward.blocks_at(model, cut.path)[0]
  block_names = {names[id(v)] for _, v in nnx.iter_graph(block) if isinstance(v, nnx.Param)}
  last_flops, last_used = stage_flops(n - 1)
  first_flops, first_used = stage_flops(0) if n > 1 else (last_flops, last_used)
  block_flops = stage_flops(1)[0] if n > 2 else first_flops
  last_block = {names[id(v)] for _, v in nnx.iter_graph(forward.blocks_at(model, cut.path)[-1])
                if isinstance(v, nnx.Param)}
  first_block = {names[id(v)] for _, v in nnx.iter_graph(block) if isinstance(v, nnx.Param)}

  def count(keys: set[str]) -> int:
    return sum(int(math.prod(params[k].shape)) for k in keys)

  shapes = sorted((k, tuple(v.shape)) for k, v in params.items())
  return CustomModelConfig(
    vocab_size=int(cut.logits.shape[-1]),
    seq_len=seq_len,
    num_layers=n,
    block_flops=max(block_flops, 1.0),
    head_flops=max(last_flops - block_flops, 0.0),
    embed_params=count(first_used - first_block - (last_used if n == 1 else set())),
    block_params=count(block_names),
    head_params=count(last_used - last_block),
    hidden=int(hidden.shape[-1]),
    fingerprint=hashlib.sha256(repr(shapes).encode()).hexdigest()[:16],
  )
