"""Universal checkpoints: save in the distributed layout, load onto any DP x PP layout.

`python -m launch.checkpoint inspect DIR` prints what a checkpoint holds;
`python -m launch.checkpoint verify DIR` checks its integrity.
"""

from resilient_jax.checkpoint.store import (
  CheckpointError,
  CheckpointWriter,
  Loaded,
  committed_steps,
  load,
  load_latest,
  meta_path,
  read_meta,
  step_dir,
)
from resilient_jax.checkpoint.universal import flatten_state, merge, unflatten_state

__all__ = [
  "CheckpointError",
  "CheckpointWriter",
  "Loaded",
  "committed_steps",
  "flatten_state",
  "load",
  "load_latest",
  "merge",
  "meta_path",
  "read_meta",
  "step_dir",
  "unflatten_state",
]
