"""A cluster on one machine: hosts as network namespaces on a private bridge, and a real SLURM.

  python -m launch.cluster_box --hosts=2 --slurm      # up until Ctrl-C; prints how to use it

Each host k (1..N) is a network namespace `{tag}h{k}` whose one interface has the address
`{subnet}.{k}` on a bridge `{tag}br` that holds `{subnet}.254` in the root namespace and routes
nowhere else (the hosts have no default route), so a job's traffic goes only between hosts the
box made. A host's link can be rate-limited (`tc tbf` on both ends of its veth pair: what it
sends and what it receives) and cut (`cut`: its bridge port down, a cable pulled at the switch:
its packets go nowhere and connections to it time out rather than being refused) and restored.
Names resolve inside the hosts through `/etc/netns/{ns}/hosts`, which `ip netns exec` mounts
over `/etc/hosts` (the machine's own `/etc/hosts` is not touched): node `{tag}n{k}` is host k.

With `slurm=True` it also runs munge (its own socket), one `slurmctld` in the root namespace on
the bridge address and one `slurmd -N {tag}n{k}` inside each host's namespace, so a task's
sockets use its host's address; `env()` is the environment for `sbatch`, `srun`, `scontrol`
(`SLURM_CONF` pointing at the box's own slurm.conf). Every daemon and every process left in a
host is ended, and every namespace, link and file removed, when the box closes: on leaving the
`with` block (a test failure, Ctrl-C), at interpreter exit, or at the next start of a box with
the same tag (after a SIGKILL). Needs root, `ip` and `tc` (iproute2); SLURM needs the
`slurm-wlm` and `munge` packages (`missing()` says what is absent, for a test's skip reason).

Costs: a host is one namespace and one veth pair (milliseconds); SLURM's daemons are idle
between jobs (a few MiB each). Nothing here scales with a job's size.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

START_TIMEOUT_S = 60.0
"""Bound on any wait for the box's daemons (munge, slurmctld, every slurmd) to come up."""


def missing(slurm: bool = True) -> str | None:
  """Why a box cannot start on this machine (for a skip reason), or None if it can."""
  if os.geteuid() != 0:
    return "a cluster box needs root (network namespaces, a bridge, SLURM's daemons)"
  tools = ["ip", "tc"] + (["munged", "slurmctld", "slurmd", "sbatch", "scontrol"] if slurm
                          else [])
  absent = [t for t in tools if shutil.which(t) is None]
  if absent:
    pkgs = "iproute2" if set(absent) & {"ip", "tc"} else "slurm-wlm munge"
    return f"not installed: {', '.join(absent)} (apt-get install -y {pkgs})"
  probe = f"rjprobe{os.getpid()}"
  made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
  subprocess.run(["ip", "netns", "del", probe], capture_output=True)
  if made.returncode != 0:
    return ("cannot make network namespaces here (`ip netns add`: "
            f"{made.stderr.strip() or made.returncode}; a container without CAP_SYS_ADMIN?)")
  if slurm and not os.path.exists("/etc/munge/munge.key"):
    return "munge has no key (/etc/munge/munge.key): reinstall munge, or run mungekey"
  return None


def _run(cmd: Sequence[str], check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
  return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=30, **kw)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ClusterBox:
  """N hosts on a private bridge, optionally rate-limited, optionally with SLURM.

  Args:
    hosts: how many hosts (namespaces), numbered 1..hosts.
    rate_mbit: a rate limit on every host's link, each way (None: none).
    slurm: also run munge, slurmctld and a slurmd per host.
    tag: prefix of every name the box makes (namespaces, links, nodes); a box started with a
      tag removes whatever an earlier one of the same tag left behind.
    subnet: the first three octets of the hosts' addresses.
    cpus: the CPUs each SLURM node declares (accepted whatever the machine has:
      `SlurmdParameters=config_overrides`), so scripts asking for many CPUs a task still run.
  """

  def __init__(self, hosts: int, *, rate_mbit: float | None = None, slurm: bool = False,
               tag: str = "rj", subnet: str = "10.77.0", cpus: int = 32):
    if not 1 <= hosts <= 200:
      raise ValueError(f"hosts={hosts}: between 1 and 200")
    self.hosts = hosts
    self.rate_mbit = rate_mbit
    self.slurm = slurm
    self.tag = tag
    self.subnet = subnet
    self.cpus = cpus
    self.bridge = f"{tag}br"
    self.dir: Path | None = None
    self._daemons: list[subprocess.Popen] = []
    self._closed = True
    self._sigterm_set = False
    self.keep_logs = False
    """Leave the box's folder (its logs) in place when it closes."""

  # ------------------------------------------------------------------ names

  def ns(self, k: int) -> str:
    """Host k's network namespace."""
    return f"{self.tag}h{k}"

  def node(self, k: int) -> str:
    """Host k's name (its SLURM node name; resolves to `addr(k)` inside every host)."""
    return f"{self.tag}n{k}"

  def addr(self, k: int) -> str:
    """Host k's address."""
    return f"{self.subnet}.{k}"

  def _port_link(self, k: int) -> str:
    return f"{self.tag}v{k}"  # the root-namespace end of host k's veth pair (its bridge port)

  # ------------------------------------------------------------------ life

  def __enter__(self) -> ClusterBox:
    self.start()
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def start(self) -> None:
    """Makes the hosts (and SLURM's daemons); on any failure removes what it made and raises."""
    why = missing(self.slurm)
    if why:
      raise RuntimeError(why)
    self._sweep()
    self._closed = False
    atexit.register(self.close)
    # SIGTERM would end the interpreter without atexit: made an exit, so the box still closes.
    if (threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
      signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
      self._sigterm_set = True  # put back at `close`: the process goes on without the box
    try:
      self.dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}box-"))
      _run(["ip", "link", "add", self.bridge, "type", "bridge"])
      _run(["ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge])
      _run(["ip", "link", "set", self.bridge, "up"])
      hosts_file = "127.0.0.1 localhost\n" + "".join(
        f"{self.addr(k)} {self.node(k)}\n" for k in range(1, self.hosts + 1))
      for k in range(1, self.hosts + 1):
        ns, port = self.ns(k), self._port_link(k)
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "link", "set", port, "master", self.bridge, "up"])
        self.in_host(k, ["ip", "addr", "add", f"{self.addr(k)}/24", "dev", "eth0"])
        self.in_host(k, ["ip", "link", "set", "eth0", "up"])
        self.in_host(k, ["ip", "link", "set", "lo", "up"])
        Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
        Path(f"/etc/netns/{ns}/hosts").write_text(hosts_file)
        if self.rate_mbit:
          self.limit(k, self.rate_mbit)
      if self.slurm:
        self._start_slurm()
    except BaseException:
      self.keep_logs = True  # named in the error: kept for reading
      self.close()
      raise

  def close(self) -> None:
    """Ends every daemon and every process in the hosts, removes every namespace, link and
    file the box made. Safe to call twice."""
    if self._closed:
      return
    self._closed = True
    for p in reversed(self._daemons):
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    for p in reversed(self._daemons):
      try:
        p.wait(5)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)
    self._daemons.clear()
    self._sweep()
    if self._sigterm_set and threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGTERM, signal.SIG_DFL)
      self._sigterm_set = False
    if self.dir is not None and not self.keep_logs:
      shutil.rmtree(self.dir, ignore_errors=True)
    atexit.unregister(self.close)

  def _sweep(self) -> None:
    """Removes what a box of this tag made: processes in its namespaces, the namespaces, the
    links and `/etc/netns` entries (this box's, or an earlier one's that was SIGKILLed)."""
    ours = [n.split()[0] for n in _run(["ip", "netns", "list"], check=False).stdout.splitlines()
            if n.split() and n.split()[0].startswith(f"{self.tag}h")
            and n.split()[0][len(self.tag) + 1:].isdigit()]
    for ns in ours:
      pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
      for pid in pids:  # only processes inside a namespace of ours: the box's own
        try:
          os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
          pass
    # An earlier box's daemons in the root namespace (slurmctld, munged), when it was SIGKILLed:
    # a process is ended only if its command line names that box's own folder.
    for d in Path(tempfile.gettempdir()).glob(f"{self.tag}box-*"):
      if d == self.dir or not (d / "log").is_dir() or self.keep_logs:
        continue
      for proc in Path("/proc").iterdir():
        try:
          if proc.name.isdigit() and str(d).encode() in (proc / "cmdline").read_bytes():
            os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
          pass
      shutil.rmtree(d, ignore_errors=True)
    deadline = time.monotonic() + 10
    for ns in ours:
      while _run(["ip", "netns", "pids", ns], check=False).stdout.split() and \
          time.monotonic() < deadline:
        time.sleep(0.05)
      _run(["ip", "netns", "del", ns], check=False)
      shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for line in links.splitlines():
      name = line.split(":")[1].strip().split("@")[0]
      if name == self.bridge or (name.startswith(f"{self.tag}v")
                                 and name[len(self.tag) + 1:].isdigit()):
        _run(["ip", "link", "del", name], check=False)

  # ------------------------------------------------------------------ hosts

  def in_host(self, k: int, cmd: Sequence[str], check: bool = True
              ) -> subprocess.CompletedProcess:
    """Runs `cmd` in host k and returns its result (bounded: 30 s)."""
    return _run(["ip", "netns", "exec", self.ns(k), *cmd], check=check)

  def enter(self, k: int) -> list[str]:
    """A command prefix that runs in host k's network namespace with the box's names (its
    hosts file over /etc/hosts, in a mount namespace of its own) and the machine's /sys
    (`ip netns exec` would remount /sys, hiding the cgroup mounts slurmd needs)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind /etc/netns/{self.ns(k)}/hosts /etc/hosts && exec "$0" "$@"',
            "nsenter", f"--net=/run/netns/{self.ns(k)}"]

  def popen(self, k: int, cmd: Sequence[str], **kw: Any) -> subprocess.Popen:
    """Starts `cmd` in host k (its sockets on host k's address; names resolve as in the box)."""
    return subprocess.Popen(["ip", "netns", "exec", self.ns(k), *cmd], **kw)

  def limit(self, k: int, mbit: float | None) -> None:
    """Rate-limits host k's link to `mbit` Mbit/s each way (None: no limit)."""
    burst = "64kb"
    for where in (["ip", "netns", "exec", self.ns(k)], []):
      dev = "eth0" if where else self._port_link(k)
      _run([*where, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
      if mbit:
        _run([*where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
              "burst", burst, "latency", "100ms"])

  def cut(self, k: int) -> None:
    """Host k's link down at the bridge: it lives, but nothing reaches it or leaves it."""
    _run(["ip", "link", "set", self._port_link(k), "down"])

  def restore(self, k: int) -> None:
    """Host k's link up again."""
    _run(["ip", "link", "set", self._port_link(k), "up"])

  def listeners(self, k: int) -> list[tuple[str, str]]:
    """Every listening TCP socket in host k: (local address:port, process)."""
    out = self.in_host(k, ["ss", "-Hltnp"]).stdout
    rows = []
    for line in out.splitlines():
      parts = line.split()
      if len(parts) >= 4:
        rows.append((parts[3], parts[5] if len(parts) > 5 else ""))
    return rows

  # ------------------------------------------------------------------ SLURM

  def env(self) -> dict[str, str]:
    """The environment for SLURM's commands against this box."""
    assert self.dir is not None
    return {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}

  def scontrol(self, *args: str, check: bool = True) -> str:
    return _run(["scontrol", *args], check=check, env=self.env()).stdout

  def _start_slurm(self) -> None:
    assert self.dir is not None
    d = self.dir
    for sub in ("state", "spool", "log"):
      (d / sub).mkdir()
    sock = d / "munge.sock"
    self._daemon(["munged", "-F", "--force", f"--socket={sock}", "--key-file=/etc/munge/munge.key",
                  f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed",
                  f"--log-file={d}/log/munged.log"], "munged")
    self._wait_for(lambda: sock.exists(), "munged's socket")
    ctl_port, node_port = _free_port(), _free_port()
    nodes = "".join(
      f"NodeName={self.node(k)} NodeHostname={self.node(k)} NodeAddr={self.addr(k)} "
      f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN\n" for k in range(1, self.hosts + 1))
    (d / "slurm.conf").write_text(f"""\
ClusterName={self.tag}box
SlurmctldHost={socket.gethostname()}({self.subnet}.254)
SlurmctldPort={ctl_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire=15
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdTimeout=30
JobRequeue=1
MinJobAge=600
{nodes}PartitionName=box Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    env = self.env()
    self._daemon(["slurmctld", "-D", "-i", "-f", str(d / "slurm.conf")], "slurmctld", env=env)
    self._wait_for(lambda: _run(["scontrol", "ping"], check=False, env=env).returncode == 0,
                   "slurmctld")
    for k in range(1, self.hosts + 1):
      (d / "spool" / self.node(k)).mkdir()
      self._daemon([*self.enter(k), "slurmd", "-D", "-N", self.node(k),
                    "-f", str(d / "slurm.conf")], f"slurmd {self.node(k)}", env=env)
    names = ",".join(self.node(k) for k in range(1, self.hosts + 1))

    def all_idle() -> bool:
      out = _run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, env=env).stdout.split()
      states = dict(zip(out[::2], out[1::2], strict=False))
      if len(states) == self.hosts and all(s == "idle" for s in states.values()):
        return True
      if any(s.startswith(("drain", "down")) for s in states.values()):
        self.resume(names)
      return False

    self._wait_for(all_idle, "every slurmd to register (sinfo: idle)")

  def resume(self, nodes: str) -> None:
    """Puts nodes back into service (a node starts, or returns, down or drained)."""
    _run(["scontrol", "update", f"nodename={nodes}", "state=resume"], check=False,
         env=self.env())

  def _daemon(self, cmd: list[str], name: str, **kw: Any) -> None:
    assert self.dir is not None
    log = open(self.dir / "log" / f"{name.replace(' ', '.')}.out", "wb")  # noqa: SIM115
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         **kw)
    log.close()
    self._daemons.append(p)

  def _wait_for(self, ready: Any, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
      dead = [p.args for p in self._daemons if p.poll() is not None]
      if dead or time.monotonic() > deadline:
        raise RuntimeError(f"cluster box: {what} not up within {START_TIMEOUT_S:.0f}s"
                           + (f" (exited: {dead})" if dead else "") + f"; logs in {self.dir}/log")
      time.sleep(0.2)

  def log_text(self, name: str) -> str:
    """A daemon's log (`slurmctld`, `slurmd.{node}`, `munged`)."""
    assert self.dir is not None
    path = self.dir / "log" / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


_HOSTS = flags.DEFINE_integer("hosts", 2, "how many hosts")
_RATE = flags.DEFINE_float("rate_mbit", 0, "rate limit of every host's link (Mbit/s; 0: none)")
_SLURM = flags.DEFINE_bool("slurm", False, "also run munge, slurmctld and a slurmd per host")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
    sys.exit(2)
  why = missing(_SLURM.value)
  if why:
    print(f"error: {why}", file=sys.stderr)
    sys.exit(2)
  if not 1 <= _HOSTS.value <= 200:
    print(f"error: --hosts={_HOSTS.value}: between 1 and 200", file=sys.stderr)
    sys.exit(2)
  box = ClusterBox(_HOSTS.value, rate_mbit=_RATE.value or None, slurm=_SLURM.value)
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  with box:
    print(f"{box.hosts} hosts: " + ", ".join(
      f"{box.node(k)}={box.addr(k)} (ip netns exec {box.ns(k)} ...)"
      for k in range(1, box.hosts + 1)), flush=True)
    if box.slurm:
      print(f"SLURM: export SLURM_CONF={box.dir}/slurm.conf", flush=True)
    print("Ctrl-C ends the box and removes everything it made", flush=True)
    try:
      while True:
        time.sleep(3600)
    except KeyboardInterrupt:
      pass


if __name__ == "__main__":
  app.run(main)
