"""Admission: a relaunched process comes back into a running multi-process job.

A process started with the id of one the job lost (`Cluster.relaunched`) cannot just start
training: the others are somewhere inside a step, on a plan without it, holding state it lacks.
So it *announces* itself and waits, and the live processes admit it between two steps:

1. The joiner writes `join/{pid}` = {token, address, time}: a fresh token per launch (so that an
   announcement is admitted once), and its transfer server's address (its `transfer/{pid}` key
   still names its predecessor's until it is admitted; see `runtime/cluster.py`).
2. Every live process, before each step S (`decide`), reads `join/` and proposes, first writer
   wins, under `step/{S}/admit`: the processes it finds announced that are not live and whose
   token no earlier admission used; with them the attempt counter and the *membership history*
   (every failure and admission so far, in order). Every process follows the stored decision,
   so all admit the same processes before the same step, and a step in flight is never touched
   (the decision is read only between steps). Each then writes `admitted/{pid}/{token}` = S.
3. The joiner, woken by that key, reads the decision: the step S it starts at (the data of a
   step is a pure function of the step, so that is the loader's position too), the attempt
   counter (which names transfers and agreements), and the history, which it replays on its own
   coordinator (`replay`): every process derives plans from the same agreed history the same
   way, so it ends up on the survivors' plan, policy state included, without anything else
   being sent. Then every process, the joiner included, applies the admission to that plan the
   same way (`RunCoordinator.rejoin` of every worker the joiners hold, then `Interpreter.place`
   with those workers as the nodes whose old state does not count), which moves each state key
   the joiner's new slots need from the lowest live node that holds it, over the transfer
   server: the same hand-over a failure uses. Nothing comes from the checkpoint.

Every wait is `Cluster.poll`'s (bounded by `distributed.wait_timeout_s`); a joiner still waiting
when the job ends (process 0 writes `ended`) leaves with exit code 0.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from resilient_jax.runtime.cluster import Cluster

ENDED_KEY = "ended"
"""Set by process 0 when the job is over: a joiner waiting for admission then leaves."""

Event = dict[str, Any]
"""One entry of the membership history: {"kind": "fail", "nodes", "step", "mid_step"},
{"kind": "rejoin", "nodes", "step", "tokens", "generations"} or, for stragglers' speeds put in
force (`training/stragglers.py`), {"kind": "speeds", "speeds": [[dp, stage, speed], ...],
"step"}."""


@dataclasses.dataclass(frozen=True)
class Admission:
  """An agreed admission before `step`.

  Attributes:
    step: the first step the joiners train.
    joiners: process -> {"token", "address", "time", "generation"}.
    attempts: the attempt counter of the live processes when they decided.
    history: the membership events before this admission, in order.
  """

  step: int
  joiners: dict[int, dict[str, Any]]
  attempts: int
  history: list[Event]

  def event(self) -> Event:
    """This admission as a membership event (what `replay` applies)."""
    return {"kind": "rejoin", "nodes": sorted(self.joiners), "step": self.step,
            "tokens": [self.joiners[p]["token"] for p in sorted(self.joiners)],
            "generations": {str(p): self.joiners[p]["generation"] for p in sorted(self.joiners)}}


def generations(history: Sequence[Event]) -> dict[int, int]:
  """Each process's generation after `history`: how many times it was admitted back."""
  out: dict[int, int] = {}
  for e in history:
    if e["kind"] == "rejoin":
      out.update({int(p): g for p, g in e["generations"].items()})
  return out


def announce(cluster: Cluster) -> str:
  """Writes this relaunched process's `join/{pid}`; returns its token."""
  token = uuid.uuid4().hex
  cluster.kv_set(f"join/{cluster.process_id}",
                 {"token": token, "address": cluster.address, "time": time.time()})
  return token


def await_admission(cluster: Cluster, token: str) -> Admission | None:
  """Waits (bounded) until the live processes admit the announcement `token`; None if the job
  ended first."""
  key = f"admitted/{cluster.process_id}/{token}"

  def check() -> tuple[int | None] | None:
    step = cluster.kv_try_get(key)
    if step is not None:
      return (step,)
    if cluster.kv_try_get(ENDED_KEY) is not None:
      return (None,)
    return None

  step = cluster.poll("the live processes to admit this one", check, wake_key=key)[0]
  if step is None:
    return None
  admission = _read(cluster.kv_get(_decision_key(step)), step)
  if admission is None or cluster.process_id not in admission.joiners:
    raise RuntimeError(f"process {cluster.process_id} was told it is admitted at step {step}, "
                       "but that step's decision does not admit it")
  cluster.kv_delete(f"join/{cluster.process_id}")  # admitted: the announcement is spent
  return admission


def decide(
  cluster: Cluster, step: int, live: Collection[int], nodes: Collection[int], attempts: int,
  history: Sequence[Event],
) -> Admission | None:
  """The agreed admission before `step` (None: nobody is admitted there). Every live process
  calls this at every step boundary, in the same order of steps.

  Args:
    cluster: the joined job.
    step: the step about to start.
    live: the live processes (those holding live workers), the same in every live process.
    nodes: every process of the job (one outside them is never admitted).
    attempts: the attempt counter.
    history: the membership events so far.
  """
  spent = {t for e in history if e["kind"] == "rejoin" for t in e["tokens"]}
  before = generations(history)
  joiners = {}
  for key, request in sorted(cluster.kv_dir("join").items()):
    p = int(key)
    if p in live or p not in nodes or request["token"] in spent:
      continue
    joiners[str(p)] = {**request, "generation": before.get(p, 0) + 1}
  proposal = {"joiners": joiners, "attempts": attempts, "history": list(history)} if joiners \
    else {}
  admission = _read(cluster.decide(_decision_key(step), proposal), step)
  if admission is not None:
    for p, joiner in sorted(admission.joiners.items()):
      cluster.kv_set(f"admitted/{p}/{joiner['token']}", step)
  return admission


def replay(coordinator: Any, history: Sequence[Event]) -> None:
  """Applies `history` to a fresh `RunCoordinator`, as the live processes applied it."""
  for e in history:
    if e["kind"] == "fail":
      coordinator.fail(set(e["nodes"]), e["step"], mid_step=e["mid_step"])
    elif e["kind"] == "speeds":
      coordinator.reweigh({(d, s): v for d, s, v in e["speeds"]}, e["step"])
    else:
      coordinator.rejoin(e["nodes"], e["step"])


def describe_moves(moves: Sequence[tuple[int, int, int]], joiners: Mapping[int, Any]) -> str:
  """'process 1 <- process 3 (1.23 MiB)' for each joiner's state transfer."""
  parts = []
  for p in sorted(joiners):
    got = [(src, n) for src, dst, n in moves if dst == p]
    if not got:
      parts.append(f"process {p} needed no state from another process")
      continue
    srcs = ", ".join(f"process {src} ({_size(n)})" for src, n in got)
    parts.append(f"process {p} received its parameters and optimizer state from {srcs} over "
                 "the transfer server")
  return "; ".join(parts)


def _size(n: int) -> str:
  return f"{n / 2**20:.2f} MiB" if n >= 2**14 else f"{n} bytes"


def _decision_key(step: int) -> str:
  # Under the step's directory, which process 0 deletes with the step's other agreements.
  return f"step/{step}/admit"


def _read(value: Mapping[str, Any], step: int) -> Admission | None:
  if not value:
    return None
  return Admission(step, {int(p): j for p, j in value["joiners"].items()}, value["attempts"],
                   list(value["history"]))
