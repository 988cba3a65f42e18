"""Reading a checkpoint's arrays with their checksums folded into the read, in parallel.

Why not orbax's restore: from a warm page cache, on a 1.3 GiB checkpoint, it took 16-80x the
time to read the same files raw (asyncio and tree machinery, a fresh buffer per chunk that
tensorstore then copies into a second fresh array, then separate CRC and finiteness passes),
all CPU-bound while a raw read is one copy out of the page cache.

The writer pins orbax's layout (`store._state_handler`: one OCDBT database, zarr v2,
uncompressed), in which each array is one chunk: its C-order bytes stored contiguously in a
data file. `tensorstore.ocdbt.dump` lists where each chunk lies, so a worker reads an array
straight into its numpy buffer in cache-sized slices and checksums and tests each slice while it
is still in cache: one pass over the bytes. Workers take the arrays in file order, so from a
cold cache the kernel's readahead streams the files as for a plain read of them.

Anything this fast path does not recognise (another layout, a chunked array, a tree it cannot
walk) and any entry it finds bad is read again through tensorstore's own zarr driver; that
verdict is final. So the fast path can make a load faster, never a good checkpoint "corrupt".

The checksum is CRC32 (zlib's polynomial, the values saves record); computed by zlib-ng where
it is installed (carry-less multiplication: 36 GB/s on this machine's cores against 2.5-7 GB/s
for the standard library's zlib 1.2.13, which made the checksum alone 4-5x a warm raw read),
else by zlib. Growth: one pass over the bytes, CPU O(bytes) (a copy out of the page cache, the
CRC32 and the finiteness test per 1 MiB slice), spread over `default_workers()` threads.

Arrays come back read-only at 64-byte-aligned addresses, so that placing them on CPU devices
shares their memory rather than copying it once per device that holds them (`aligned_empty`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

try:  # zlib-ng's CRC32 (carry-less multiplication): the same checksum, 14x zlib 1.2.13's here
  from zlib_ng.zlib_ng import crc32
except ImportError:  # not installed: the standard library's
  from zlib import crc32

# Bytes read, checksummed and tested for finiteness at a time: small enough to stay in the
# core's cache between the three, so each byte comes from memory once.
SLICE_BYTES = 1 << 20
ALIGN = 64
"""Alignment of the arrays a load returns: what XLA's CPU client needs to alias a host array."""
NON_FINITE = "holds non-finite values"
GROUPS = ("params", "opt_state")


class StateUnreadable(ValueError):
  """The state folder's own metadata is missing or not the layout the writer pins."""


def default_workers() -> int:
  # Twice the cores: some workers wait on the disk while the others checksum; more only adds
  # memory in flight.
  return max(2, min(8, 2 * (os.cpu_count() or 1)))


@functools.cache
def is_floating(dtype: np.dtype) -> bool:
  """Whether `dtype` can hold an inf or NaN, ml_dtypes' (bfloat16, float8) included: numpy does
  not count those as floating."""
  if np.issubdtype(dtype, np.floating):
    return True
  try:
    import ml_dtypes

    ml_dtypes.finfo(dtype)
    return True
  except (ImportError, TypeError, ValueError):
    return False


_PER_THREAD = threading.local()


def _mask() -> np.ndarray:
  """This thread's finiteness mask of a slice (a slice has at most SLICE_BYTES elements): one
  per worker, not one per array, whose pages would be faulted in again for every array."""
  mask = getattr(_PER_THREAD, "mask", None)
  if mask is None:
    mask = _PER_THREAD.mask = np.empty(SLICE_BYTES, bool)
  return mask


class _Crc:
  """CRC32 and finiteness of an array's bytes, fed slice by slice in order."""

  def __init__(self, dtype: np.dtype, check_finite: bool) -> None:
    self.dtype = dtype
    self.check = check_finite and is_floating(dtype)
    self.crc, self.finite = 0, True
    self._mask = _mask()

  def update(self, part: np.ndarray) -> None:
    """`part`: a 1-D slice of the flat array, of at most SLICE_BYTES."""
    self.crc = crc32(part.view(np.uint8), self.crc)
    if self.check and self.finite:
      out = self._mask[:part.size]
      np.isfinite(part, out=out)
      self.finite = bool(out.all())

  @property
  def hex(self) -> str:
    return f"{self.crc & 0xFFFFFFFF:08x}"


def checksum_and_finite(a: np.ndarray, check_finite: bool = True) -> tuple[str, bool]:
  """CRC32 of `a`'s C-order bytes and whether it holds no inf/NaN, in one pass over its memory.

  The one checksum of the format: saves record it, loads compare it. zlib.crc32 and numpy's
  ufuncs release the GIL, so threads run this in parallel.
  """
  flat = np.ascontiguousarray(a).reshape(-1)
  crc = _Crc(flat.dtype, check_finite)
  step = max(1, SLICE_BYTES // max(1, flat.itemsize))
  for i in range(0, flat.size, step):
    crc.update(flat[i:i + step])
  return crc.hex, crc.finite


@dataclasses.dataclass
class Entry:
  """One array's restore: the array, or why it is unusable, and where its time went."""
  group: str
  name: str
  array: np.ndarray | None = None
  error: str | None = None
  direct: bool = False
  """Read by the fast path (and verified there)."""
  read_s: float = 0.0
  """Waiting for bytes (the kernel's copy, or tensorstore's open and read)."""
  verify_s: float = 0.0
  """CRC32 + finiteness."""


@dataclasses.dataclass(frozen=True)
class _Where:
  """An array's chunk in the OCDBT database: inline bytes, or a range of a data file."""
  inline: bytes | None = None
  file: Path | None = None
  offset: int = 0
  length: int = 0


def _as_bytes(x: Any) -> bytes:
  # The dump gives bytes; older tensorstore versions gave their repr.
  return x if isinstance(x, bytes) else ast.literal_eval(x)


def _chunk_locations(state: Path, meta: Mapping[str, Any]) -> dict[tuple[str, str], _Where]:
  """Where each single-chunk, uncompressed, C-order array of the metadata lies; arrays stored
  otherwise are left out (the tensorstore path reads them). Empty if the tree is not one we
  can walk."""
  import tensorstore as ts

  try:
    kv = ts.KvStore.open(state.absolute().as_uri() + "/").result()
    manifest = ts.ocdbt.dump(kv).result()
    version = manifest["versions"][-1]
    if version.get("root_height", 0) != 0:  # a tree of several nodes: not worth parsing here
      return {}
    node = ts.ocdbt.dump(kv, version["root"]["location"]).result()
    values: dict[bytes, bytes | str] = {}
    for e in node["entries"]:
      if "inline_value" in e:
        values[_as_bytes(e["key"])] = _as_bytes(e["inline_value"])
      elif "indirect_value" in e:
        values[_as_bytes(e["key"])] = str(e["indirect_value"])
  except Exception:  # an unexpected manifest: everything goes through tensorstore
    return {}
  out: dict[tuple[str, str], _Where] = {}
  for group in GROUPS:
    for name, info in meta["entries"][group].items():
      prefix = f"{group}.{name}/"
      try:
        zarray = json.loads(values[f"{prefix}.zarray".encode()])
        shape, dtype = list(info["shape"]), np.dtype(info["dtype"])
        stored_dtype = np.dtype(zarray.get("dtype"))
      except (KeyError, TypeError, ValueError, AttributeError):
        continue
      if (zarray.get("zarr_format") != 2 or zarray.get("compressor") is not None
          or zarray.get("filters") is not None or zarray.get("order") != "C"
          or list(zarray.get("shape", [])) != shape or stored_dtype != dtype
          or list(zarray.get("chunks", [])) != shape):
        continue
      chunk = values.get(f"{prefix}{'.'.join('0' * max(1, len(shape)))}".encode())
      if isinstance(chunk, bytes):
        out[(group, name)] = _Where(inline=chunk)
      elif isinstance(chunk, str) and chunk.startswith("value:"):
        # value:<prefix>:<data file relative to the prefix>:<offset>:<length>
        prefix_dir, rel, offset, length = chunk[len("value:"):].rsplit(":", 3)
        out[(group, name)] = _Where(file=state / prefix_dir / rel, offset=int(offset),
                                    length=int(length))
  return out


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """An uninitialised array at a 64-byte-aligned address, which JAX's CPU client aliases rather
  than copies when it is placed (`jax.device_put`): `np.empty` gives 16-byte alignment, and
  then placing a restored state on a CPU device copied every array once per device holding it
  (0.15-0.2 s for 1.3 GiB onto two devices, a third of a warm reshard-load).

  The bytes are shared with the device from then on, which is safe because the load returns
  them read-only and XLA's CPU client never writes into a buffer it was handed: a step that
  donates such an array gets a fresh output buffer (jax 0.10; `tests/test_checkpoint.py::
  test_resume_on_another_layout` checks that the loaded bytes survive the steps after a
  restore, with two devices sharing them).
  """
  count = int(np.prod(shape, dtype=np.int64))
  nbytes = count * dtype.itemsize
  raw = np.empty(nbytes + ALIGN, np.uint8)
  start = -raw.ctypes.data % ALIGN
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def _read_direct(e: Entry, info: Mapping[str, Any], where: _Where) -> None:
  """Reads an array into a fresh buffer slice by slice, checksumming each slice as it lands."""
  shape, dtype = tuple(info["shape"]), np.dtype(info["dtype"])
  a = aligned_empty(shape, dtype)
  flat = a.reshape(-1)
  raw = flat.view(np.uint8)
  if raw.size != (len(where.inline) if where.inline is not None else where.length):
    e.error = "has the wrong number of bytes"
    return
  crc = _Crc(dtype, check_finite=True)
  step = max(1, SLICE_BYTES // max(1, dtype.itemsize))
  if where.inline is not None:
    raw[:] = np.frombuffer(where.inline, np.uint8)
    t0 = time.perf_counter()
    for i in range(0, flat.size, step):
      crc.update(flat[i:i + step])
    e.verify_s += time.perf_counter() - t0
  else:
    fd = os.open(where.file, os.O_RDONLY)
    try:
      for i in range(0, flat.size, step):
        t0 = time.perf_counter()
        lo, hi = i * dtype.itemsize, min(flat.size, i + step) * dtype.itemsize
        got = lo
        while got < hi:
          n = os.preadv(fd, [raw[got:hi]], where.offset + got)
          if n <= 0:
            e.error = "is truncated"
            return
          got += n
        t1 = time.perf_counter()
        crc.update(flat[i:i + step])
        e.read_s += t1 - t0
        e.verify_s += time.perf_counter() - t1
    finally:
      os.close(fd)
  _judge(e, info, a, crc.hex, crc.finite)


def _judge(e: Entry, info: Mapping[str, Any], a: np.ndarray, crc: str, finite: bool) -> None:
  if crc != info["crc32"]:
    e.error = "fails its checksum"
  elif not finite:
    e.error = NON_FINITE
  else:
    # Read-only: placement on a CPU device may alias these bytes (`aligned_empty`), so a write
    # through the array would change the device's state behind JAX's back.
    a.flags.writeable = False
    e.array, e.error = a, None


def _read_tensorstore(e: Entry, info: Mapping[str, Any], driver: str, kvstore: dict[str, Any],
                      ctx: Any) -> None:
  """Reads an array through tensorstore's zarr driver (any layout orbax writes) and verifies
  it."""
  import tensorstore as ts

  t0 = time.perf_counter()
  try:
    store = ts.open({"driver": driver, "kvstore": {**kvstore, "path": f"{e.group}.{e.name}/"}},
                    context=ctx, open=True, read=True).result()
  except Exception as err:  # tensorstore reports a missing array as ValueError(NOT_FOUND)
    e.error = ("is missing" if "NOT_FOUND" in str(err)
               else f"is unreadable ({str(err).splitlines()[0][:200]})")
    return
  dtype = store.dtype.numpy_dtype
  if list(store.shape) != info["shape"] or str(dtype) != info["dtype"]:
    e.error = f"has shape {tuple(store.shape)} {dtype}, expected {info['shape']} {info['dtype']}"
    return
  try:
    a = np.asarray(store.read(order="C").result())
  except Exception as err:  # truncated or damaged data files
    e.error = f"is unreadable ({str(err).splitlines()[0][:200]})"
    return
  t1 = time.perf_counter()
  crc, finite = checksum_and_finite(a)
  e.read_s += t1 - t0
  e.verify_s += time.perf_counter() - t1
  _judge(e, info, a, crc, finite)


def read_verified(path: Path, meta: Mapping[str, Any], workers: int | None = None
                  ) -> tuple[list[Entry], dict[str, float]]:
  """Reads and verifies every entry of the metadata `meta` from `path/state`, `workers`
  arrays at once.

  Returns:
    every entry (its array, or its error) in the metadata's order, and seconds: `wall_s` in all,
    `locate_s` of it finding where the arrays lie.

  Raises:
    StateUnreadable: the state folder's metadata is missing or of another layout.
  """
  import tensorstore as ts

  state = path / "state"
  try:
    fmt = json.loads((state / "_METADATA").read_text())
  except (OSError, json.JSONDecodeError) as err:
    raise StateUnreadable(f"state metadata unreadable ({err})") from None
  if not isinstance(fmt, dict) or not fmt.get("use_ocdbt", False):
    raise StateUnreadable("state not written as one OCDBT database")
  driver = "zarr3" if fmt.get("use_zarr3", False) else "zarr"
  kvstore = {"driver": "ocdbt", "base": state.absolute().as_uri()}
  workers = workers or default_workers()
  ctx = ts.Context({"file_io_concurrency": {"limit": workers},
                    "data_copy_concurrency": {"limit": workers}})

  t0 = time.perf_counter()
  where = _chunk_locations(state, meta) if driver == "zarr" else {}
  locate_s = time.perf_counter() - t0

  def restore(e: Entry) -> None:
    info = meta["entries"][e.group][e.name]
    if (e.group, e.name) in where:
      try:
        _read_direct(e, info, where[(e.group, e.name)])
      except Exception as err:  # a data file gone or unreadable: tensorstore says what
        e.error = str(err)
      if e.error is None:
        e.direct = True
        return
      e.error, e.array = None, None  # a second opinion from tensorstore decides
    try:
      _read_tensorstore(e, info, driver, kvstore, ctx)
    except Exception as err:  # e.g. a dtype this numpy does not know
      e.error = f"is unreadable ({type(err).__name__}: {str(err).splitlines()[0][:200]})"

  todo = [Entry(g, k) for g in GROUPS for k in meta["entries"][g]]
  # In file order, so that the workers together read each data file front to back and the
  # kernel's readahead streams it from the disk, as for a plain read of the files (a separate
  # WILLNEED prefetch of every file measured no better); tensorstore's entries after.
  def file_order(e: Entry) -> tuple[int, str, int]:
    w = where.get((e.group, e.name))
    return (0, str(w.file or ""), w.offset) if w else (1, "", 0)

  order = sorted(todo, key=file_order)
  with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-load") as pool:
    list(pool.map(restore, order))
  return todo, {"wall_s": time.perf_counter() - t0, "locate_s": locate_s}

