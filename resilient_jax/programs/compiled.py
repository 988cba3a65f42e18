"""One compiled program per stage, loaded on every device that runs it.

`jax.jit` keys its executables on the devices of the arguments, so a stage's programs running on
D data-parallel replicas are compiled D times, and on CPU JAX's persistent compilation cache
does not help: its key holds the device assignment (JAX drops it only for GPU). The program is
the same; only the device differs. `OnEachDevice` compiles once, serializes the executable and
loads it on each device with that device's assignment: loading costs a few milliseconds where
compiling costs up to seconds, so a job's compile count no longer grows with its data
parallelism (`benchmarks/cold_start.py` counts them).

The serialized programs are also kept on disk (`set_cache_dir`, which `runtime_setup` points at
`programs/` of the library's cache folder), keyed by the lowered module, every argument's and
output's shape and dtype (an argument the program never reads is not in the module), the JAX
and jaxlib versions, the platform, the host's instruction-set features (or the GPU's compute
capability) and `XLA_FLAGS`, not by device, so a restarted or relaunched job loads instead of
compiling; processes that need a program at the same time compile it once between them
(`compile_claims`: the others wait for the kept file). The key also holds the ops' named
scopes (`jax.named_scope`), which the module's text leaves out but the executable carries into
profiles.

A kept file is native code behind a pickle, and the folder may be shared: every file is signed
(HMAC-SHA256 with the user's key, `_secret`), and one that fails its signature (damaged, or
written by anyone without the key) is compiled again, never read further.

Platform fact (jax 0.10, CPU): an executable that JAX read back from its own persistent
compilation cache (`jax_compilation_cache_dir`, which users of other JAX libraries set)
serializes without its kernels, and the copy fails at run time ("Function ... not found").
JAX's cache cannot be bypassed for one compile (whether it is used is decided once per
process), but it says which compiles it served (`jax.monitoring`'s cache events, in the
compiling thread): only an executable XLA has just compiled is serialized and loaded elsewhere.
One that JAX's cache served runs on its own device, and the next device compiles the program
again; on CPU JAX's key holds the device assignment, so that compile is XLA's own and its
executable serves every later device. So with JAX's cache on, compiles stay flat in dp too:
one per program from an empty JAX cache, one read of it plus one compile from a JAX cache
that holds the first device's entry, none once this library's own folder holds the program
(it is read first). Where JAX says nothing of a compile it was asked to cache (another JAX
version's events), the program is compiled per device like `jax.jit`: slower, never wrong.

If loading fails (a backend or JAX version without executable serialization), that device gets
an executable compiled for it: slower to start, never wrong.

Loading ahead (`OnEachDevice.expect`): the interpreter names the devices each stage program will
run on, and as soon as an executable exists (compiled, or read from disk) background threads
(`_loader`: the cores but one, at most four) load it on every other one, so a replica's first
call finds it ready instead of deserializing it on the one thread that dispatches every op.
Growth, per process: compiles O(programs), flat in dp, pp's stages of one shape sharing theirs;
loads (expected placements - 1) per program, as many as without loading ahead (an XLA:CPU load
measured 15-45 ms for a stage program), now beside the dispatching thread, in O(placements /
loader threads) wall time where cores are free; no extra compiles, loads or CPU.

A worker may be a sub-mesh of devices (tensor parallelism, `model/sharding.py`): its arguments
are then `NamedSharding`s over a mesh, and the program, traced against the mesh's shape rather
than its devices, is the same on every sub-mesh of that shape. It is compiled once and loaded
on each sub-mesh with the devices mapped by their position in the mesh (a kept file records
the devices it was compiled for, to map from).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import io
import logging
import os
import pickle
import platform
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jaxlib
import numpy as np
from jax._src.lib import xla_client  # CompileOptions, DeviceAssignment: no public home
from jax.experimental import serialize_executable

from resilient_jax.programs import compile_claims
from resilient_jax.programs.build_count import BuildCounter as BuildCounter  # re-exported
from resilient_jax.programs.build_count import count as _count
from resilient_jax.programs.build_count import local as _local

log = logging.getLogger(__name__)

_Signature = tuple[Any, ...]
Placement = tuple[jax.Device, ...]
"""The devices a program runs on: one, or a sub-mesh's in its order."""
_MESH_BLOB = b"resilient_jax mesh program\n"
"""Starts a kept file of a program for several devices (their ids follow, then the program)."""
_cache_dir: str | None = None


def set_cache_dir(path: str | None) -> None:
  """Where compiled programs are kept on disk (None: in memory only)."""
  global _cache_dir
  _cache_dir = path or None


def _jax_cache_on() -> bool:
  """Whether JAX's own persistent compilation cache may serve compiles in this process."""
  return bool(jax.config.jax_compilation_cache_dir) and jax.config.jax_enable_compilation_cache
_Blob = tuple[bytes, Any, Any, tuple[int, ...]]
"""Serialized executable, in_tree, out_tree, ids of the devices it was compiled for."""


_JAX_CACHE_ASKED = "/jax/compilation_cache/compile_requests_use_cache"  # `jax._src.compiler`'s
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _note_jax_cache(event: str, **_: Any) -> None:
  seen = getattr(_local, "jax_cache_events", None)
  if seen is not None and event in (_JAX_CACHE_ASKED, _JAX_CACHE_HIT):
    seen.add(event)


def _compile(lowered: jax.stages.Lowered, options: dict[str, Any]
             ) -> tuple[jax.stages.Compiled, bool]:
  """`lowered` compiled, and whether its executable is XLA's own output, which serializes
  whole (False: JAX's persistent cache served it, or may have and did not say)."""
  if not _jax_cache_on():
    return lowered.compile(options or None), True
  _local.jax_cache_events = seen = set()
  try:
    program = lowered.compile(options or None)
  finally:
    _local.jax_cache_events = None
  return program, _JAX_CACHE_ASKED in seen and _JAX_CACHE_HIT not in seen


jax.monitoring.register_event_listener(_note_jax_cache)


class OnEachDevice:
  """`jax.jit(fn)`, compiled once and loaded on each device (or sub-mesh) its (committed)
  arguments live on.

  Args:
    fn: the function to jit.
    donate_argnums: as for `jax.jit`.
    keep_unused: as for `jax.jit`: a program whose outputs do not read its arguments' values
      (an initializer) then still runs where they live, so it can be loaded on another
      sub-mesh (otherwise jit drops them and places it on the default device).
    compiler_options: XLA options for this program's compile (`Lowered.compile`), e.g.
      `RUN_ONCE` for a program that runs once, where compile time is all its cost.
  """

  def __init__(self, fn: Callable, donate_argnums: int | Sequence[int] = (),
               keep_unused: bool = False, compiler_options: dict[str, Any] | None = None):
    self._jit = jax.jit(fn, donate_argnums=donate_argnums, keep_unused=keep_unused)
    self._options = dict(compiler_options or {})
    self._programs: dict[tuple[Placement, _Signature], Callable] = {}
    self._blobs: dict[_Signature, _Blob | None] = {}
    self._expected: list[Placement] = []
    self._pending: dict[tuple[Placement, _Signature], Future] = {}
    self._lock = threading.Lock()
    self.__name__ = getattr(fn, "__name__", "program")
    self.built = 0
    """Executables this program compiled or read from disk (the rest were loaded from them)."""

  @property
  def devices(self) -> int:
    """Devices it has run on (each signature counted apart)."""
    return len(self._programs)

  def lower(self, *args: Any) -> jax.stages.Lowered:
    """`jax.jit(fn).lower(*args)` (for cost and memory analyses)."""
    return self._jit.lower(*args)

  def expect(self, where: Any) -> None:
    """Says the program will run on `where` (a device, a sub-mesh's sharding or mesh): each
    executable made from now on is loaded there in the background (`_preload`), so the first
    call there takes it ready instead of loading it then."""
    placement = _as_placement(where)
    with self._lock:
      if placement not in self._expected:
        self._expected.append(placement)

  def __call__(self, *args: Any) -> Any:
    leaves, treedef = jax.tree.flatten(args)
    # No arguments (an initializer): the default device, where jit would place it.
    device = _placement(leaves) if leaves else (default_device(),)
    if device is None:  # nothing committed: jit places it
      return self._jit(*args)
    sig = _signature(treedef, leaves, multi=len(device) > 1)
    program = self._programs.get((device, sig))
    if program is None:
      with self._lock:
        program = self._programs.get((device, sig))
        if program is None:
          t0 = time.perf_counter()
          _local.building = True
          try:
            program = self._build(device, sig, args)
          finally:
            _local.building = False
            _count("build_s", time.perf_counter() - t0)
    return program(*args)

  def _build(self, device: Placement, sig: _Signature, args: tuple) -> Callable:
    """The program of `sig` on `device` (one or a sub-mesh's): loaded when compiled before (here
    or on disk), else compiled for `device`."""
    program = None
    if sig not in self._blobs:
      lowered = self._jit.lower(*args)
      path = _disk_path(lowered, self._options, sig[2] if len(sig) > 2 else ())
      kept, here = None, None
      if path is not None:  # one compile per cache folder, whoever else needs it now
        kept, compiled_here = compile_claims.compile_once(
          path, _read, lambda: self._compile_and_keep(lowered, path, device))
        if compiled_here:
          kept, here = None, kept
      if kept is not None:
        self._blobs[sig] = (kept[0], lowered.in_tree, lowered.out_tree, kept[1])
        program = _load(self._blobs[sig], device)
        _count("from_disk", program is not None)
      if here is not None:
        program, self._blobs[sig] = here
      if program is None:
        program, self._blobs[sig] = self._compile_and_keep(lowered, path, device)
      self.built += 1
      self._preload(device, sig)
    else:
      blob = self._blobs[sig]
      pending = self._pending.pop((device, sig), None)
      program = _loaded(pending) if pending is not None else \
        None if blob is None else _load(blob, device)
      if program is not None:
        _count("loaded")
      else:  # not loadable here; or JAX's cache served the first device: its own compile now
        lowered = self._jit.lower(*args)
        path = None if blob is not None else _disk_path(
          lowered, self._options, sig[2] if len(sig) > 2 else ())
        program, blob = self._compile_and_keep(lowered, path, device)
        if self._blobs[sig] is None:
          self._blobs[sig] = blob
        self.built += 1
    self._programs[(device, sig)] = program
    return program

  def _preload(self, device: Placement, sig: _Signature) -> None:
    """Starts loading `sig`'s new executable on every other placement it is expected on."""
    blob = self._blobs.get(sig)
    if blob is None:
      return
    for p in self._expected:
      if p != device and len(p) == len(device) and (p, sig) not in self._programs \
          and (p, sig) not in self._pending:
        self._pending[(p, sig)] = _loader().submit(_load, blob, p)

  def _compile_and_keep(self, lowered: jax.stages.Lowered, path: str | None,
                        device: Placement) -> tuple[Any, _Blob | None]:
    """Compiles `lowered` (for `device`), keeps it at `path`; the program and its blob (None
    where it cannot serve another device: see the module's platform fact)."""
    program, whole = _compile(lowered, self._options)
    _count("compiled")
    return program, (_serialize(program, path, device) if whole else None)


LOAD_WAIT_S = 300.0
"""The longest a first call waits for its program's background load (then it compiles)."""


@functools.cache
def _loader() -> ThreadPoolExecutor:
  """The threads that load executables ahead of their first call: all cores but the one
  dispatching (at least one, at most four: XLA:CPU's loads measured 15-45 ms each)."""
  return ThreadPoolExecutor(max(1, min(4, (os.cpu_count() or 2) - 1)),
                            thread_name_prefix="program-load")


def _loaded(pending: Future) -> Callable | None:
  try:
    return pending.result(timeout=LOAD_WAIT_S)
  except TimeoutError:
    log.warning("a program's load took over %.0f s; compiling it instead", LOAD_WAIT_S)
    return None


def _as_placement(where: Any) -> Placement:
  """A device, a sharding over a sub-mesh, or the mesh itself, as a `Placement`."""
  if isinstance(where, jax.Device):
    return (where,)
  mesh = where.mesh if isinstance(where, jax.sharding.NamedSharding) else where
  return tuple(mesh.devices.flat)


def default_device() -> jax.Device:
  """Where JAX puts an uncommitted computation: `jax_default_device`, else the first local
  device."""
  chosen = jax.config.jax_default_device
  return chosen if isinstance(chosen, jax.Device) else jax.local_devices()[0]


def _placement(leaves: list[Any]) -> Placement | None:
  """The devices of the first committed array among `leaves`: its one device, or its mesh's
  (in the mesh's order); None for other multi-device layouts (then jit places the program)."""
  for x in leaves:
    if isinstance(x, jax.Array) and getattr(x, "committed", False):
      devices = x.sharding.device_set
      if len(devices) == 1:
        return (next(iter(devices)),)
      if isinstance(x.sharding, jax.sharding.NamedSharding):
        return tuple(x.sharding.mesh.devices.flat)
      return None
  return None


def _signature(treedef: Any, leaves: list[Any], multi: bool) -> _Signature:
  """What a program is compiled for: the arguments' structure, shapes, dtypes and weak types,
  and on a sub-mesh (`multi`) how each is split over it.

  The interpreter calls a program for every op, with a stage's parameters, gradients and
  optimizer state as arguments (over a hundred leaves), so this is on the host's critical
  path: a `jax.Array`'s `aval` (shape, dtype, weak type in one hashable) costs a sixteenth of
  reading the three apart, and on one device every committed argument is on that device, so
  none has a layout to record.
  """
  try:
    avals = tuple([x.aval for x in leaves])
  except AttributeError:  # a NumPy array among them
    avals = tuple(x.aval if isinstance(x, jax.Array) else (np.shape(x), np.result_type(x))
                  for x in leaves)
  if avals and hasattr(avals[0], "layout"):  # JAX 0.11's avals carry one (0.10's do not)
    avals = tuple([_without_auto_layout(a) for a in avals])
  if not multi:
    return (treedef, avals)
  return (treedef, avals, tuple(_layout(x) for x in leaves))


def _without_auto_layout(aval: Any) -> Any:
  """`aval` keyed by its layout's text rather than the layout object. Measured on an H200 with
  JAX 0.11.2: arrays pulled from another process carry a layout that prints as `AutoLayout` ("the
  compiler chooses") yet equals no other array's, so no two steps' signatures matched and every
  step of a two-process job re-loaded all its programs (10 a step, +1 to 1.7 s; none after this
  change). JAX 0.10's avals have no layout."""
  layout = getattr(aval, "layout", None)
  if layout is None:
    return aval
  return (aval.shape, aval.dtype, aval.weak_type, aval.sharding, aval.memory_space, repr(layout))


def _layout(x: Any) -> Any:
  """How an argument is split over a sub-mesh (part of a program's signature); None on one
  device."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.device_set) > 1:
    spec = list(sharding.spec)
    while spec and spec[-1] is None:  # P("tp", None) splits as P("tp"): one program
      spec.pop()
    return tuple(spec)
  return None


RUN_ONCE = {"xla_backend_optimization_level": 0}
"""Compiler options of a program that runs once (a model's initializer): on XLA:CPU a random
initializer of the tiny GPT compiles in 0.7 s instead of 1.8 s, and runs in milliseconds
either way."""


def _disk_path(lowered: jax.stages.Lowered, options: dict[str, Any],
               layouts: tuple[Any, ...] = ()) -> str | None:
  """Where the program's serialized executable is kept, or None without a cache folder.

  The key holds what the executable's callers depend on and its text may not show: every
  argument's shape, dtype and donation (jit drops an argument the program never
  reads from the text, and the executable still checks the shape it was compiled for), which
  arguments it reads, the outputs', and on a sub-mesh how each argument is split (`layouts`);
  and what makes it run correctly on a host (`host_features`).
  """
  if not _cache_dir:
    return None
  # Which arguments the program reads: jit drops the others from the text, so two programs
  # reading different arguments of the same shapes (the second of two equal buffers, not the
  # first) can have the same text. Unknown (another JAX's internals): nothing is kept.
  kept = getattr(getattr(lowered, "_lowering", None), "compile_args", {}).get("kept_var_idx")
  if kept is None:
    return None
  device = jax.devices()[0]
  key = hashlib.sha256()
  # Compiler options only where given: the keys of every other program stay as they were.
  compile_options = [repr(sorted(options.items()))] if options else []
  text = _RESULT_INFO.sub("", lowered.as_text())
  args = [(a.shape, str(a.dtype), a.donated) for a in jax.tree.leaves(lowered.args_info)]
  outs = [(o.shape, str(o.dtype)) for o in jax.tree.leaves(lowered.out_info)]
  for part in (text, _scopes(lowered), repr(args), repr(sorted(kept)), repr(outs), repr(layouts),
               jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
               device.client.platform_version, host_features(device),
               os.environ.get("XLA_FLAGS", ""), *compile_options):
    key.update(part.encode())
    key.update(b"\0")
  return os.path.join(_cache_dir, key.hexdigest())


@functools.cache
def host_features(device: jax.Device) -> str:
  """What an executable compiled for `device`'s kind needs of the host it runs on.

  XLA:CPU compiles for the processor it runs on (AVX-512 where there is AVX-512), so a program
  kept by one host of a shared cache folder can fault on a host without those instructions: on
  CPU this is the machine and its instruction-set flags (`/proc/cpuinfo`; where there is none,
  what `platform` says). On GPU it is the compute capability (the model is `device_kind`,
  already in the key); TPU kinds are their `device_kind`.
  """
  if device.platform != "cpu":
    return str(getattr(device, "compute_capability", ""))
  machine = platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86, Arm
          return f"{machine}: {' '.join(sorted(set(value.split())))}"
  except OSError:
    pass
  return f"{machine}: {platform.processor()} {platform.platform()}"


_RESULT_INFO = re.compile(r'jax\.result_info = "[^"]*"')
"""The output paths JAX writes into a module (`result[0]['blocks.2.mlp.fc.kernel']`): names,
not computation. Left out of the key, so stages of the same shape whose parameters are named
after their blocks (stage 1's `blocks.2`, stage 2's `blocks.4`) share one kept program; the
caller's own lowering supplies the output structure."""
_SCOPED_LOC = re.compile(r'loc\("([^"]*/[^"]*)"\(')
"""A location naming an op by its name stack (`jit(f)/F/dot_general`), not a file."""


def _scopes(lowered: jax.stages.Lowered) -> str:
  """The name stacks of the program's ops: not in `as_text()` (they are debug information, as
  are source lines, which the key leaves out), but an executable without them would show
  unnamed ops in a profile."""
  return "\n".join(sorted(set(_SCOPED_LOC.findall(lowered.as_text(debug_info=True)))))


_KEPT = b"resilient_jax program v2\n"
"""Starts every kept file; its HMAC-SHA256 (32 bytes) follows, then the program."""
SECRET_ENV = "RESILIENT_JAX_CACHE_SECRET"


@functools.cache
def _secret() -> bytes | None:
  """The key that signs this user's kept programs: `$RESILIENT_JAX_CACHE_SECRET` (hosts that
  share a cache folder share it through the job's environment), else a random key made once in
  `~/.config/resilient_jax/cache.key`, readable by its owner alone. None (the cache is then
  not read): a key file others may read or write."""
  if os.environ.get(SECRET_ENV):
    return os.environ[SECRET_ENV].encode()
  home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
  path = os.path.join(home, "resilient_jax", "cache.key")
  try:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if not os.path.exists(path):  # made whole, then linked: a racing process sees all or none
      tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
      fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
      with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32).hex().encode())
      try:
        os.link(tmp, path)
      except FileExistsError:
        pass
      finally:
        os.remove(tmp)
    st = os.stat(path)
    if st.st_mode & 0o077 or st.st_uid != os.getuid():
      log.warning("%s may be read or written by others: kept programs are not used (make it "
                  "mode 600, or set %s)", path, SECRET_ENV)
      return None
    with open(path, "rb") as f:
      return f.read().strip() or None
  except OSError as err:
    log.warning("no key to sign kept programs (%s): they are not used", err)
    return None


def _mac(path: str, body: bytes) -> bytes | None:
  """The signature of `body` kept under `path`'s name (an entry moved to another key fails)."""
  secret = _secret()
  if secret is None:
    return None
  return hmac.new(secret, os.path.basename(path).encode() + b"\0" + body, "sha256").digest()


def _read(path: str | None) -> tuple[bytes, tuple[int, ...]] | None:
  """A kept program and the ids of the devices it was compiled for (empty: one device); None
  when there is none, or it fails its signature (damaged, or not written by a holder of this
  user's key: a kept file is native code and a pickle, so nothing else of it is trusted)."""
  if path is None:
    return None
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError:
    return None
  if not data.startswith(_KEPT):
    log.debug("%s: not a kept program of this version", path)
    return None
  mac, data = data[len(_KEPT):len(_KEPT) + 32], data[len(_KEPT) + 32:]
  want = _mac(path, data)
  if want is None or not hmac.compare_digest(mac, want):
    log.warning("a kept program in %s fails its signature (damaged, or written without this "
                "user's key): compiling it again", os.path.dirname(path))
    return None
  if not data.startswith(_MESH_BLOB):
    return data, ()
  ids, _, rest = data[len(_MESH_BLOB):].partition(b"\n")
  return rest, tuple(int(i) for i in ids.split(b","))


def _serialize(program: jax.stages.Compiled, path: str | None, devices: Placement
               ) -> _Blob | None:
  """The program's loadable bytes (also written to `path`), or None if it has none."""
  try:
    data, in_tree, out_tree = serialize_executable.serialize(program)
  except Exception as err:  # noqa: BLE001 - any backend limit: compile per device instead
    log.debug("cannot serialize a program: %s", err)
    return None
  ids = tuple(d.id for d in devices) if len(devices) > 1 else ()
  if path is not None:
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      body = (_MESH_BLOB + ",".join(map(str, ids)).encode() + b"\n" if ids else b"") + data
      mac = _mac(path, body)
      if mac is not None:  # unsigned, no later reader would trust it
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
          f.write(_KEPT + mac + body)
        os.replace(tmp, path)  # readers see a whole file or none
    except OSError as err:
      log.debug("cannot keep a compiled program in %s: %s", path, err)
  return data, in_tree, out_tree, ids


class _Retarget(pickle.Unpickler):
  """Reads `serialize_executable.serialize`'s output with every device reference (and the
  executable's device assignment) moved to `devices`: a one-device program's to that device,
  a sub-mesh program's device `origin[i]` to `devices[i]`."""

  def __init__(self, data: bytes, devices: Placement, origin: tuple[int, ...]):
    super().__init__(io.BytesIO(data))
    self.devices = devices
    self.moved = dict(zip(origin, devices, strict=True)) if len(devices) > 1 else {}
    self.client = devices[0].client

  def find_class(self, module: str, name: str) -> Any:
    # Behind the signature (`_read`), a second fence: a program's pickle names JAX's and
    # NumPy's own types, never anything that could run a command.
    if module.split(".")[0] not in ("jax", "jaxlib", "numpy") or "." in name:
      raise pickle.UnpicklingError(f"{module}.{name} is not part of a compiled program")
    return super().find_class(module, name)

  def persistent_load(self, pid: Any) -> Any:
    kind = pid[0]
    if kind == "exec":
      options = xla_client.CompileOptions()
      options.device_assignment = xla_client.DeviceAssignment.create(
        np.array([[d.id for d in self.devices]]))
      if len(self.devices) > 1:  # one replica partitioned over the sub-mesh
        options.executable_build_options.num_partitions = len(self.devices)
        options.executable_build_options.use_spmd_partitioning = True
      return self.client.deserialize_executable(
        pid[1], executable_devices=xla_client.DeviceList(self.devices), compile_options=options)
    if kind == "device":
      return self.moved[pid[1]] if self.moved else self.devices[0]
    if kind == "client":
      return self.client
    raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")


def _load(blob: _Blob, device: Placement) -> Callable | None:
  """The serialized program, loaded on `device` (one or a sub-mesh's); None if this JAX
  cannot."""
  data, in_tree, out_tree, origin = blob
  if len(origin) != (len(device) if len(device) > 1 else 0):
    return None  # compiled for another number of devices
  try:
    unloaded, args_info_flat, no_kwargs = _Retarget(data, device, origin).load()
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree,
                               no_kwargs=no_kwargs)
  except Exception as err:  # noqa: BLE001 - fall back to compiling for this device
    log.warning("could not load a compiled program on %s (%s); compiling it there", device,
                str(err).splitlines()[0][:200])
    return None
