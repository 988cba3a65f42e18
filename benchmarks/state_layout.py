"""Why a stage's state is a buffer per block, not one buffer: compile time and run time of the
layouts a forward and backward can read its parameters from, side by side.

Run:
  python benchmarks/state_layout.py                 # 4 and 16 layers
  python benchmarks/state_layout.py --layers=8 --repeats=5

The tiny GPT (d_model 64) at each depth, its whole loss's value and gradient as one jitted
program (what a whole-model stage's F and BW compile), the gradients written in the parameters'
layout, for four layouts of the parameters:

  - arrays:  one argument per parameter (a stage's programs before its state was packed);
  - blocks:  a buffer per block (`programs/state.py`: the library's; what AdamW decays and what
    it does not are two regions of it);
  - blocks+matrices: each matrix a buffer of its own (read without a slice), a block's
    vectors one buffer;
  - one:     one buffer: arguments the same at any depth;
  - stacked: the blocks' buffers stacked into one [blocks, n] array (also constant).

Printed per layout and depth: arguments, XLA compile CPU seconds (a fresh trace and compile
each repeat, interleaved, median) and run milliseconds (median of 20 calls). XLA:CPU compiles
each distinct kernel once: a slice at another offset of one buffer is another kernel, so reading
every parameter out of one buffer (or one stacked array) makes every block's kernels distinct,
where a buffer per block keeps identical blocks' kernels identical.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", default="4,16")
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args(argv)
  sys.path.insert(0, ROOT)
  from benchmarks.results import record
  from resilient_jax.runtime import setup as runtime_setup

  runtime_setup.configure_jax(1)
  import jax

  figures: dict[str, float] = {}
  load = os.getloadavg()[0]
  print(f"load average at start: {load:.2f}; {os.cpu_count()} cores")
  print("| layers | layout | arguments | compile CPU s (median) | run ms (median) |")
  print("|---|---|---|---|---|")
  for layers in [int(x) for x in args.layers.split(",")]:
    variants = _variants(layers)
    times: dict[str, list[float]] = {v: [] for v in variants}
    runs: dict[str, float] = {}
    for r in range(args.repeats):
      names = list(variants)
      for name in names[r % len(names):] + names[:r % len(names)]:
        fn, call_args = variants[name]

        def fresh(*a, _fn=fn):
          return _fn(*a)

        fresh.__name__ = f"{name.replace('+', '_')}_{r}"  # another module: JAX's cache misses
        lowered = jax.jit(fresh).lower(*call_args)
        c0 = time.process_time()
        compiled = lowered.compile()
        times[name].append(time.process_time() - c0)
        if name not in runs:
          jax.block_until_ready(compiled(*call_args))
          ts = []
          for _ in range(20):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*call_args))
            ts.append(time.perf_counter() - t0)
          runs[name] = statistics.median(ts) * 1e3
    for name, (_, call_args) in variants.items():
      c = statistics.median(times[name])
      n = len(jax.tree.leaves(call_args))
      print(f"| {layers} | {name} | {n} | {c:.2f} | {runs[name]:.2f} |")
      figures[f"compile_s_{name}_{layers}"] = round(c, 3)
      figures[f"args_{name}_{layers}"] = n
    for name in ("one", "stacked", "arrays"):
      ratio = statistics.median(times[name]) / statistics.median(times["blocks"])
      figures[f"compile_{name}_over_blocks_{layers}"] = round(ratio, 2)
      print(f"compile_{name}_over_blocks_{layers}: {ratio:.2f}")
  print(f"load average at end: {os.getloadavg()[0]:.2f}")
  record("state_layout", figures)


def _variants(layers: int) -> dict:
  """Each layout's (function, arguments): the loss's value and its gradients in that layout."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from resilient_jax.checkpoint import universal
  from resilient_jax.model.check import token_batch
  from resilient_jax.model.cut import default_loss_fn
  from resilient_jax.recipe import decay_mask
  from tests.helpers import tiny_config

  cfg = tiny_config(model__num_layers=layers, model__d_model=64)
  model = cfg.model.build(0)
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  names = [universal._key(path).replace("/", ".") for path, _ in flat]
  leaves = [v for _, v in flat]
  treedef = jax.tree.structure(params)
  batch = {k: jnp.zeros(v.shape, v.dtype) for k, v in token_batch(cfg.model.seq_len, 4).items()}
  loss_of = default_loss_fn(model)

  def loss(arrays):
    out = loss_of(nnx.merge(graph, jax.tree.unflatten(treedef, arrays), rest), batch)
    return (out[0] if isinstance(out, tuple) else out).mean()

  decays = decay_mask(cfg)(dict(zip(names, leaves, strict=True)))
  block = [int(n.split(".")[1]) if n.startswith("blocks.") else -1 for n in names]
  groups: dict[int, list[int]] = {}  # a block's arrays, what decays after what does not
  for i in sorted(range(len(names)), key=lambda i: (bool(decays[names[i]]), i)):
    groups.setdefault(block[i], []).append(i)
  sizes = [int(np.prod(x.shape)) for x in leaves]

  def cut(buffers: list, spans: list[list[int]]) -> list:
    out = [None] * len(leaves)
    for buf, span in zip(buffers, spans, strict=True):
      at = 0
      for i in span:
        out[i] = jax.lax.slice(buf, (at,), (at + sizes[i],)).reshape(leaves[i].shape)
        at += sizes[i]
    return out

  def packed(grads: list, spans: list[list[int]]) -> list:
    return [jnp.concatenate([grads[i].ravel() for i in span]) for span in spans]

  def layout(spans: list[list[int]]):
    def fn(buffers):
      value, grads = jax.value_and_grad(loss)(cut(buffers, spans))
      return value, packed(grads, spans)
    return fn, ([jnp.concatenate([leaves[i].ravel() for i in s]) for s in spans],)

  per_block = list(groups.values())
  matrices = [[i] for span in per_block for i in span if leaves[i].ndim >= 2] + \
    [small for span in per_block if (small := [i for i in span if leaves[i].ndim < 2])]
  one = [[i for span in per_block for i in span]]
  rows = [groups[k] for k in sorted(k for k in groups if k >= 0)]
  others = [groups[k] for k in groups if k < 0]

  def stacked(array, rest_bufs):
    bufs = [array[j] for j in range(array.shape[0])] + list(rest_bufs)
    value, grads = jax.value_and_grad(loss)(cut(bufs, rows + others))
    g = packed(grads, rows + others)
    return value, (jnp.stack(g[:len(rows)]), g[len(rows):])

  stacked_args = (jnp.stack([jnp.concatenate([leaves[i].ravel() for i in s]) for s in rows]),
                  [jnp.concatenate([leaves[i].ravel() for i in s]) for s in others])
  return {
    "arrays": (lambda arrays: jax.value_and_grad(loss)(arrays), (leaves,)),
    "blocks": layout(per_block),
    "blocks+matrices": layout(matrices),
    "one": layout(one),
    "stacked": (stacked, stacked_args),
  }


if __name__ == "__main__":
  main()
