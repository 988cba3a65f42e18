"""The processes a run spans: one (`Solo`) or the processes of a `jax.distributed` job (`Job`).

The loop, the checkpoints and the failure handling never ask which: whatever differs between
one process and a job is a method here. A job's processes agree through the coordination
service's key-value store (process 0 decides, `agree`), leave together (`leave_together`),
admit relaunched processes between steps (`training/relaunch.py`), and are paused at
exact points by `launch/local.py`'s kills (`pause`); a single process does each trivially.

Key-value traffic per step of a job: a constant number of small keys per process (the step's
outcome, a save decision on checkpoint steps), deleted `distributed.kv_keep_steps` steps later
(`forget`), so the store does not grow with the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from resilient_jax.config import ConfigError, RunConfig
from resilient_jax.model.sharding import worker_mesh
from resilient_jax.runtime.transport import Transport
from resilient_jax.schedule.core import AR, Op
from resilient_jax.training.faults import pause_hook_from_env

if TYPE_CHECKING:
  from resilient_jax.observe.records import StepResult
  from resilient_jax.policy import RunCoordinator
  from resilient_jax.runtime.interpreter import Interpreter

AfterOp = Callable[[int, Op], None]
_PER_STEP = ("step", "checkpoint", "save", "lease")
"""The key-value directories that hold a step's agreements (`lease/STEP/ATTEMPT` among them)."""


class Solo:
  """A run whose every worker is in this process."""

  chief = True
  relaunched = False
  process_id: int | None = None
  processes: int | None = None
  """How many processes the job spans (None: not a job)."""
  profiles = True
  """A profiled step times every worker's ops here (each op waited for), so the timelines are
  drawn and replayed from them; a job's process times only its own workers' (on the steps that
  measure stragglers alone, `training/stragglers.py`)."""
  knows_fault_times = True
  """Failures are injected here, so each is detected at once (0 s)."""

  def transport(self, cfg: RunConfig, devices: Sequence[jax.Device] | None) -> Transport:
    """Worker n on device n, or on the n-th run of `mesh.tp` devices (its sub-mesh)."""
    need, tp = cfg.mesh.num_workers, cfg.mesh.tp
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < need * tp:
      what = f"mesh.dp * mesh.pp = {need} workers need {need} devices" if tp == 1 else \
        f"mesh.dp * mesh.pp * mesh.tp = {need * tp} devices needed ({need} workers of {tp})"
      raise ConfigError(
        f"{what}, found {len(devs)} (on CPU, call "
        f"resilient_jax.configure_jax({need * tp}) before any JAX operation, e.g. before "
        "building the model)"
      )
    return Transport({n: devs[n] if tp == 1 else worker_mesh(devs[n * tp:(n + 1) * tp])
                      for n in range(need)})

  def attach(self, coordinator: RunCoordinator) -> None:
    from resilient_jax.observe.profiling import simulated_cpu_devices

    # Failures are then reported in replayed step times (`policy/phases.py`).
    coordinator.simulated_devices = simulated_cpu_devices()

  def warm_up(self, cfg: RunConfig, transport: Transport, interpreter: Interpreter) -> None:
    """Nothing to connect: programs are built when a step first needs them."""

  def plan_key(self, step: int, attempts: int, events: int) -> str | None:
    """Where process 0 publishes a decision: nowhere, one process decides alone."""
    return None

  def process_of(self, node: int) -> int | None:
    return None

  def op_hook(self, step: int, injected: AfterOp | None) -> AfterOp | None:
    """What runs after each op: the failures injected into this step."""
    return injected

  def pause(self, step: int, where: str) -> None:
    """`launch.local`'s kill points: none in one process."""

  def agree(self, key: str, decide: Callable[[], Any], what: str | None = None) -> Any:
    """Process 0's decision under `key`: here, `decide()`."""
    return decide()

  def gather(self, key: str, value: Any, processes: Sequence[int]) -> dict[int, Any] | None:
    """Every one of `processes`' `value` under `key`, on process 0 (None elsewhere): here,
    this process's."""
    del key, processes
    return {0: value}

  def gather_state(self, step: int, interpreter: Interpreter) -> Any:
    """Every stage's state, for process 0's checkpoint of `step`."""
    return interpreter.export_state()

  def leave_together(self, key: str, live: Sequence[int]) -> None:
    """The barrier every process of a job passes before it leaves: nobody to wait for."""

  def forget(self, step: int) -> None:
    """Drops the agreements of `step` from the key-value store: none kept."""

  def row(self, result: StepResult) -> dict[str, Any]:
    """What a metrics row adds in this kind of run."""
    return {}

  def kept_keys(self) -> list[int] | None:
    """Steps whose agreements the key-value store still holds (None: no store)."""
    return None


class Job(Solo):
  """This process's share of a `jax.distributed` job (`runtime.cluster.Cluster`)."""

  profiles = False  # each process times only its own workers: nothing to draw or replay
  knows_fault_times = False

  def __init__(self, cluster: Any):
    self.cluster = cluster
    self.chief = cluster.process_id == 0
    self.relaunched = cluster.relaunched
    self.process_id = cluster.process_id
    self.processes = cluster.num_processes
    self._transport: Any = None

  def transport(self, cfg: RunConfig, devices: Sequence[jax.Device] | None) -> Transport:
    from resilient_jax.runtime.multiprocess import ProcessLayout, ProcessTransport

    try:
      layout = ProcessLayout.of(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.placement,
                                self.cluster.num_processes, len(jax.local_devices()),
                                devices_per_worker=cfg.mesh.tp)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    self._transport = ProcessTransport(self.cluster, layout, pause_hook_from_env())
    self.layout = layout
    return self._transport

  def attach(self, coordinator: RunCoordinator) -> None:
    from resilient_jax.runtime.plan_exchange import KVPlanExchange

    # Process 0 plans each failure and rejoin, the others read its plan.
    coordinator.exchange = KVPlanExchange(self.cluster)

  def warm_up(self, cfg: RunConfig, transport: Transport, interpreter: Interpreter) -> None:
    # Any worker of a neighbouring stage may become this one's producer or consumer; the first
    # transfer over a new connection and the split backward's compile would otherwise land
    # inside a recovery.
    pp = cfg.mesh.pp
    mine = {n % pp for n in transport.devices}
    if not self.relaunched:  # a joiner's neighbours are inside a step: `admit` connects
      self.cluster.connect(self.layout.processes_of(
        [n for n in range(cfg.mesh.num_workers) if any(abs(n % pp - s) == 1 for s in mine)]))
    interpreter.warm_up(everything=self.relaunched)

  def plan_key(self, step: int, attempts: int, events: int) -> str | None:
    """Named by the step, the attempt counter and the membership events so far, which every
    process of the job agrees on (`runtime/plan_exchange.py`)."""
    from resilient_jax.runtime.plan_exchange import plan_key

    return plan_key(step, attempts, events)

  def process_of(self, node: int) -> int | None:
    return self.layout.process_of(node)

  def op_hook(self, step: int, injected: AfterOp | None) -> AfterOp | None:
    """`launch.local`'s kill points inside the step (ops and the all-reduce's own `AR`)."""
    pause = self._transport.pause
    if pause is None:
      return None
    return lambda node, op: pause(step, str(op)) if op.kind != AR else None

  def pause(self, step: int, where: str) -> None:
    if self._transport.pause is not None:
      self._transport.pause(step, where)

  def agree(self, key: str, decide: Callable[[], Any], what: str | None = None) -> Any:
    """Process 0 decides and publishes under `key`; the others read it (`what`: wait as for a
    peer's key, None if process 0 died; else block until it is there)."""
    if self.chief:
      value = decide()
      self.cluster.kv_set(key, value)
      return value
    if what is not None:
      return self.cluster.await_key(key, 0, what)
    return self.cluster.kv_get(key)

  def gather(self, key: str, value: Any, processes: Sequence[int]) -> dict[int, Any] | None:
    """Each process writes `value` under `key/PID`; process 0 waits (bounded) for every one of
    `processes` and returns what they wrote (a process proven dead first is left out). Keys
    belong under the step's directory (`step/STEP/...`), which `forget` deletes."""
    cl = self.cluster
    cl.kv_set(f"{key}/{cl.process_id}", value)
    if not self.chief:
      return None
    got = cl.await_keys(key, processes, f"every process's {key}")
    return {p: v for p, v in got.items() if v is not None}

  def gather_state(self, step: int, interpreter: Interpreter) -> Any:
    """Each stage's state goes to process 0 from its lowest holder; process 0 writes the
    checkpoint, so the holders wait for its mark (its loss ends them: exit 5)."""
    self.pause(step, "save")  # where `launch.local --kill=STEP:P:save` kills
    sp = interpreter.step_program
    keys = sorted({(p.split, p.stage) for p in sp.slots.values()})
    holders = {i: min(p.node for p in sp.slots.values() if (p.split, p.stage) == k)
               for i, k in enumerate(keys)}
    state = self._transport.share_state(step, holders, interpreter.export_state)
    if self.chief:
      self.cluster.kv_delete(f"state/{step}")  # the holders' specs, read
      # The holders may go on (and exit after the last step) once their state is here.
      self.cluster.kv_set(f"checkpoint/{step}", True)
    elif self._transport.holds_any(list(holders.values())):
      self.cluster.kv_get(f"checkpoint/{step}")
    return state

  def leave_together(self, key: str, live: Sequence[int]) -> None:
    """Called by every surviving process before it leaves, a barrier in three steps: every
    other live process writes `{key}/{pid}`; process 0, which hosts the key-value store, waits
    for them all (or their death) and writes `{key}/all`; each writes `{key}/left/{pid}` once it
    read that, and process 0 waits for those before it goes. So no process loses the store
    while still reading a decision (it would exit 5 instead of reaching the same end), and none
    leaves while a peer may still be pulling what it offered in the last step (Bamboo's replica
    of its stage), which its exit would cut off."""
    from resilient_jax.runtime.admission import ENDED_KEY

    cl, me = self.cluster, self.process_id
    if not self.chief:
      cl.kv_set(f"{key}/{me}", True)
      cl.await_key(f"{key}/all", 0, f"every process to reach {key}")
      cl.kv_set(f"{key}/left/{me}", True)
      return
    cl.kv_set(ENDED_KEY, key)  # a relaunched process still waiting to be admitted leaves too
    others = sorted(set(self.layout.processes_of(sorted(live))) - {me})
    cl.await_keys(key, others, f"every process to reach {key}")
    cl.kv_set(f"{key}/all", True)
    cl.await_keys(f"{key}/left", others, f"every process to leave at {key}")

  def forget(self, step: int) -> None:
    # Every participant is past the earlier steps (they all reported on this one), and a
    # process the plan left idle only follows decisions, so it is at most a step or two
    # behind: old agreements are read by nobody again. Without this the store grows by about
    # a dozen keys a step.
    for what in _PER_STEP:  # outcomes, a hand-over's mark, save or not, the lease's verdict
      self.cluster.kv_delete(f"{what}/{step}")

  def row(self, result: StepResult) -> dict[str, Any]:
    sent, received = result.net_bytes
    return {"attempts": result.attempts, "time": round(time.time(), 3),
            "net_bytes_out": sent, "net_bytes_in": received}

  def kept_keys(self) -> list[int] | None:
    return sorted({int(k.strip("/").split("/")[1])
                   for d in _PER_STEP for k in self.cluster.kv_keys(d)})


Group = Solo
"""Either kind (`Job` is a `Solo` whose methods reach the other processes)."""
