"""Plans as compact plain data (JSON-able): what a decision's digest is taken over, and what a
process could read of another's plan.

In a multi-process job every process plans each failure and process 0 publishes only a digest
of its decision (`digest`, `policy/shared.py`), which the others check theirs against. The
encoding keeps a plan in the form the planner made it in, not as every worker's op list, so
encoding it (for the digest) stays cheap at 16k devices:

* a re-routed plan of a large grid (`expand.expand`): the failure's `Footprint` (the touched
  pipelines and their routes) and the sub-grid's op lists, which `expand` turns back into the
  full grid's lazily built lists on the reader: a few tens of kB for 16k devices, not the
  ~1.6M ops of the whole grid;
* a plan of a small grid (planned whole): every worker's list;
* a pipeline set: each distinct per-pipeline schedule once (Bamboo's healthy pipelines all run
  the same lists), referenced by index.

An op list is one string (`"F0 F1 B0 W0 AR OPT"`), a route only where it leaves its owner's
pipeline, and a list of node ids as runs of consecutive ids. Decoding builds each distinct op
once (`Op` validates its fields), so reading a plan costs about as much as parsing its text.
Everything here is pure data; `decode_plan(encode_plan(p))` equals `p` op for op and route for
route (tests/test_plan_share.py), which is what makes a digest of the encoding a digest of the
plan: the runtime itself no longer decodes (no process reads another's plan).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from resilient_jax.schedule import expand
from resilient_jax.schedule.core import Op, Schedule, Worker
from resilient_jax.schedule.pipelines import Pipeline, PipelineSet
from resilient_jax.schedule.plan import GridPlan, Plan

__all__ = ["decode_plan", "encode_plan", "from_bytes", "runs", "to_bytes", "unruns"]

Json = dict[str, Any]


def runs(ids: Sequence[int]) -> list[list[int]]:
  """`ids` as `[first, count]` runs of consecutive ids (node lists are mostly one run)."""
  out: list[list[int]] = []
  for i in ids:
    if out and out[-1][0] + out[-1][1] == i:
      out[-1][1] += 1
    else:
      out.append([i, 1])
  return out


def unruns(encoded: Sequence[Sequence[int]]) -> list[int]:
  """The inverse of `runs`."""
  return [i for first, count in encoded for i in range(first, first + count)]


class _Ops:
  """Decodes op strings, building each distinct op once."""

  def __init__(self):
    self._seen: dict[str, Op] = {}

  def __call__(self, text: str) -> tuple[Op, ...]:
    seen = self._seen
    out = []
    for token in text.split():
      op = seen.get(token)
      if op is None:
        kind = token.rstrip("0123456789")
        op = seen[token] = Op(kind, int(token[len(kind):])) if len(kind) < len(token) else Op(kind)
      out.append(op)
    return tuple(out)


def _ops_text(ops: Sequence[Op]) -> str:
  return " ".join(map(str, ops))


def _worker_key(w: Worker) -> str:
  return f"{w[0]},{w[1]}"


def _worker(key: str) -> Worker:
  d, s = key.split(",")
  return int(d), int(s)


def _encode_schedule(sched: Schedule) -> Json:
  """A schedule whose ops are a plain mapping (not expanded)."""
  m, pp = sched.microbatches, sched.pp
  away = {str(mb): list(r) for mb, r in enumerate(sched.route) if any(d != mb // m for d in r)}
  if len(sched.route) != sched.dp * m or any(len(r) != pp for r in sched.route):
    raise ValueError(f"schedule {sched.name}: its route does not cover {sched.dp}x{m} "
                     f"micro-batches of {pp} stages")
  return {"name": sched.name, "dp": sched.dp, "pp": pp, "m": m, "route": away,
          "ops": {_worker_key(w): _ops_text(ops) for w, ops in sched.ops.items()}}


def _decode_schedule(d: Json, ops: _Ops) -> Schedule:
  m, pp = d["m"], d["pp"]
  away = d["route"]
  route = tuple(tuple(away[str(mb)]) if str(mb) in away else (mb // m,) * pp
                for mb in range(d["dp"] * m))
  return Schedule(name=d["name"], dp=d["dp"], pp=pp, microbatches=m, route=route,
                  ops={_worker(k): ops(v) for k, v in d["ops"].items()})


def _encode_grid_schedule(sched: Schedule) -> Json:
  if sched.pieces:
    # The op strings would lose the pieces' rows: a digest of such an encoding would not pin
    # the plan down. The runtime does not run pieces yet (`Grid.samples` is 1 there).
    raise ValueError(f"schedule {sched.name} has pieces of micro-batches, which plans as data "
                     "do not encode yet")
  if not isinstance(sched.ops, expand.ExpandedOps):
    return {"whole": _encode_schedule(sched)}
  fp, sub = sched.ops.footprint, sched.ops.sub
  return {
    "expanded": {
      "name": sched.name, "base": sched.ops.base, "dp": fp.dp, "pp": fp.pp, "m": fp.m,
      "dead": sorted(map(list, fp.dead)), "pipelines": list(fp.pipelines), "spare": fp.spare,
      "failed": sorted(map(list, fp.failed)), "route": [list(r) for r in fp.route],
      "sub": None if sub is None else _encode_schedule(sub),
    }
  }


def _decode_grid_schedule(d: Json, ops: _Ops) -> Schedule:
  if "whole" in d:
    return _decode_schedule(d["whole"], ops)
  e = d["expanded"]
  fp = expand.Footprint(
    dp=e["dp"], pp=e["pp"], m=e["m"], dead=frozenset(tuple(w) for w in e["dead"]),
    pipelines=tuple(e["pipelines"]), spare=e["spare"],
    failed=frozenset(tuple(w) for w in e["failed"]), route=tuple(tuple(r) for r in e["route"]),
  )
  sub = None if e["sub"] is None else _decode_schedule(e["sub"], ops)
  sched = expand.expand(sub, fp, e["base"])
  if sched.name != e["name"]:
    raise ValueError(f"a plan named {e['name']} expanded as {sched.name}")
  return sched


def encode_plan(plan: Plan) -> Json:
  """`plan` as JSON-able data (see the module docstring)."""
  if isinstance(plan, GridPlan):
    sched = plan.schedule
    nodes = [plan.nodes[(d, s)] for d in range(sched.dp) for s in range(sched.pp)]
    return {"grid": {"schedule": _encode_grid_schedule(sched),
                     "partition": [list(r) for r in plan.partition], "nodes": runs(nodes)}}
  schedules: list[Json] = []
  index: dict[int, int] = {}  # id(schedule) -> its entry
  texts: dict[str, int] = {}  # an equal schedule met again through another object
  pipes = []
  for p in plan.pipelines:
    i = index.get(id(p.schedule))
    if i is None:
      enc = _encode_schedule(p.schedule)
      key = repr(sorted(enc.items()))
      i = texts.get(key)
      if i is None:
        i = texts[key] = len(schedules)
        schedules.append(enc)
      index[id(p.schedule)] = i
    pipes.append({"stages": [list(r) for r in p.stages], "nodes": list(p.nodes),
                  "microbatches": runs(p.microbatches), "schedule": i})
  return {"set": {"name": plan.name, "num_layers": plan.num_layers, "schedules": schedules,
                  "pipelines": pipes}}


def decode_plan(d: Mapping[str, Any]) -> Plan:
  """The plan `encode_plan` wrote.

  Raises:
    ValueError: `d` is not an encoded plan.
  """
  ops = _Ops()
  if "grid" in d:
    g = d["grid"]
    sched = _decode_grid_schedule(g["schedule"], ops)
    pp = sched.pp
    nodes = {divmod(i, pp): n for i, n in enumerate(unruns(g["nodes"]))}
    return GridPlan(sched, tuple(tuple(r) for r in g["partition"]), nodes)
  if "set" in d:
    s = d["set"]
    schedules = [_decode_schedule(x, ops) for x in s["schedules"]]
    pipes = tuple(
      Pipeline(tuple(tuple(r) for r in p["stages"]), tuple(p["nodes"]),
               tuple(unruns(p["microbatches"])), schedules[p["schedule"]])
      for p in s["pipelines"]
    )
    return PipelineSet(s["name"], pipes, s["num_layers"])
  raise ValueError(f"not an encoded plan: keys {sorted(d)}")


def to_bytes(data: Mapping[str, Any]) -> bytes:
  """JSON-able `data` as compressed bytes (what the key-value store holds)."""
  return zlib.compress(json.dumps(data, separators=(",", ":")).encode(), 6)


def from_bytes(raw: bytes) -> Any:
  """The inverse of `to_bytes`."""
  return json.loads(zlib.decompress(raw))


def digest(data: Mapping[str, Any]) -> str:
  """The SHA-256 of JSON-able `data` (keys sorted): equal on two processes exactly when the
  data are."""
  text = json.dumps(data, separators=(",", ":"), sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()
