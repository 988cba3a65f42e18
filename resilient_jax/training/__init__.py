"""The training loop (`loop`) and what it hands work to: checkpoints (`checkpoints`), failures
(`failures`, `faults`), rejoins (`rejoin`, `relaunch`).

Named `training`, not `train`: `resilient_jax.train` is the public function that runs one."""
