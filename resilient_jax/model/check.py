"""`check_stageable`: every reason a model and its loss cannot be cut into stages, in one
message, before anything is compiled; and `describe`, the cost description of a user's model.

The checks are of what the cut needs, not of the cut's result: the cut computes the traced
program itself (`model.cut`), so a model that passes trains the network it defines.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from resilient_jax.config import ConfigError
from resilient_jax.model import cut as cut_lib
from resilient_jax.model.sharding import outside_ambient_mesh
from resilient_jax.model.staging import path_name
from resilient_jax.spec.model import CustomModelConfig

_ALLOWED_STATE = (nnx.Param, nnx.RngState)


class NotStageableError(ConfigError):
  """The model or its loss cannot be cut into pipeline stages; the message lists why."""


def _params(module: Any) -> dict[int, str]:
  return {id(n): path_name(p) for p, n in nnx.iter_graph(module) if isinstance(n, nnx.Param)}


def token_batch(seq_len: int, samples: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
  """The batch of the shipped token sources: `tokens` and `targets`, int32 `[samples, seq]`."""
  spec = jax.ShapeDtypeStruct((samples, seq_len), jnp.int32)
  return {"tokens": spec, "targets": spec}


def _problems(model: Any, num_stages: int | None, batch: Mapping[str, Any] | None,
              layers: str, loss_fn: Any) -> tuple[list[str], cut_lib.LossCut | None]:
  """Every problem found, and the traced loss when it could be traced without one."""
  if not isinstance(model, nnx.Module):
    return [f"the model is a {type(model).__name__}, not a flax.nnx.Module"], None
  try:
    path = cut_lib.layers_path(model, layers)
  except cut_lib.CutError as e:
    return [str(e)], None
  if loss_fn is None and not cut_lib.defines_call(model) and any(
      getattr(model, part, None) is None for part in ("embed", "head")):
    return ["it has no `__call__(tokens)` (nor `embed` and `head` around its blocks) and no "
            "loss_fn was given: pass loss_fn(model, batch), the loss your own loop computes"], \
      None
  name = ".".join(map(str, path))
  blocks = cut_lib.blocks_at(model, path)
  out = []
  if num_stages is not None and num_stages > len(blocks):
    out.append(f"{num_stages} stages but only {len(blocks)} blocks ({name}): every stage "
               "needs a block")
  out += _shared_blocks(model, blocks, name)
  for path_, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Variable) and not isinstance(node, _ALLOWED_STATE):
      out.append(f"{'.'.join(map(str, path_))} is a {type(node).__name__}: state updated by "
                 "the forward pass (e.g. batch statistics, a cache) is not supported, only "
                 "parameters and RNG streams")
      break
  if not any(isinstance(n, nnx.Param) for _, n in nnx.iter_graph(model)):
    out.append("it has no nnx.Param to train")
  if loss_fn is not None and not callable(loss_fn):
    out.append("loss_fn is not callable: it must be loss_fn(model, batch)")
  loss = getattr(model, "loss", None)
  if loss_fn is None and loss is not None and not callable(loss):
    out.append("`loss` is not callable: it must be loss(logits, targets) -> per-token losses, "
               "or loss(logits, batch) -> per-token losses or (losses, weights)")
  if out or batch is None:
    return out, None
  return _trial(model, batch, layers, loss_fn)


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
  path = tuple(cut_lib.layers_path(copy, name))
  inside = {id(n): f"{name}[{i}]" for i, b in enumerate(cut_lib.blocks_at(copy, path))
            for _, n in nnx.iter_graph(b) if isinstance(n, nnx.Param)}
  cut_lib.swap_blocks(copy, path, [])
  for p, node in nnx.iter_graph(copy):
    if isinstance(node, nnx.Param) and id(node) in inside:
      out.append(f"{path_name(p)} is also a parameter of {inside[id(node)]}: only "
                 "parameters outside the blocks may be shared (a tied embedding)")
      break
  return out


def _trial(model: Any, batch: Mapping[str, Any], layers: str, loss_fn: Any
           ) -> tuple[list[str], cut_lib.LossCut | None]:
  """Traces the loss on abstract values of `batch`'s shapes, and what the cut needs of it."""
  try:
    cut = cut_lib.LossCut(model, loss_fn, batch, layers)
  except cut_lib.CutError as e:
    return [str(e)], None
  if cut.weights_read_params():
    return ["the weights the loss returns, (losses, weights), depend on the model's "
            "parameters: they must come from the batch (a pad mask, per-token weights), which "
            "is summed before the step"], None
  unused = cut.unused_params()
  if not unused:
    return [], cut
  listed = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
  return [f"parameter(s) {listed} are never read by the loss, so no stage would train them: "
          "use them or delete them"], None


@outside_ambient_mesh
def check_stageable(model: Any, *, num_stages: int | None = None, seq_len: int | None = None,
                    batch: Mapping[str, Any] | None = None, layers: str = "",
                    loss_fn: Any = None, data: Any = None) -> cut_lib.LossCut | None:
  """Checks that `model` (and `loss_fn(model, batch)`, or the model's own loss) can be cut.

  Args:
    model: the model.
    num_stages: the pipeline depth it will be cut into, if known.
    seq_len: trace the loss on the shipped token batch of this length (`token_batch`).
    batch: or on one micro-batch of these entries (`{key: array or ShapeDtypeStruct}`).
    data: or on one sample of this source (`train`'s `data`).
    layers: `model.layers`, the dotted path of the blocks ("" finds them).
    loss_fn: the user's loss (None: the model's own, `cut.default_loss_fn`).

  Returns:
    The loss traced on one sample (`cut.LossCut`, what `describe` measures), when a batch was
    given.

  Raises:
    NotStageableError: listing every problem found.
  """
  if batch is None and data is not None:
    from resilient_jax.data import RecordSource, sample_shapes

    try:
      shapes = sample_shapes(RecordSource(data))
    except ValueError as e:
      raise NotStageableError(str(e)) from None
    batch = {k: jax.ShapeDtypeStruct((1, *s), d) for k, (s, d) in shapes.items()}
  if batch is None and seq_len is not None:
    batch = token_batch(seq_len)
  problems, cut = _problems(model, num_stages, batch, layers, loss_fn)
  if problems:
    raise NotStageableError("the model cannot be cut into pipeline stages: "
                            + "; ".join(problems))
  return cut


def _flops(fn: Any, *specs: Any) -> float:
  """Multiply-adds of `fn` on `specs`, from XLA's cost analysis (0 when unknown)."""
  try:
    cost = jax.jit(fn).lower(*specs).cost_analysis()
  except Exception:  # noqa: BLE001 - a cost estimate never stops a run
    return 0.0
  cost = cost[0] if isinstance(cost, list) else cost
  return float((cost or {}).get("flops", 0.0)) / 2


def _vocab(model: Any) -> int:
  """The largest embedding table's rows (token ids a token source may hold), else 256."""
  sizes = [n.num_embeddings for _, n in nnx.iter_graph(model) if isinstance(n, nnx.Embed)]
  return max(sizes, default=256)


@outside_ambient_mesh
def describe(model: Any, batch: Mapping[str, Any], layers: str = "", loss_fn: Any = None,
             seq_len: int | None = None, cut: cut_lib.LossCut | None = None
             ) -> CustomModelConfig:
  """The cost description of a user's model, measured from its traced loss on one sample
  (`batch`: one sample's entries, leading axis 1): FLOPs from XLA's cost analysis of a middle
  block's segment and of the last segment less its block (the head), parameter counts by what
  each segment reads, the bytes crossing the first cut, and a fingerprint of its parameter
  names and shapes. `cut`: that loss already traced on `batch` (`check_stageable`'s)."""
  cut = cut or cut_lib.LossCut(model, loss_fn, batch, layers)
  n = cut.num_blocks
  segments = cut.segments([range(i, i + 1) for i in range(n)])
  params = cut.binder.abstract_params()
  seeds = jax.ShapeDtypeStruct((cut.microbatch, 2), jnp.int32) if cut.uses_rng else None

  def flops(seg: cut_lib.Segment) -> float:
    p = {k: params[k] for k in seg.param_names}
    b = {k: cut.batch_specs[k] for k in seg.batch_keys}
    xs = list(seg.carry_in.specs) if seg.carry_in is not None else []
    return _flops(lambda p, xs, b, s: seg(p, xs, b, s), p, xs, b, seeds)

  names = cut.names
  blocks = cut_lib.blocks_at(model, cut.path)
  own = [{names[id(v)] for _, v in nnx.iter_graph(b) if isinstance(v, nnx.Param)}
         for b in blocks]
  last_flops = flops(segments[-1])
  middle = segments[1] if n > 2 else segments[0]
  block_flops = flops(middle) if n > 1 else last_flops
  carry = segments[0].carry_out
  seq = seq_len or max((s.shape[1] for s in cut.batch_specs.values() if len(s.shape) > 1),
                       default=1)
  hidden = 1 if carry is None else max(1, carry.nbytes // (4 * cut.microbatch * seq))

  def count(keys: set[str]) -> int:
    return sum(int(math.prod(params[k].shape)) for k in keys)

  shapes = sorted((k, tuple(v.shape)) for k, v in params.items())
  first_used = set(segments[0].param_names)
  last_used = set(segments[-1].param_names)
  return CustomModelConfig(
    vocab_size=_vocab(model),
    seq_len=seq,
    num_layers=n,
    block_flops=max(block_flops, 1.0),
    head_flops=max(last_flops - block_flops, 0.0),
    embed_params=count(first_used - own[0] - (last_used if n == 1 else set())),
    block_params=count(own[0]),
    head_params=count(last_used - own[-1]),
    hidden=int(hidden),
    fingerprint=hashlib.sha256(repr(shapes).encode()).hexdigest()[:16],
  )
