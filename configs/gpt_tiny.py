"""A tiny GPT on simulated CPU devices: the README's main job and the tests' model.

Run:
  python -m launch.train --config=configs/gpt_tiny.py --workdir=/tmp/run \
      --config.mesh.dp=2 --config.mesh.pp=4 --config.pipeline.schedule=zb-h1

Variants (`--config=configs/gpt_tiny.py:NAME`):
  default   4 layers, d=64, synthetic data, 2x2 grid.
  text      byte-level training on the Python reference text shipped with the package.
  runlocal  the smallest thing that exercises every code path (tests use it).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = dict(
    name="gpt",  # the model family: gpt or llama (configs/llama_tiny.py)
    vocab_size=256,
    seq_len=32,
    num_layers=4,
    num_heads=2,
    d_model=64,
    mlp_ratio=4,
    tied_head=False,
    dtype="float32",  # compute dtype; bfloat16 for mixed precision
    param_dtype="float32",
    remat="none",  # per block: none, full, or a jax.checkpoint_policies name (dots_saveable)
    module="",  # your own model instead: package.module:build_model (docs/own_model.md)
  )
  # tp: devices per worker (tensor parallelism in a stage); placement: multi-process jobs
  # (docs/clusters.md)
  c.mesh = dict(dp=2, pp=2, tp=1, placement="pipeline")
  c.pipeline = dict(schedule="1f1b", microbatches=4, partition="")
  c.train = dict(
    steps=20,
    global_batch=32,
    seed=0,
    data="synthetic",  # or text, or tokens (train.data_path, train.data_dtype), or pkg.mod:source
    loss_fn="",  # your own loss_fn(model, batch): package.module:loss_fn
    data_path="",
    data_dtype="uint16",
    stop_after=0,
    max_nonfinite_steps=10,
    accumulate_steps=1,  # global batches per optimizer step
    eval_every=0,  # held-out evaluation every N steps and the last (0: off)
    eval_batches=1,  # held-out batches (of a step's samples) per evaluation
  )
  c.optimizer = dict(
    name="adamw",
    learning_rate=3e-3,
    schedule="warmup_cosine",
    warmup_steps=4,
    min_lr_ratio=0.1,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    momentum=0.9,
    weight_decay=0.01,
    decay_embeddings=True,
    clip_global_norm=0.0,
  )
  c.faults = dict(schedule="", nonfinite="", corrupt="", slow="")
  c.resilience = dict(
    policy="recycle",
    memory_cap=0,
    activation_budget_mb=0.0,  # MiB per worker for in-flight activations (0: none); caps replans
    tolerate=1,
    min_pipeline_nodes=0,
    mean_steps_between_failures=500.0,
    restart_steps=20.0,
    regroup_steps=1.0,
    restore_on_stage_loss=True,
    check_replicas_every=0,
    straggler_every=0,  # e.g. 1: time every op to find slow workers (training/stragglers.py)
    straggler_threshold=1.5,
    straggler_steps=3,
  )
  c.checkpoint = dict(every_steps=0, keep=3, if_busy="wait", init_from="", local_dir="")
  c.profile = dict(trace_steps="", peak_tflops=0.0)  # trace_steps e.g. "3,4": jax.profiler traces
  # Multi-process runs (launch/local.py, launch/slurm, launch/tpu, launch/gke) set enabled=true.
  c.distributed = dict(
    enabled=False,
    coordinator="",
    num_processes=0,
    process_id=-1,
    heartbeat_timeout_s=10,
    wait_timeout_s=120,
    kv_keep_steps=8,
  )
  c = ml_collections.ConfigDict(c)
  if arg == "text":
    c.train.data = "text"
    c.model.seq_len = 64
  elif arg == "runlocal":
    c.model.update(seq_len=16, d_model=32, num_heads=2)
    c.train.update(steps=3, global_batch=16)
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of configs/gpt_tiny.py (choose text or runlocal)")
  return c
