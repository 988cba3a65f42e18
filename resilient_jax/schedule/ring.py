"""The data-parallel gradient ring, hop by hop: one schedule for the runtime that runs it and the
cost model that prices it.

The runtime (`runtime.multiprocess.ProcessTransport._ring`) cuts a stage's flat float32 gradient
buffer into `chunks` equal pieces (zero-padded), `chunks` being the job's process count: fixed
for the job, so a ring that loses or regains members compiles nothing. Ring position `j` of `n`
owns the pieces `j, j + n, ...` (`owned`). A reduce-scatter of `n - 1` hops sums every piece
once, in a fixed order (from the position after its owner on round the ring), then an
all-gather of `n - 1` hops copies the sums round (`hops`). Each hop a member sends one
position's pieces to the next member and pulls the previous member's; it starts a hop when its
own last hop and its predecessor's are done (the pieces it sends are those it just received).

The simulator (`sim.cost_model.ring_allreduce_seconds`) prices the same hops with the same
bytes (`seconds`); when the pieces divide evenly (`chunks` a multiple of `n`) that is the
textbook ring, 2 (n - 1) / n of the buffer each way per member and 2 (n - 1) latencies.

Growth per reduction and member: bytes sent = received <= 2 (n - 1) / n * buffer + one piece
per hop of padding (flat in n); 2 (n - 1) hops, so latency O(n); when `chunks` is not a
multiple of `n` (members lost), the positions owning one piece more set every hop's pace:
ceil(chunks / n) pieces a hop instead of chunks / n.
"""

from __future__ import annotations

import math

FLOAT32_BYTES = 4
"""The runtime's reduction buffer is float32 whatever the gradients' dtype."""


def owned(chunks: int, n: int) -> list[list[int]]:
  """The pieces each ring position owns (sums in the reduce-scatter): `c mod n == j`."""
  return [list(range(j, chunks, n)) for j in range(n)]


def hops(r: int, n: int) -> list[tuple[int, int, bool]]:
  """Member `r`'s hops: (the position whose pieces it sends, the position whose pieces it
  receives, whether the hop is the all-gather's), `2 (n - 1)` of them."""
  out = []
  for hop in range(2 * (n - 1)):
    gather = hop >= n - 1
    s = hop - (n - 1) if gather else hop
    send, recv = ((r + 1 - s) % n, (r - s) % n) if gather else ((r - s) % n, (r - s - 1) % n)
    out.append((send, recv, gather))
  return out


def piece_elements(elements: int, chunks: int) -> int:
  """Elements of one piece of a buffer of `elements` cut into `chunks` (the last ones padded)."""
  return -(-elements // chunks)


def bytes_sent(elements: int, chunks: int, n: int, itemsize: int = FLOAT32_BYTES) -> list[int]:
  """Bytes each ring position sends in one reduction (and receives: the same count)."""
  pieces = owned(chunks, n)
  size = piece_elements(elements, chunks) * itemsize
  return [sum(len(pieces[send]) for send, _, _ in hops(r, n)) * size for r in range(n)]


def seconds(elements: int, chunks: int, n: int, bandwidth: float, latency: float,
            itemsize: int = FLOAT32_BYTES) -> float:
  """The ring's time: every hop a transfer of the received pieces' bytes at `bandwidth` plus
  `latency`, a member's hop starting when its own and its predecessor's last hop are done.
  0 for one member or none."""
  if n <= 1:
    return 0.0
  pieces = owned(chunks, n)
  size = piece_elements(elements, chunks) * itemsize
  done = [0.0] * n
  schedule = [hops(r, n) for r in range(n)]
  for hop in range(2 * (n - 1)):
    done = [max(done[r], done[(r - 1) % n])
            + len(pieces[schedule[r][hop][1]]) * size / bandwidth + latency for r in range(n)]
  return max(done)


def even_seconds(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
  """The textbook ring over `n` members of `nbytes`: `2 (n - 1)` hops of `nbytes / n`; what
  `seconds` gives when the pieces divide evenly."""
  if n <= 1:
    return 0.0
  return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def elements_of(nbytes: float, itemsize: int = FLOAT32_BYTES) -> int:
  """Buffer elements of a gradient of `nbytes` (rounded up)."""
  return math.ceil(nbytes / itemsize)
