"""The data-parallel gradient reduction, hop by hop and byte by byte: one description for the
runtime that runs it and the cost model that prices it.

**The ring** (`runtime.multiprocess.ProcessTransport._ring`) runs over the `n` member processes
of a stage's group. It cuts a flat float32 buffer into `n` equal chunks (zero-padded): a
reduce-scatter of `n - 1` hops sums every chunk once, in a fixed order (chunk `j` from ring
position `j` on round the ring, each member adding its own part, to its owner `j - 1`), then an
all-gather of `n - 1` hops copies the sums round (`hops`). Each hop a member sends one chunk to
the next member and pulls the previous member's; it starts a hop when its own last hop and its
predecessor's are done (the chunk it sends is the one it just received). The chunks follow the
members: a ring that lost members cuts into its new count (a count fixed for the job would leave
a position owning two chunks after one loss, and that position would set the pace of every hop,
about twice the time). Per member: `2 (n - 1)` chunks sent and as many received, `2 (n - 1) / n`
of the buffer each way (`bytes_sent`), `2 (n - 1)` latencies (`seconds`).

**Two levels** (`Transport.scatter_sum` / `all_gather` around the ring): a process holding `m`
members of the group first sums among its own devices. With `k` pieces (`pieces_for`: the most
members any process holds, or a multiple of it where processes hold different numbers; every
process derives the same `k` from the member list), each member cuts its buffer into `k` pieces;
piece `c` is summed on the process's member `c mod m` (a reduce-scatter over the node's links),
each piece's owners run that piece's ring among the processes from their own devices (over the
network: a device owning `o` pieces carries `o` rings), and the members copy the summed pieces
they lack (an all-gather). `two_level` gives each phase's busiest device and the time; with one
member per process it is the ring alone. That is the spread reduction (devices with links of
their own); CPU devices sum on the first member (`spread=False`: one piece).

Growth per reduction: network bytes per process `2 (P - 1) / P` of the buffer, flat in P (the
member processes) and, spread, split over its devices; node-link bytes per device
`(k - o) + o (m - 1)` pieces a phase (`2 (k - 1) / k` buffers in and out per device for an even
split); `2 (P - 1)` network latencies. Computing the price is O(P) (`two_level`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

FLOAT32_BYTES = 4
"""The runtime's reduction buffer is float32 whatever the gradients' dtype."""


def hops(r: int, n: int) -> list[tuple[int, int, bool]]:
  """Member `r`'s hops: (the chunk it sends, the chunk it receives, whether the hop is the
  all-gather's), `2 (n - 1)` of them."""
  out = []
  for hop in range(2 * (n - 1)):
    gather = hop >= n - 1
    s = hop - (n - 1) if gather else hop
    send, recv = ((r + 1 - s) % n, (r - s) % n) if gather else ((r - s) % n, (r - s - 1) % n)
    out.append((send, recv, gather))
  return out


def piece_elements(elements: int, k: int) -> int:
  """Elements of one piece of a buffer of `elements` cut into `k` (the last ones padded)."""
  return -(-elements // k)


def bytes_sent(elements: int, n: int, itemsize: int = FLOAT32_BYTES) -> int:
  """Bytes each of the `n` ring members sends in one reduction of a buffer of `elements`
  (and receives: the same count): `2 (n - 1)` chunks."""
  return 2 * (n - 1) * piece_elements(elements, n) * itemsize if n > 1 else 0


def seconds(elements: int, n: int, bandwidth: float, latency: float,
            itemsize: int = FLOAT32_BYTES) -> float:
  """The ring's time: `2 (n - 1)` hops of one chunk at `bandwidth` plus `latency` (every member
  sends and receives alike, so no member waits on a slower one). 0 for one member or none."""
  if n <= 1:
    return 0.0
  return 2 * (n - 1) * (piece_elements(elements, n) * itemsize / bandwidth + latency)


def elements_of(nbytes: float, itemsize: int = FLOAT32_BYTES) -> int:
  """Buffer elements of a gradient of `nbytes` (rounded up)."""
  return math.ceil(nbytes / itemsize)


@dataclasses.dataclass(frozen=True)
class TwoLevel:
  """One reduction over processes holding `per_process` members each (`two_level`; see the
  module docstring).

  Attributes:
    pieces: `k`, the pieces each member cuts its buffer into.
    piece_bytes: bytes of one piece (float32, padded).
    device_pieces: the most pieces one device sends (and as many it receives) to and from the
      other devices of its process, both local phases together: `(k - o) + o (m - 1)` for a
      device owning `o` of the `k` pieces among `m` members.
    phase_pieces: the most pieces one device sends or receives in one local phase (its pace).
    processes: `P`, the processes holding members (the ring's members).
    rings: the most pieces one device runs rings of (its network link carries them all).
  """

  pieces: int
  piece_bytes: int
  device_pieces: int
  phase_pieces: int
  processes: int
  rings: int

  @property
  def chunk_bytes(self) -> int:
    """Bytes of one ring chunk: a piece cut into `P`."""
    return piece_elements(self.piece_bytes // FLOAT32_BYTES, self.processes) * FLOAT32_BYTES

  @property
  def device_bytes(self) -> int:
    """The most bytes one device sends (and receives) to and from the other devices of its
    process (`Transport.device_bytes`)."""
    return self.device_pieces * self.piece_bytes

  @property
  def network_bytes(self) -> int:
    """The most bytes one device sends (and receives) over the network: its pieces' rings."""
    return self.rings * bytes_sent(self.piece_bytes // FLOAT32_BYTES, self.processes)

  @property
  def process_network_bytes(self) -> int:
    """Bytes each process sends (and receives) over the network: every piece's ring."""
    return self.pieces * bytes_sent(self.piece_bytes // FLOAT32_BYTES, self.processes)

  def seconds(self, local: tuple[float, float], network: tuple[float, float]) -> float:
    """The reduction's time over node links `local` and network links `network`, each
    (bytes per second of one device's link, latency): a local phase is its busiest device's
    pieces plus one latency (its copies go in one call); the rings' hops go at the pace of the
    device carrying the most rings (each hop waits for every piece's)."""
    phase = self.phase_pieces * self.piece_bytes / local[0] + local[1] \
      if self.phase_pieces else 0.0
    ring = 2 * (self.processes - 1) * (self.rings * self.chunk_bytes / network[0] + network[1]) \
      if self.processes > 1 else 0.0
    return 2 * phase + ring


MAX_PIECES = 64
"""The most pieces a reduction cuts a buffer into (the transfer ids' field for the piece)."""
BALANCE = 1.25
"""How far above its even share (`k / m` pieces) `pieces_for` lets a device's pieces go."""


def pieces_for(per_process: Sequence[int]) -> int:
  """The pieces `k` of a spread reduction over processes holding `per_process` members each:
  the most any holds, `M`, when that splits evenly everywhere; where a process holds fewer
  (a device lost), its members own `ceil(k / m)` pieces and the busiest sets the pace of every
  ring and local phase, so `k` is the smallest multiple of `M` that keeps every device within
  `BALANCE` of its even share (after a loss at 8 a host: 24 pieces, 4 on the busiest of 7
  devices instead of 2 of 8, 1.17x its share instead of 1.75x), at most `MAX_PIECES`."""
  most = max(per_process)
  sizes = set(per_process)
  best, best_k = math.inf, most
  for k in range(most, max(most, MAX_PIECES) + 1, most):
    worst = max(-(-k // m) * m / k for m in sizes)
    if worst < best - 1e-12:
      best, best_k = worst, k
    if worst <= BALANCE:
      break
  return best_k


def two_level(elements: int, per_process: Sequence[int], spread: bool = True) -> TwoLevel:
  """The reduction of a float32 buffer of `elements` over processes holding `per_process`
  members each (every entry >= 1): spread, in `pieces_for` pieces; else one piece, summed on
  each process's first member."""
  k = pieces_for(per_process) if spread else 1
  moved = phase = rings = 0
  for m in sorted(set(per_process)):
    for d in range(min(m, k)):
      owned = len(range(d, k, m))  # piece c is summed on member c mod m
      rings = max(rings, owned)
      if m > 1:  # sends its k - owned pieces to their owners, receives owned (m - 1); mirrored
        moved = max(moved, k - owned + owned * (m - 1))
        phase = max(phase, k - owned, owned * (m - 1))
  return TwoLevel(pieces=k, piece_bytes=piece_elements(elements, k) * FLOAT32_BYTES,
                  device_pieces=moved, phase_pieces=phase, processes=len(per_process),
                  rings=rings)
