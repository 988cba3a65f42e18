"""Host failures under the two placements: GPT-3 6.7B on 512 A100s (64 hosts of 8), dp 64 x pp 8.

A host (node) that fails takes all 8 of its workers. `cluster.placement` decides which:
`pipeline` (a host is one whole pipeline: one worker of every stage) or `stage` (a host is one
stage of 8 pipelines). The sweep fails 1, 2, 4, 8 random hosts at once; the trace has host
failures only (no single-device failures): 24 hours, a host failing every 150 hours, repaired
after 12.

Run (docs/clusters.md's placement section quotes both):
  python -m launch.simulate --config=configs/sim/hosts.py --out=/tmp/hosts_pipeline
  python -m launch.simulate --config=configs/sim/hosts.py --out=/tmp/hosts_stage \
      --config.cluster.placement=stage

Variants: `runlocal`: 2 hosts of 4 devices (dp 2 x pp 4), a two-hour trace (tests use it).
"""

import ml_collections
from resilient_jax.configs.sim import gpt3_6_7b, gpt3_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  runlocal = arg == "runlocal"
  if arg and not runlocal:
    raise ValueError(f"unknown variant {arg!r} of configs/sim/hosts.py (use runlocal)")
  c = gpt3_config("runlocal" if runlocal else "512", file="configs/sim/hosts.py",
                  default_devices=512, **gpt3_6_7b.MODEL)
  c.trace.update(device_mtbf_hours=0.0, node_mtbf_hours=150.0, repair_hours=12.0)
  c.sweep.update(placement="hosts", failures="0,1,2,4,8")
  c.sim.policies = "recycle,oobleck,restart"
  if runlocal:
    c.cluster.devices_per_node = 4
    c.trace.update(hours=2.0, node_mtbf_hours=2.0, repair_hours=0.5)
    c.sweep.failures = "0,1"
  return c
