"""Stage programs shared by every trainer of a process: built once per model signature, layer
split, batch shape, optimizer and loss, and kept (`SHARED_PROGRAMS`), so a second trainer of the
same configuration (a test suite, a notebook, a sweep, `benchmarks/`) neither traces, lowers
nor loads its programs again; only its own initial parameter values are read.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from resilient_jax.model.cut import LossCut
from resilient_jax.model.staging import variable_names
from resilient_jax.programs.stages import StageInfo, StagePrograms


def build_stage_programs(
  model: Any,
  partition: Sequence[range],
  batch: Mapping[str, Any],
  optimizer: optax.GradientTransformation,
  global_batch: int,
  tp: int = 1,
  optimizer_key: Hashable | None = None,
  remat: str = "none",
  layers: str = "",
  loss_fn: Callable | None = None,
) -> list[StagePrograms]:
  """Programs for every stage of a layer split, each a segment of the model's loss traced on
  one micro-batch (`batch`: its entries' shapes) and cut at its blocks (`cut.LossCut`);
  `loss_fn`: the user's `loss_fn(model, batch)` (None: the model's own, `default_loss_fn`);
  `tp`: devices of each worker's sub-mesh; `remat`: each block's rematerialisation
  (`model.remat`); `layers`: the dotted path of the model's blocks ("": found).

  With `optimizer_key` (a hashable description of everything `optimizer` computes with, e.g.
  `recipe.optimizer_key`), the programs are shared by every caller of this process that asks
  for the same stages of a model of the same `model_signature`: a second trainer of the same
  configuration (a test suite, a notebook, a sweep, `benchmarks/`) neither traces, lowers nor
  loads its programs again, it only reads its own initial parameter values. The last
  `SHARED_PROGRAMS` distinct requests are kept; `clear_shared_programs` drops them.
  """
  names = variable_names(model)
  key = None
  if optimizer_key is not None:
    key = (model_signature(model), tuple((r.start, r.stop) for r in partition),
           _batch_key(batch), global_batch, tp, optimizer_key, remat, layers, loss_fn)
    try:
      hash(key)
    except TypeError:  # a static attribute of the model that cannot be hashed: not shared
      key = None
  if key is not None:
    with _shared_lock:
      shared = _shared.get(key)
      if shared is not None:
        _shared.move_to_end(key)
    if shared is not None:
      return [prog.for_model(model, names) for prog in shared]
  cut = loss_cut(model, batch, loss_fn, layers, remat)
  split = tuple(partition)
  programs = [StagePrograms(model, StageInfo(s, len(split), layers_, split), cut, optimizer,
                            global_batch, names, tp)
              for s, layers_ in enumerate(split)]
  if key is not None:
    with _shared_lock:
      # Kept without this model's initial values: a kept entry holds compiled programs and
      # traced functions, not a copy of any model's parameters.
      _shared[key] = [_without_initial(p) for p in programs]
      while len(_shared) > SHARED_PROGRAMS:
        _shared.popitem(last=False)
  return programs


def loss_cut(model: Any, batch: Mapping[str, Any], loss_fn: Callable | None = None,
             layers: str = "", remat: str = "none") -> LossCut:
  """The model's loss traced on one micro-batch's shapes (`cut.LossCut`), once per process for
  a model of the same `model_signature`, batch shapes, loss, blocks and remat (the last
  `SHARED_PROGRAMS` kept): every split of the layers cuts the same trace."""
  key = (model_signature(model), _batch_key(batch), loss_fn, layers, remat)
  try:
    hash(key)
  except TypeError:
    key = None
  with _shared_lock:
    cut = _cuts.get(key) if key is not None else None
  if cut is None:
    cut = LossCut(model, loss_fn, batch, layers, remat)
    if key is not None:
      with _shared_lock:
        _cuts[key] = cut
        while len(_cuts) > SHARED_PROGRAMS:
          _cuts.popitem(last=False)
  return cut


def _batch_key(batch: Mapping[str, Any]) -> tuple:
  """A micro-batch's entries, shapes and dtypes, hashable (what its trace depends on)."""
  return tuple(sorted((k, tuple(np.shape(v)), str(np.dtype(v.dtype))) for k, v in batch.items()))


SHARED_PROGRAMS = 8
"""How many distinct stage-program requests a process keeps for reuse (`build_stage_programs`).

Few: each holds its programs' executables loaded on every device that ran them, and on
XLA:CPU every loaded executable maps memory of its own, against Linux's limit of 65530 maps
per process (`vm.max_map_count`). With 32 kept, the test suite's process crashed (SIGSEGV)
loading an executable late in the suite, its map count growing past 24k halfway; with 8 it
peaks at 36k maps (2026-11-25)."""
_shared: collections.OrderedDict[Hashable, list[StagePrograms]] = collections.OrderedDict()
_cuts: collections.OrderedDict[Hashable, LossCut] = collections.OrderedDict()
_shared_lock = threading.Lock()


def clear_shared_programs() -> None:
  """Drops the stage programs kept for reuse (their compiled executables go with the last
  trainer that holds them)."""
  with _shared_lock:
    _shared.clear()
    _cuts.clear()


def _without_initial(prog: StagePrograms) -> StagePrograms:
  kept = copy.copy(prog)
  kept._initial = {}
  return kept


def model_signature(model: Any) -> Hashable:
  """What a stage's programs depend on of `model`, short of tracing it.

  Its structure (`nnx.graphdef`: module classes, their static attributes, which variables are
  shared), and every variable's path, type, shape, dtype and metadata (the logical axes that
  split it over a sub-mesh). Parameter values are arguments of every program, so they are left
  out; the values of the other variables (RNG stream keys and counts, which the programs read
  as constants) are in, by digest. `flax.nnx.jit` keys its own traces on the graphdef the same
  way.
  """
  parts = []
  try:
    for path, node in nnx.iter_graph(model):
      if not isinstance(node, nnx.Variable):
        continue
      value = node[...]
      meta = repr(sorted(node.get_metadata().items()))
      part = (path, type(node).__name__, tuple(np.shape(value)), str(value.dtype), meta)
      if not isinstance(node, nnx.Param):
        data = jax.random.key_data(value) if jnp.issubdtype(value.dtype, jax.dtypes.prng_key) \
          else value
        part += (hashlib.sha256(np.asarray(data).tobytes()).hexdigest(),)
      parts.append(part)
    return nnx.graphdef(model), tuple(parts)
  except (AttributeError, TypeError, ValueError):  # a variable holding something unusual:
    return object()  # a signature equal to no other, so its programs are its own
