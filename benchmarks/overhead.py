"""Library training step against the plain `jax.jit` step of the same work.

Run:
  python benchmarks/overhead.py                                  # configs/gpt_tiny.py
  python benchmarks/overhead.py --d_model=256 --seq_len=128 --heads=4   # bigger ops
  python benchmarks/overhead.py --model=llama

For each grid dp x pp in {1x1, 2x1, 1x2} (simulated CPU devices), the same model, initial
parameters, optimizer, data and global batch, trained side by side:

  - library: `Trainer.run_step` (the public step: data, the interpreter's schedule, the
    data-parallel reduction, the per-stage optimizer), checkpoints and metrics files off;
  - plain: what a user would write in plain JAX for the same work on the same devices: one
    `jax.jit` of value_and_grad + optax with donated parameters and optimizer state, the
    gradients accumulated over the same micro-batches (`plain-unrolled`: a Python loop inside
    the jit; `plain-scan`: a `lax.scan`), or over the whole global batch at once
    (`plain-1batch`, the form that is fastest when memory allows). For 2x1 the same jit with
    the batch sharded over a 2-device mesh (XLA inserts one all-reduce of the gradients). For
    1x2 a plain two-device GPipe (`plain-pipeline`: jitted first-stage forward, last-stage
    value_and_grad, first-stage backward, `device_put` between the devices, asynchronous
    dispatch) and the 1x1 plain steps (the same model on one device).

Each grid's library step is printed against each plain step and against the fastest of them.

The models' dense layers run on 2-D `[tokens, features]` (`models.gpt.tokens`): XLA:CPU runs
the 3-D product's backward much slower, which would slow the plain steps and flatter the ratio.

Steps are interleaved round-robin (the order rotates every round), after warm-up steps that
compile; medians. Each step is timed from fetching its batch to its updated parameters being
ready. Both sides also check that they trained the same thing: the largest relative difference
of their losses is printed.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.results import record  # noqa: E402
from resilient_jax.runtime import setup as runtime_setup  # noqa: E402

GRIDS = ((1, 1), (2, 1), (1, 2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
  p.add_argument("--d_model", type=int, default=0, help="0: the config's")
  p.add_argument("--seq_len", type=int, default=0, help="0: the config's")
  p.add_argument("--layers", type=int, default=0, help="0: the config's")
  p.add_argument("--heads", type=int, default=0, help="0: the config's")
  p.add_argument("--global_batch", type=int, default=0, help="0: the config's")
  p.add_argument("--microbatches", type=int, default=0, help="per pipeline; 0: the config's")
  p.add_argument("--schedule", default="1f1b", help="the library's pipeline schedule")
  p.add_argument("--grids", default="1x1,2x1,1x2", help="dp x pp grids")
  p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
  return p.parse_args(argv)


def make_cfg(args: argparse.Namespace, dp: int, pp: int):
  import importlib

  from resilient_jax.config import from_config_dict

  cd = importlib.import_module(f"configs.{args.model}_tiny").get_config()
  cd.mesh.dp, cd.mesh.pp = dp, pp
  cd.pipeline.schedule = args.schedule
  for key, value in (("d_model", args.d_model), ("seq_len", args.seq_len),
                     ("num_layers", args.layers), ("num_heads", args.heads)):
    if value:
      cd.model[key] = value
  if args.global_batch:
    cd.train.global_batch = args.global_batch
  if args.microbatches:
    cd.pipeline.microbatches = args.microbatches
  cd.train.steps = args.warmup + args.steps
  cd.checkpoint.every_steps = 0  # no checkpoint I/O inside the timed steps
  return from_config_dict(cd)


class LibraryStep:
  """`Trainer.run_step`, the library's public training step, on the first dp*pp devices."""

  def __init__(self, cfg, devices):
    from resilient_jax.training.loop import Trainer

    self.workdir = tempfile.TemporaryDirectory(prefix="overhead_")
    self.trainer = Trainer(cfg, self.workdir.name, devices=devices, log=lambda _: None)
    # Host time: of each gradient reduction's call (the interpreter's data-parallel sum, all
    # dispatch: it returns before the sum is computed), and of the step's whole dispatch loop.
    self.reduce_s: list[float] = []
    self.dispatch_s: list[float] = []
    self.ops = sum(len(slot.ops) for slot in self.trainer.interpreter.step_program.slots.values())
    transport = self.trainer.transport
    reduce = transport.reduce

    def timed_reduce(*a, **kw):
      t0 = time.perf_counter()
      out = reduce(*a, **kw)
      self.reduce_s.append(time.perf_counter() - t0)
      return out

    transport.reduce = timed_reduce

  def __call__(self, t: int) -> float:
    import jax

    result = self.trainer.run_step(t).result
    self.dispatch_s.append(result.dispatch_time_s)
    jax.block_until_ready(list(self.trainer.interpreter.params.values()))
    return result.loss

  def host_line(self) -> str:
    ar = f"{statistics.median(self.reduce_s) * 1e3:.2f} ms per reduction " \
      f"({len(self.reduce_s)} timed)" if self.reduce_s else "no cross-device reduction"
    per_op = statistics.median(self.dispatch_s) / self.ops * 1e3
    return f"host time: {ar}; dispatch loop {per_op:.3f} ms per op ({self.ops} ops a step)"


PLAIN_FORMS = ("unrolled", "scan", "1batch")


class PlainStep:
  """One `jax.jit` of value_and_grad + optax over the first `mesh.dp` devices.

  Parameters are replicated and the batch is sharded over the devices (for dp > 1, plain data
  parallelism: XLA inserts the gradients' all-reduce, one for all micro-batches). `form` is how
  the step goes through the global batch: `unrolled` accumulates the gradients of the library's
  micro-batches in a Python loop inside the jit, `scan` in a `lax.scan`, `1batch`
  differentiates the whole global batch at once.
  """

  def __init__(self, cfg, devices, *, form: str = "unrolled"):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from resilient_jax.model.staging import (
      Binder,
      flat_params,
      token_cross_entropy,
      variable_names,
    )
    from resilient_jax.recipe import make_data, make_model, reference_optimizer

    self.cfg = cfg
    model = make_model(cfg)
    names = variable_names(model)
    bind = Binder(model, names)  # nnx.merge of the model with flat parameters
    if bind.uses_rng:
      raise ValueError("the plain steps here do not draw per-sample random numbers")
    per_token = token_cross_entropy
    optimizer = reference_optimizer(cfg)
    self.source, self.plan = make_data(cfg)
    dp = cfg.mesh.dp
    mesh = Mesh(devices[:dp], ("dp",))
    replicated = NamedSharding(mesh, PartitionSpec())
    # Micro-batch axis first, samples of a micro-batch (all pipelines' share) sharded over dp.
    self.batch_sharding = NamedSharding(mesh, PartitionSpec(None, "dp"))
    self.params = jax.device_put(dict(flat_params(model, names)), replicated)
    self.opt_state = jax.device_put(optimizer.init(self.params), replicated)
    tokens = cfg.step_batch * cfg.model.seq_len
    if form not in PLAIN_FORMS:
      raise ValueError(f"form {form!r} is not one of {PLAIN_FORMS}")
    self.form = form

    def loss_sum(p, x, y):
      return per_token(bind.run(p, lambda m, x: m(x), (x,)), y).sum() / tokens

    def step(p, o, xs, ys):
      if form == "scan":
        def body(acc, xy):
          return jax.tree.map(jnp.add, acc, jax.value_and_grad(loss_sum)(p, *xy)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, p))
        (loss, grads), _ = jax.lax.scan(body, zero, (xs, ys))
      else:  # unrolled (one micro-batch for 1batch)
        loss, grads = jax.value_and_grad(loss_sum)(p, xs[0], ys[0])
        for i in range(1, xs.shape[0]):
          li, gi = jax.value_and_grad(loss_sum)(p, xs[i], ys[i])
          loss, grads = loss + li, jax.tree.map(jnp.add, grads, gi)
      updates, o = optimizer.update(grads, o, p)
      return jax.tree.map(jnp.add, p, updates), o, loss

    self.step = jax.jit(step, donate_argnums=(0, 1))

  def __call__(self, t: int) -> float:
    import jax

    from resilient_jax.recipe import step_batch

    cfg = self.cfg
    dp, m = cfg.mesh.dp, cfg.step_microbatches
    _, inputs, targets = step_batch(cfg, self.source, self.plan, t)  # [dp*m, mb, seq]
    shape = (1 if self.form == "1batch" else m, -1, cfg.model.seq_len)
    # Any assignment of samples to micro-batches gives the same sums; this one keeps each
    # micro-batch's samples contiguous, as the library's pipelines receive them.
    xs = jax.device_put(inputs.reshape(dp, m, -1, cfg.model.seq_len).swapaxes(0, 1)
                        .reshape(shape), self.batch_sharding)
    ys = jax.device_put(targets.reshape(dp, m, -1, cfg.model.seq_len).swapaxes(0, 1)
                        .reshape(shape), self.batch_sharding)
    self.params, self.opt_state, loss = self.step(self.params, self.opt_state, xs, ys)
    loss = float(loss)
    jax.block_until_ready(self.params)
    return loss


class PlainPipeline:
  """A plain-JAX two-stage GPipe over two devices, what a user would write without the library:
  per micro-batch the first stage's forward (keeping its residuals), the last stage's
  value_and_grad with respect to its parameters and input, the first stage's backward;
  activations and their gradients moved with `device_put`; gradients accumulated in donated
  buffers; one optax update per stage. Every forward is dispatched first, so the first device
  runs ahead while the second works (asynchronous dispatch)."""

  def __init__(self, cfg, devices):
    import jax
    import jax.numpy as jnp

    from resilient_jax.model.staging import (
      Binder,
      flat_params,
      token_cross_entropy,
      variable_names,
    )
    from resilient_jax.recipe import make_data, make_model, make_optimizer

    if cfg.mesh.pp != 2 or cfg.mesh.dp != 1:
      raise ValueError("PlainPipeline is the 1x2 grid")
    if cfg.optimizer.clip_global_norm:
      raise ValueError("global-norm clipping needs both stages' norms; not in this baseline")
    self.cfg = cfg
    model = make_model(cfg)
    if getattr(cfg.model, "tied_head", False):
      raise ValueError("a tied head puts one weight on both stages; not in this baseline")
    names = variable_names(model)
    per_token = token_cross_entropy
    optimizer = make_optimizer(cfg)
    self.source, self.plan = make_data(cfg)
    first, last = cfg.partition
    bind = Binder(model, names)  # nnx.merge of the model with flat parameters

    def s0(m, x):  # the model's own parts, as a user splits a GPT by hand
      x = m.embed(x)
      for i in first:
        x = m.blocks[i](x)
      return x

    def s1(m, x):
      for i in last:
        x = m.blocks[i](x)
      return m.head(x)

    everything = flat_params(model, names)
    used = [[n for n in everything if n.startswith("embed.") or any(
              n.startswith(f"blocks.{i}.") for i in first)],
            [n for n in everything if n.startswith("head.") or any(
              n.startswith(f"blocks.{i}.") for i in last)]]
    self.devs = devices[:2]
    self.params = [jax.device_put({n: everything[n] for n in u}, d)
                   for u, d in zip(used, self.devs, strict=True)]
    self.opt = [jax.device_put(optimizer.init(p), d) for p, d in zip(self.params, self.devs,
                                                                      strict=True)]
    tokens = cfg.step_batch * cfg.model.seq_len

    fwd0, bwd0 = jax.fwd_and_bwd(lambda p, x: bind.run(p, s0, (x,)), argnums=0, jitted=False)
    self.fwd0 = jax.jit(fwd0)

    def bwd0_acc(res, g, acc):
      return jax.tree.map(jnp.add, acc, bwd0(res, g))

    self.bwd0 = jax.jit(bwd0_acc, donate_argnums=(2,))

    def last_acc(p, h, y, acc):
      loss, (gp, gh) = jax.value_and_grad(
        lambda p, h: per_token(bind.run(p, s1, (h,)), y).sum() / tokens,
        argnums=(0, 1))(p, h)
      return loss, gh, jax.tree.map(jnp.add, acc, gp)

    self.last = jax.jit(last_acc, donate_argnums=(3,))
    self.zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))

    def update(p, o, g):
      updates, o = optimizer.update(g, o, p)
      return jax.tree.map(jnp.add, p, updates), o

    self.update = jax.jit(update, donate_argnums=(0, 1))

  def __call__(self, t: int) -> float:
    import jax

    from resilient_jax.recipe import step_batch

    cfg = self.cfg
    d0, d1 = self.devs
    _, inputs, targets = step_batch(cfg, self.source, self.plan, t)  # [m, mb, seq]
    p0, p1 = self.params
    acc0, acc1 = self.zeros(p0), self.zeros(p1)
    fwd = [self.fwd0(p0, jax.device_put(x, d0)) for x in inputs]
    losses = []
    for (h, res), y in zip(fwd, targets, strict=True):
      loss, gh, acc1 = self.last(p1, jax.device_put(h, d1), jax.device_put(y, d1), acc1)
      acc0 = self.bwd0(res, jax.device_put(gh, d0), acc0)
      losses.append(loss)
    self.params[0], self.opt[0] = self.update(p0, self.opt[0], acc0)
    self.params[1], self.opt[1] = self.update(p1, self.opt[1], acc1)
    loss = float(sum(float(v) for v in losses))
    jax.block_until_ready(self.params)
    return loss


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  grids = [tuple(int(v) for v in g.split("x")) for g in args.grids.split(",") if g.strip()]
  runtime_setup.configure_jax(max(dp * pp for dp, pp in grids))

  import jax

  devices = jax.devices()
  variants: dict[str, object] = {}
  baselines: dict[str, list[str]] = {}  # per grid: the plain steps its library step is held to
  cfgs = {}
  for dp, pp in grids:
    g = f"{dp}x{pp}"
    cfg = cfgs[g] = make_cfg(args, dp, pp)
    variants[f"{g} library"] = LibraryStep(cfg, devices)
    if pp == 1:
      baselines[g] = [f"{g} plain-{form}" for form in PLAIN_FORMS]
      for form in PLAIN_FORMS:
        variants[f"{g} plain-{form}"] = PlainStep(cfg, devices, form=form)
    else:
      variants[f"{g} plain-pipeline"] = PlainPipeline(cfg, devices)
      # The same model on one device: the 1x1 plain steps, timed once if 1x1 runs too.
      one = [f"1x1 plain-{form}" for form in PLAIN_FORMS]
      baselines[g] = [f"{g} plain-pipeline", *one]
      for form, n in zip(PLAIN_FORMS, one, strict=True):
        if n not in variants:
          variants[n] = PlainStep(make_cfg(args, 1, 1), devices, form=form)

  names = list(variants)
  losses: dict[str, list[float]] = collections.defaultdict(list)
  times: dict[str, list[float]] = collections.defaultdict(list)
  for t in range(1, args.warmup + 1):
    for n in names:
      variants[n](t)
  load_before = os.getloadavg()
  for i in range(args.steps):
    t = args.warmup + 1 + i
    order = names[i % len(names):] + names[: i % len(names)]
    for n in order:
      t0 = time.perf_counter()
      losses[n].append(variants[n](t))
      times[n].append(time.perf_counter() - t0)
  load_after = os.getloadavg()

  cfg0 = next(iter(cfgs.values()))
  mdl = cfg0.model
  print(
    f"{mdl.name}: d_model={mdl.d_model}, layers={mdl.num_layers}, heads={mdl.num_heads}, "
    f"seq_len={mdl.seq_len}, global_batch={cfg0.train.global_batch}, micro-batches per "
    f"pipeline {cfg0.pipeline.microbatches}, optimizer {cfg0.optimizer.name}, schedule "
    f"{args.schedule}; {jax.devices()[0].platform}, {len(devices)} simulated devices on "
    f"{os.cpu_count()} cores; {args.steps} timed steps per variant after {args.warmup} warm-up"
  )
  print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
  print(f"{'grid':5} {'step':24} {'median ms':>10}  library/this (of medians; median of "
        "per-round ratios)")
  figures: dict[str, float] = {}
  for dp, pp in grids:
    g = f"{dp}x{pp}"
    lib = times[f"{g} library"]
    lib_med = statistics.median(lib)
    print(f"{g:5} {'library':24} {lib_med * 1e3:10.2f}  {variants[f'{g} library'].host_line()}")
    for n in baselines[g]:
      med = statistics.median(times[n])
      rounds = statistics.median(a / b for a, b in zip(lib, times[n], strict=True))
      rel = max(abs(a - b) / abs(b) for a, b in zip(losses[f"{g} library"], losses[n],
                                                     strict=True))
      print(f"{'':5} {n:24} {med * 1e3:10.2f}  {lib_med / med:6.3f} ({rounds:.3f})   "
            f"losses max rel diff {rel:.1e}")
    best = min(baselines[g], key=lambda n: statistics.median(times[n]))
    print(f"{'':5} library / fastest plain ({best}): "
          f"{lib_med / statistics.median(times[best]):.3f}")
    figures[f"{g}_library_ms"] = round(lib_med * 1e3, 2)
    figures[f"{g}_library_over_fastest_plain"] = round(lib_med / statistics.median(times[best]), 3)
  record("overhead" + (f"_{args.model}" if args.model != "gpt" else ""), figures)


if __name__ == "__main__":
  main()
