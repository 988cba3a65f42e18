"""Silent data corruption: a replica whose state differs from its stage's others is dropped.

After every committed step each data-parallel replica of a stage holds bitwise the same
parameters: every reduction sums in one fixed order and every replica applies the same update
to the same state (`runtime/transport.py`). A replica whose memory or arithmetic went wrong
(a flipped bit, a bad multiply) is then different from its peers, and stays different. Every
`resilience.check_replicas_every` steps each process takes a digest of each of its slots'
parameters on their own device (`state_digest`: one small program, a read of the parameters),
process 0 gathers them (`Group.gather`: a few dozen bytes per slot through the key-value store),
and for each stage the replicas whose digest differs from the majority's are named and dropped
at the start of the next step, exactly like failed workers: the policy re-routes their
micro-batches and the hand-over takes no state from them. When a stage's replicas disagree with
no majority (two replicas, one of each), nothing tells which is right: all of them are dropped
and, the stage having lost every worker, the run restores its latest checkpoint
(`resilience.restore_on_stage_loss`).

What it catches: corruption of a replica's parameters between steps, or of its optimizer step.
What it cannot: a wrong gradient that enters the sum (every replica then applies the same wrong
update; `train.max_nonfinite_steps` covers the non-finite case), or a stage with one replica.

Cost per check: one read of every parameter on its own device and a scalar per slot to the
host; in a job, one key-value write per process and, on process 0, one directory read a poll
(`Cluster.await_keys`: O(processes) bytes, not O(processes) calls), then one agreed verdict.
Nothing grows with the model on the network.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from resilient_jax.config import RunConfig
from resilient_jax.observe.events import Corrupt
from resilient_jax.programs.compiled import OnEachDevice
from resilient_jax.programs.packing import Packed
from resilient_jax.schedule.plan import Slot
from resilient_jax.training.failures import Failures
from resilient_jax.training.hooks import StepInfo
from resilient_jax.training.run import Run

_MIX = 0x9E3779B1  # odd: multiplying by it (mod 2**32) loses no bit


@functools.cache
def _digest_program() -> Callable:
  def digest(arrays: Sequence[jax.Array]) -> jax.Array:
    total = jnp.uint32(0)
    for i, a in enumerate(arrays):
      raw = jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1).astype(jnp.uint32)
      weights = jnp.arange(raw.shape[0], dtype=jnp.uint32) * jnp.uint32(_MIX) + jnp.uint32(1)
      total = total + jnp.sum(raw * weights, dtype=jnp.uint32) * jnp.uint32(2 * i + 1)
    return total

  return OnEachDevice(digest)


def state_digest(params: Mapping[str, jax.Array]) -> jax.Array:
  """A 32-bit digest of `params` (a uint32 scalar on their device; packed, of its buffers,
  which replicas of a stage lay out alike): a weighted sum of every
  byte, in wrapping integer arithmetic, so it is the same whatever order a device sums in, and
  any one flipped bit changes it (its weight is odd)."""
  arrays = list(params.buffers) if isinstance(params, Packed) else \
    [params[n] for n in sorted(params)]  # a stage's buffers as they are, or its arrays by name
  return _digest_program()(arrays)


def odd_replicas(digests: Mapping[Slot, int], groups: Sequence[Sequence[Slot]]
                 ) -> list[tuple[Slot, int | None]]:
  """The slots whose digest differs from their group's majority, each with that majority (None:
  the group's replicas disagree with no majority, and every one of them is named)."""
  out = []
  for members in groups:
    seen = [m for m in members if m in digests]
    counts = collections.Counter(digests[m] for m in seen)
    if len(counts) <= 1:
      continue
    value, n = counts.most_common(1)[0]
    majority = value if 2 * n > len(seen) else None
    out += [(m, majority) for m in seen if digests[m] != majority]
  return sorted(out)


class ReplicaCheck:
  """The hook (every `resilience.check_replicas_every` steps; see the module docstring).

  Args:
    drop: called with the step and the nodes to drop at its start.
    corrupt: `{step: [(dp, stage), ...]}` workers whose parameters get a flipped bit after
      that step commits (`faults.corrupt`, for rehearsals), in the process that holds them.
  """

  def __init__(self, run: Run, every: int, drop: Callable[[int, set[int]], None],
               corrupt: Mapping[int, Sequence[tuple[int, int]]]):
    self.run = run
    self.every = every
    self.drop = drop
    self.corrupt = corrupt

  def __call__(self, info: StepInfo) -> dict | None:
    run, step = self.run, info.step
    ip = run.interpreter
    for worker in self.corrupt.get(step, ()):
      _flip_a_bit(ip, worker)
    if not self.every or step % self.every:
      return None
    sp = ip.step_program
    local = list(ip.local_slots)
    values = jax.device_get([state_digest(ip.params[s]) for s in local])
    mine = {f"{d}.{s}": int(v) for (d, s), v in zip(local, values, strict=True)}
    processes = sorted({p for p in (run.group.process_of(prog.node)
                                    for prog in sp.slots.values()) if p is not None}) or [0]
    # Under the attempt too: a step run again after a restore must not read the first run's.
    key = f"step/{step}/replicas/{run.attempts}"
    gathered = run.group.gather(key, mine, processes)

    def verdict() -> list:
      digests = {tuple(map(int, k.split("."))): v for got in gathered.values()
                 for k, v in got.items()}
      groups = [members for stages in sp.holders.values() for members in stages.values()]
      return [[list(slot), majority] for slot, majority in odd_replicas(digests, groups)]

    odd = run.group.agree(f"{key}/verdict", verdict)
    if not odd:
      return {"replicas_checked": True}
    nodes = set()
    for (d, s), majority in odd:
      node = sp.slots[(d, s)].node
      nodes.add(node)
      against = ("its stage's other replicas disagree with no majority: which is right is "
                 "unknown, so every one is dropped") if majority is None else (
                 f"its stage's majority holds digest {majority:08x}")
      run.events.emit(Corrupt(step, node, (d, s), majority), line=False)
      run.log(f"CORRUPTION: replica ({d}, {s}) on node {node} holds parameters that differ from "
              f"its stage's other replicas after step {step} ({against}); it is dropped at the "
              f"start of step {step + 1}, like a failed worker")
    self.drop(step + 1, nodes)
    return {"replicas_checked": True, "corrupt_nodes": sorted(nodes)}


def replica_check(cfg: RunConfig, failures: Failures) -> ReplicaCheck | None:
  """The run's check (None when neither `resilience.check_replicas_every` nor
  `faults.corrupt` asks for one)."""
  corrupt: dict[int, list[tuple[int, int]]] = {}
  for f in cfg.faults.corrupt:
    corrupt.setdefault(f.step, []).append((f.dp, f.stage))
  every = cfg.resilience.check_replicas_every
  return ReplicaCheck(failures.run, every, failures.drop, corrupt) if every or corrupt else None


def _flip_a_bit(ip, worker: tuple[int, int]) -> None:
  """Flips the lowest bit of the first element of `worker`'s first parameter, if this process
  holds it (`faults.corrupt`)."""
  slot = next((s for s in ip.local_slots if s == worker), None)
  if slot is None:
    return
  params = ip.params[slot]
  name = sorted(params)[0]
  value = params[name]
  host = np.array(value)
  bits = host.reshape(-1).view(np.uint8)
  bits[0] ^= 1
  if isinstance(params, Packed):  # its buffers are immutable: a new state with the bit flipped
    ip.params[slot] = jax.device_put(params.replace({name: host}), value.sharding)
  else:
    params[name] = jax.device_put(host, value.sharding)
