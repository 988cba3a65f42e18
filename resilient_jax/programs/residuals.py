"""What a stage's forward keeps for its backward, and how B and W read it back.

F's compiled program returns only what B and W read (`trimmed_outputs`); the caller's own arrays
(a parameter, the stage input) are put back where F's outputs forward them rather than copied.
On one device the residuals F computes travel packed (`programs.packing`: JAX's call costs host
time per array, and a whole-model stage of the tiny GPT has 161 of them), in three packs so
each half of a split backward frees its own: those only B reads, those both read, those only W
reads; each pack is cut where the model's blocks repeat (`packing.repeats`, so identical blocks
keep identical, shared kernels). On a sub-mesh every residual stays an array of its own
(packing would re-split them).

Growth: per micro-batch, O(dtypes x repeats) arrays cross each program call instead of
O(residuals);
bytes kept are the residuals' own (a residual that is also the stage's output is the output
array itself, not a packed copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.extend import core as jcore

from resilient_jax.programs import packing

PACKS = {"b": ("b", "s"), "w": ("s", "w")}
"""The packs of a `Kept` for B and for W: residuals only B reads, both read, only W reads."""


class Kept(NamedTuple):
  """What F keeps for B (`residuals`) or W (`saved`): packed residuals (`PACKS`, each a tuple of
  chunks, None where empty), residuals passed as themselves, and the parameters among them (the
  caller's own)."""

  packs: tuple[tuple[packing.Packed, ...] | None, ...]
  arrays: tuple[Any, ...]
  params: dict[str, Any]


class Residuals:
  """Where each residual of a stage's backward comes from.

  Args:
    closed: F's jaxpr: outputs are the stage output's `n_out` leaves, then the residuals; its
      inputs the parameters' leaves (`param_names` order), then the other arguments'.
    n_out: leaves of the stage output.
    b_residuals, w_residuals: the residuals B and W read (positions among the residuals).
    param_names: the stage's parameters, in its inputs' order.
    packed: whether computed residuals travel packed (one device).
  """

  def __init__(self, closed: jcore.ClosedJaxpr, n_out: int, b_residuals: Sequence[int],
               w_residuals: Sequence[int], param_names: Sequence[str], packed: bool):
    self.kept, self.sources = trimmed_outputs(
      closed.jaxpr, n_out, set(b_residuals) | set(w_residuals))
    self.n_out = n_out
    res_src = self.sources[n_out:]
    out_kept = {s[1] for s in self.sources[:n_out] if s is not None and s[0] == "kept"}
    b_set, w_set = set(b_residuals), set(w_residuals)
    readers: dict[int, set[str]] = {}  # kept output -> which halves read it
    for r, src in enumerate(res_src):
      if src is not None and src[0] == "kept" and src[1] not in out_kept:
        readers.setdefault(src[1], set()).update(
          ({"b"} if r in b_set else set()) | ({"w"} if r in w_set else set()))
    self.packs: dict[str, list[int]] = {"b": [], "s": [], "w": []}  # kept outputs of each
    if packed:
      for j in sorted(readers):
        self.packs["s" if len(readers[j]) == 2 else next(iter(readers[j]))].append(j)
    aval = lambda j: closed.out_avals[self.kept[j]]  # noqa: E731
    self.chunks = {p: [[js[i] for i in c]
                       for c in packing.repeats([(a.shape, a.dtype) for a in map(aval, js)])]
                   for p, js in self.packs.items()}
    """Each pack cut where its residuals repeat (`packing.repeats`): a buffer per chunk, dtype."""
    packed_at = {j: (p, c, i) for p, chunks in self.chunks.items()
                 for c, js in enumerate(chunks) for i, j in enumerate(js)}
    self.layouts = {p: [packing.Layout.of_avals([aval(j) for j in js]) for js in chunks]
                    for p, chunks in self.chunks.items()}
    self.plain = sorted(out_kept | (set(range(len(self.kept))) - set(packed_at)))
    """Kept outputs F returns as arrays."""
    self._plain_at = {j: i for i, j in enumerate(self.plain)}
    n_params = len(param_names)

    def recipe(positions: Sequence[int]) -> tuple[list, list, list]:
      steps, arrays, params = [], [], []
      for r in positions:
        kind, k = res_src[r]
        if kind == "kept" and k in packed_at:
          steps.append(("pack", *packed_at[k]))
        elif kind == "input" and k < n_params:
          steps.append(("param", param_names[k]))
          params.append(param_names[k])
        else:
          steps.append(("array", len(arrays)))
          arrays.append((kind, k))
      return steps, arrays, sorted(set(params))

    self._recipes = {"b": recipe(b_residuals), "w": recipe(w_residuals)}

  def outputs(self, outs: Sequence[Any]) -> tuple[list[Any], dict[str, tuple]]:
    """Inside F's trace: of all F's outputs, the arrays it returns and the packs."""
    vals = {j: outs[k] for j, k in enumerate(self.kept)}
    return ([vals[j] for j in self.plain],
            {p: tuple(packing.Packed(lay, lay.pack([vals[j] for j in js]))
                      for lay, js in zip(self.layouts[p], chunks, strict=True))
             for p, chunks in self.chunks.items() if chunks})

  def kept_for(self, inputs: Sequence[Any], params: dict[str, Any], plain: Sequence[Any],
               packs: dict[str, tuple]) -> tuple[list[Any], Kept, Kept]:
    """After F's call: the stage output's leaves, and what B and W keep (`Kept`)."""
    value = lambda src: plain[self._plain_at[src[1]]] if src[0] == "kept" else inputs[src[1]]  # noqa: E731

    def kept(half: str) -> Kept:
      _, arrays, names = self._recipes[half]
      return Kept(tuple(packs.get(p) for p in PACKS[half]), tuple(value(a) for a in arrays),
                  (params if names else {}) if isinstance(params, packing.Packed) else
                  {n: params[n] for n in names})

    return [value(src) for src in self.sources[:self.n_out]], kept("b"), kept("w")

  def read(self, half: str, kept: Kept, params: dict[str, Any] | None = None) -> list[Any]:
    """Inside B's (`half` "b") or W's ("w") trace: the residuals it reads, in the split's
    order; the parameters among them from `params` where given, else `kept.params`."""
    params = kept.params if params is None else params
    out = []
    for step in self._recipes[half][0]:
      if step[0] == "pack":
        out.append(kept.packs[PACKS[half].index(step[1])][step[2]][step[3]])
      elif step[0] == "param":
        out.append(params[step[1]])
      else:
        out.append(kept.arrays[step[1]])
    return out


class Call:
  """A stage program called through `to_args`, which maps the runtime's arguments to the
  program's (`lower` too, for cost and memory analyses)."""

  def __init__(self, program: Any, to_args: Any):
    self.program = program
    self.to_args = to_args

  def __call__(self, *args: Any) -> Any:
    return self.program(*self.to_args(*args))

  def lower(self, *args: Any) -> jax.stages.Lowered:
    return self.program.lower(*self.to_args(*args))


def trimmed_outputs(
  jaxpr: jcore.Jaxpr, n_out: int, res_live: set[int]
) -> tuple[list[int], list[tuple[str, int] | None]]:
  """Which of F's outputs its compiled program returns, and where every other one comes from.

  What F hands to B and W is trimmed once, on F's jaxpr, rather than copied out of a jit as is:
  a parameter or the stage input among the residuals would come back as a fresh copy per
  micro-batch (the residuals of `x @ kernel` include the kernel), and residuals neither B nor W
  reads are not kept.

  Args:
    jaxpr: F's jaxpr: outputs are the stage output's `n_out` leaves, then the residuals.
    n_out: leaves of the stage output.
    res_live: the residuals B or W reads (positions among the residuals).

  Returns:
    The positions of the outputs the trimmed program returns (each distinct variable once), and
    per output leaf of F: None (not kept), `("input", i)` (input leaf i itself) or `("kept", j)`
    (output j of the trimmed program).
  """
  in_index = {v: i for i, v in enumerate(jaxpr.invars)}
  kept: list[int] = []
  first_at: dict[Any, int] = {}
  sources: list[tuple[str, int] | None] = []
  for k, v in enumerate(jaxpr.outvars):
    is_var = isinstance(v, jcore.Var)
    if k >= n_out and k - n_out not in res_live:
      sources.append(None)
    elif is_var and v in in_index:
      sources.append(("input", in_index[v]))
    elif is_var and v in first_at:
      sources.append(("kept", first_at[v]))
    else:
      if is_var:
        first_at[v] = len(kept)
      sources.append(("kept", len(kept)))
      kept.append(k)
  return kept, sources
