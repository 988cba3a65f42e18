"""What every entry point in `launch/` shares: absl's app, bad input as one line and exit 2.

Every launcher (and `python -m launch.checkpoint`) runs through `run`, an `absl.app.run`
entry point: `--help`/`--helpshort` (the launcher's own flags), `--helpfull` (every flag) and
absl's logging flags work as in any absl program, and help exits 0. Progress lines are
`absl.logging` lines (`resilient_jax.observe.logs`); `route_logs` sends them to stdout by
default, so
stderr holds only the one-line error of a failed run, to `--log_dir`'s file when that is given
(plus stderr with `--alsologtostderr`), or to stderr alone with `--logtostderr`. Other
libraries' INFO lines are held back below `--verbosity=1`.

A launcher's inputs are checked before JAX starts: flags, the config file and its
`--config.KEY=VALUE` overrides (`load_config`), and the output directory (`writable_dir`).
`launch.train` and `launch.local` read the training flags through one parser
(`define_train_flags`, `train_inputs`), so `launch.local` rejects what a worker would reject
before it starts any process.

`ml_collections.config_flags` loads the config file and applies the overrides while absl parses
the flags, so a user's syntax error, a `get_config` that raises, an unknown key and a value of
the wrong type all surface as exceptions from parsing, often wrapped twice. `describe` turns
each into one line that names the flag, key or file, without an exception class name.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import ml_collections
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

# Not re-exported by the package: the parser that loads a config file, and the test for a
# config flag.
from ml_collections.config_flags.config_flags import ConfigFileFlagParser, is_config_flag

if TYPE_CHECKING:
  from resilient_jax.config import RunConfig

EXIT_BAD_CONFIG = 2

T = TypeVar("T")

# What converting a loaded config raises for bad values (the ConfigError classes are
# ValueErrors; the rest come from configs that do not have the expected shape).
CONVERT_ERRORS = (ValueError, TypeError, KeyError, AttributeError, OSError)

_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false"}


def fail(message: str, code: int = EXIT_BAD_CONFIG) -> NoReturn:
  """Prints `error: MESSAGE` (one line) on stderr and exits with `code`."""
  print(f"error: {_one_line(message)}", file=sys.stderr)
  sys.exit(code)


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b")


class ClosedLoopTracebacks(io.TextIOBase):
  """`sys.stderr` without the tracebacks that end in `RuntimeError: Event loop is closed`.

  When a checkpoint write fails mid-save (a full disk), orbax closes its asyncio loop while
  tensorstore's writes still complete, and each completion's callback prints that traceback
  from a C++ thread (a dozen or more beside the run's one-line error). They say nothing the
  error does not. Lines pass through at once, except a traceback's, which is held until its
  last line shows what it is; `dropped` counts those left out. The launcher installs it (a
  process-wide setting the library itself never makes).
  """

  _END = "RuntimeError: Event loop is closed"

  def __init__(self, stream: Any):
    super().__init__()
    self.stream = stream
    self.dropped = 0
    self._held: list[str] = []
    self._partial = ""

  def write(self, text: str) -> int:
    self._partial += text
    *lines, self._partial = self._partial.split("\n")
    for line in lines:
      self._line(line + "\n")
    if not self._held and self._partial and not self._partial.startswith("Traceback"):
      self.stream.write(self._partial)  # a prompt without its newline yet
      self._partial = ""
    return len(text)

  def _line(self, line: str) -> None:
    if not self._held and not line.startswith("Traceback (most recent call last):"):
      self.stream.write(line)
      return
    if line[:1] in (" ", "\t") or line.startswith("Traceback"):
      self._held.append(line)
    elif _EXCEPTION_LINE.match(line):  # the traceback's last line
      held, self._held = [*self._held, line], []
      if line.rstrip("\n") == self._END:
        self.dropped += 1
      else:
        self.stream.write("".join(held))
    else:  # another thread's line, printed in the middle of the traceback
      self.stream.write(line)

  def flush(self) -> None:
    self.stream.write("".join(self._held) + self._partial)
    self._held, self._partial = [], ""
    self.stream.flush()

  def fileno(self) -> int:
    return self.stream.fileno()


def run(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> None:
  """Runs `main` under `absl.app.run`, with this module's flag parsing.

  A bad flag or config is a one-line error and exit 2 (absl's own parser would print the
  usage and exit 1); `--help`, `--helpshort` and `--helpfull` print help and exit 0.

  Args:
    main: the launcher, called with the arguments left after the flags (the program first);
      what it returns is the exit code.
    argv: the command line; default `sys.argv`.
  """
  argv = packaged_configs(list(sys.argv if argv is None else argv))
  sys.argv = argv  # config_flags reads the --config.KEY overrides from sys.argv
  if not isinstance(sys.stderr, ClosedLoopTracebacks):
    sys.stderr = ClosedLoopTracebacks(sys.stderr)
  _describe_program(sys.modules.get(main.__module__), argv[0])
  app.run(main, argv, flags_parser=_parse_app_flags)


_CONFIG_ARG = re.compile(r"^(--?config=)([^:]+)(:.*)?$")


def packaged_configs(argv: list[str]) -> list[str]:
  """`argv` with `--config=configs/NAME.py[:VARIANT]`, or the bare `--config=NAME[:VARIANT]`,
  pointing at the configs shipped with the package (`configs/NAME.py`, else
  `configs/sim/NAME.py`) when no such file is here: the commands of the README and docs/ then
  run from any directory (a file of that name in the working directory comes first)."""
  import importlib

  # Installed as `resilient_jax.configs` (`pyproject.toml`): found from any directory.
  configs = importlib.import_module("resilient_jax.configs")
  shipped = os.path.dirname(os.path.dirname(os.path.abspath(configs.__file__)))
  out = []
  for arg in argv:
    m = _CONFIG_ARG.match(arg)
    if m and not os.path.exists(m.group(2)):
      name = m.group(2)
      bare = "/" not in name and not name.endswith(".py")
      candidates = [f"configs/{name}.py", f"configs/sim/{name}.py"] if bare else (
        [name] if name.startswith("configs/") else [])
      found = [c for c in candidates if os.path.isfile(os.path.join(shipped, c))]
      if found:
        arg = f"{m.group(1)}{os.path.join(shipped, found[0])}{m.group(3) or ''}"
    out.append(arg)
  return out


_HELP_RE = re.compile(r"^--?(\?|help|helpshort|helpfull|helpxml)(=.*)?$")


def _parse_app_flags(argv: Sequence[str]) -> list[str]:
  """`absl.app.run`'s flags_parser: `parse_flags` on the global flags, then `route_logs`."""
  try:
    remaining = parse_flags(flags.FLAGS, argv)
  except SystemExit as e:
    # absl's help flags print the help, then exit 1; asking for help is no failure.
    if e.code == 1 and any(_HELP_RE.match(a) for a in _flags_part(argv)):
      sys.exit(0)
    raise
  route_logs()
  return remaining


def _flags_part(argv: Sequence[str]) -> list[str]:
  """The arguments before `--` (after it they are arguments, not flags)."""
  argv = list(argv)
  return argv[: argv.index("--")] if "--" in argv else argv


def _describe_program(module: Any, program: str) -> None:
  """Makes `--help` describe the launcher under any program name.

  absl's `--help` prints `__main__`'s docstring and the key flags of the module named
  `sys.argv[0]`. Under `python -m launch.train` that is the launcher; under a console script
  (`resilient-jax-train`) `__main__` is a generated wrapper, so the launcher's docstring and
  flags (and the training flags it defines through this module) are lent to it.
  """
  if module is None:
    return
  main_module = sys.modules.get("__main__")
  if main_module is not None and main_module is not module and not main_module.__doc__:
    main_module.__doc__ = module.__doc__
  names = {module.__name__, __name__}
  for name in names:
    for flag in flags.FLAGS.get_key_flags_for_module(name):
      flags.FLAGS.register_key_flag_for_module(program, flag)


def route_logs() -> None:
  """Sends absl's log lines where the parsed logging flags say.

  `--logtostderr`: stderr only (absl does that itself). `--log_dir=D`: absl's log file in D
  (created if needed), and stderr too with `--alsologtostderr`. Neither: the console, on
  stdout, so that progress lines and a failed run's one-line error (stderr) stay apart;
  `--alsologtostderr` alone moves them to stderr. `--verbosity`/`-v` sets the level (INFO by
  default: absl.app raises it there); below `--verbosity=1`, other libraries' INFO lines (orbax
  logs each save's internals) are held back and only this project's progress lines are INFO.
  """
  from resilient_jax.observe.logs import hold_back_library_info

  values = flags.FLAGS
  handler = absl_logging.get_absl_handler()
  hold_back_library_info()
  if values.logtostderr:
    return
  if values.log_dir:
    writable_dir("--log_dir", values.log_dir)
    handler.use_absl_log_file()
  elif not values.alsologtostderr:
    handler.python_handler.stream = sys.stdout


def parse_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> list[str]:
  """`flag_values(argv)`, failing with one line for any bad flag, config file or override."""
  problem = _config_path_problem(flag_values, argv)
  if problem:
    fail(problem)
  try:
    return flag_values(list(argv))
  except Exception as e:  # noqa: BLE001 - loading the config file runs the user's code
    fail(describe(e, flag_values, argv))


def log_file() -> str | None:
  """The absl log file this process writes (with `--log_dir`), or None."""
  stream = absl_logging.get_absl_handler().python_handler.stream
  name = getattr(stream, "name", None)
  if stream in (sys.stdout, sys.stderr) or not isinstance(name, str):
    return None
  return name if os.path.isfile(name) else None


# ---------------------------------------------------------------- the training flags


@dataclasses.dataclass(frozen=True)
class TrainFlags:
  """`launch.train`'s flags, defined on one `FlagValues`."""

  config: flags.FlagHolder
  workdir: flags.FlagHolder


def define_train_flags(
  flag_values: flags.FlagValues = flags.FLAGS, sys_argv: Sequence[str] | None = None
) -> TrainFlags:
  """Defines `--config` and `--workdir` on `flag_values`.

  Args:
    flag_values: where to define them.
    sys_argv: the command line the config overrides are read from (default `sys.argv` when
      parsing).
  """
  return TrainFlags(
    config=config_flags.DEFINE_config_file(
      "config", None, "Path to a configs/*.py file.", flag_values=flag_values,
      lock_config=True, sys_argv=None if sys_argv is None else list(sys_argv),
    ),
    workdir=flags.DEFINE_string(
      "workdir", None, "Directory for metrics, timelines, schedules.", flag_values=flag_values
    ),
  )


def train_inputs(remaining: Sequence[str], train_flags: TrainFlags) -> tuple[RunConfig, str]:
  """The validated `RunConfig` and the absolute workdir (created, writable) of parsed flags.

  Args:
    remaining: what flag parsing left (the program, then positional arguments).
    train_flags: the parsed flags.

  Returns:
    `(cfg, workdir)`; any bad input is a one-line error and exit 2 instead.
  """
  from resilient_jax.config import check_paths, from_config_dict, names_code
  from resilient_jax.files import UnusableFile, check_run_files

  if len(remaining) > 1:
    fail(f"unexpected arguments {' '.join(remaining[1:])} (flags are written --name=value)")

  def convert(cd: Any) -> RunConfig:
    cfg = from_config_dict(cd)
    check_paths(cfg)
    if not names_code(cfg):  # else the user's modules may register the policy: checked at start
      from resilient_jax.policy.registry import check_config

      check_config(cfg)
    return cfg

  cfg = load_config(train_flags.config, convert, "configs/gpt_tiny.py")
  workdir = writable_dir("--workdir", train_flags.workdir.value)
  try:  # e.g. a directory where metrics.jsonl belongs: refused before JAX starts
    check_run_files(workdir)
  except UnusableFile as e:
    fail(f"--workdir={train_flags.workdir.value}: {e}")
  return cfg, workdir


def parse_train_args(argv: Sequence[str]) -> tuple[RunConfig, str]:
  """`launch.train`'s command line `argv` (the program first) -> `train_inputs`.

  Parsed on a fresh `FlagValues`, so a launcher with flags of its own can check its workers'
  arguments exactly as they will.
  """
  argv = packaged_configs(list(argv))
  flag_values = flags.FlagValues()
  train_flags = define_train_flags(flag_values, sys_argv=argv)
  _define_absl_flags(flag_values)
  return train_inputs(parse_flags(flag_values, argv), train_flags)


def _define_absl_flags(flag_values: flags.FlagValues) -> None:
  """Defines on `flag_values` the flags `absl.app` and `absl.logging` give every launcher
  (`--log_dir`, `-v`, ...), except help, so they are checked as the launcher will check them.

  Copies with the same parsers but plain `Flag`s: absl's verbosity and logger-level flags
  change this process's logging when set, and checking a worker's flags must not.
  """
  for module in ("absl.app", "absl.logging"):
    for flag in flags.FLAGS.get_flags_for_module(module):
      if flag.name in flag_values or _HELP_RE.match(f"--{flag.name}"):
        continue
      flags.DEFINE_flag(flags.Flag(
        flag.parser, flag.serializer, flag.name, None, flag.help, flag.short_name,
        boolean=isinstance(flag, flags.BooleanFlag),
      ), flag_values=flag_values, module_name=module)


# ---------------------------------------------------------------- config and directories


def load_config(holder: flags.FlagHolder, convert: Callable[[Any], T], example: str) -> T:
  """`convert(config)` of a parsed config flag: its value, or one line and exit 2.

  Args:
    holder: the flag of `config_flags.DEFINE_config_file`.
    convert: validates the ConfigDict into typed config; its errors name the key.
    example: a config file for the message when the flag is missing.
  """
  if holder.value is None:
    fail(f"--{holder.name} is required (e.g. --{holder.name}={example})")
  try:
    return convert(holder.value)
  except CONVERT_ERRORS as e:
    if isinstance(e, OSError):
      # config_flags defers a file's read error until the config is first used: here.
      fail(f"--{holder.name}: cannot read the config file ({last_line(e)})")
    fail(last_line(e))


def writable_dir(flag: str, path: str | None) -> str:
  """Creates directory `path` if needed and checks that files can be written in it.

  Args:
    flag: the flag it came from, for the message (`--workdir`).
    path: the directory.

  Returns:
    Its absolute path; a missing, blocked or read-only directory is one line and exit 2.
  """
  if not path:
    fail(f"{flag} is required")
  where = f"{flag}={path}"
  full = os.path.abspath(path)
  if os.path.exists(full) and not os.path.isdir(full):
    fail(f"{where}: is a file, not a directory")
  try:
    os.makedirs(full, exist_ok=True)
  except OSError as e:
    blocker = _first_non_directory(full)
    if blocker:
      fail(f"{where}: {blocker} is a file, not a directory")
    fail(f"{where}: cannot create it ({e.strerror or e})")
  probe = None
  try:
    # A probe file rather than os.access: root, ACLs and read-only mounts all answer here. It
    # gets a block of bytes, synced: a full disk (or quota) still lets an empty file be made.
    # The name is random, so processes of one job can probe a shared directory at once.
    fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=full)
    with os.fdopen(fd, "wb") as f:
      f.write(bytes(_PROBE_BYTES))
      f.flush()
      os.fsync(f.fileno())
  except OSError as e:
    fail(f"{where}: cannot write there ({e.strerror or e})")
  finally:
    if probe is not None and os.path.exists(probe):
      os.unlink(probe)
  return full


_PROBE_BYTES = 4096
"""What `writable_dir` writes to probe a directory: one block of a usual filesystem."""


def _first_non_directory(path: str) -> str | None:
  """The first existing ancestor of `path` (or itself) that is not a directory."""
  parts = os.path.abspath(path).split(os.sep)
  for i in range(2, len(parts) + 1):
    prefix = os.sep.join(parts[:i])
    if os.path.exists(prefix) and not os.path.isdir(prefix):
      return prefix
    if not os.path.exists(prefix):
      return None
  return None


# ---------------------------------------------------------------- describing parse errors


def describe(e: BaseException, flag_values: flags.FlagValues, argv: Sequence[str]) -> str:
  """One line for an error raised while `flag_values` parsed `argv`.

  Args:
    e: the error.
    flag_values: the flags being parsed (their config flags and types name the problem).
    argv: the command line.

  Returns:
    The message, naming the flag, config key or file.
  """
  if isinstance(e, flags.UnrecognizedFlagError):
    close = _closest(e.flagname, flag_values)
    return f"unknown flag --{e.flagname}" + (f" (did you mean --{close}?)" if close else "")
  root = _root_cause(e)
  for name in _config_flag_names(flag_values):
    spec = _flag_arg(argv, name)
    if not spec:
      continue
    in_file = _config_file_error(root, name, spec)
    if in_file:
      return in_file
    bad = _bad_override(argv, name, spec)
    if bad:
      return bad
  message = last_line(e)
  m = re.match(r"flag --([^=\s]+)=(.*?): (.*)$", message)
  if m:
    flag, value, reason = m.groups()
    kind = flag_values[flag].flag_type() if flag in flag_values else ""
    return f"--{flag}={value}: " + (f"not {_KINDS[kind]}" if kind in _KINDS else reason)
  m = re.match(r"Missing value for flag -*(\S+)", message)
  if m:
    return f"--{m.group(1)}: missing value (write --{m.group(1)}=VALUE)"
  return message


def _config_flag_names(flag_values: flags.FlagValues) -> list[str]:
  return [n for n in flag_values if is_config_flag(flag_values[n])]


def _flag_arg(argv: Sequence[str], name: str) -> str | None:
  """The value given to `--name` in `argv` (the last one), "" if it has none, None if absent."""
  found = None
  for i, arg in enumerate(argv):
    if arg == "--":
      break
    m = re.match(rf"^--?{re.escape(name)}(=(.*))?$", arg)
    if m:
      if m.group(1) is not None:
        found = m.group(2)
      else:
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        found = "" if nxt.startswith("-") else nxt
  return found


def _config_path_problem(flag_values: flags.FlagValues, argv: Sequence[str]) -> str | None:
  """What is wrong with the file a config flag names, before config_flags tries to load it."""
  for name in _config_flag_names(flag_values):
    spec = _flag_arg(argv, name)
    if spec is None:
      if any(re.match(rf"^--?(no)?{re.escape(name)}\.", a) for a in argv):
        return f"--{name}.KEY overrides need --{name}=FILE"
      continue
    path = spec.split(":", 1)[0]
    if not path:
      return f"--{name}: missing value (write --{name}=FILE.py, or FILE.py:VARIANT)"
    if not os.path.exists(path):
      return f"--{name}={spec}: no such file"
    if os.path.isdir(path):
      return f"--{name}={spec}: is a directory, not a config file"
  return None


def _root_cause(e: BaseException) -> BaseException:
  """The innermost exception of `e`'s chain (flags re-raise config errors, wrapped)."""
  seen = {id(e)}
  while True:
    inner = e.__cause__ or e.__context__
    if inner is None or id(inner) in seen:
      return e
    seen.add(id(inner))
    e = inner


def _config_file_error(root: BaseException, name: str, spec: str) -> str | None:
  """The message for an error in the config file itself (its syntax, or `get_config`)."""
  path = os.path.abspath(spec.split(":", 1)[0])
  if isinstance(root, SyntaxError):
    where = "" if root.filename and os.path.abspath(root.filename) == path else \
      f"{root.filename} "
    return f"--{name}={spec}: {where}line {root.lineno}: {root.msg}"
  frames = traceback.extract_tb(root.__traceback__)
  lines = [f.lineno for f in frames if os.path.abspath(f.filename) == path]
  if not lines:
    return None
  if isinstance(root, KeyError) and root.args:
    message = f"no key {root.args[0]}"
  else:
    message = last_line(root) if str(root).strip() else "get_config failed"
  return f"--{name}={spec}: line {lines[-1]}: {message}"


def _bad_override(argv: Sequence[str], name: str, spec: str) -> str | None:
  """The first `--name.KEY[=VALUE]` of `argv` that the config `spec` cannot take, described."""
  try:
    cd = ConfigFileFlagParser(name, lock_config=False).parse(spec)
  except Exception:  # noqa: BLE001 - described by the caller as it is
    return None
  if not _is_section(cd):
    return None
  for arg in argv:
    if arg == "--":
      break
    m = re.match(rf"^--?(?:no)?{re.escape(name)}\.([^=]+)(=.*)?$", arg)
    problem = m and _key_problem(cd, name, m.group(1), has_value=m.group(2) is not None)
    if problem:
      return f"--{name}.{m.group(1)}: {problem}"
  return None


def _key_problem(cd: Any, name: str, key: str, *, has_value: bool) -> str | None:
  """Why config `cd` cannot take an override of dotted `key` (None if it can)."""
  node, parts = cd, key.split(".")
  for i, part in enumerate(parts):
    above = ".".join(parts[:i])
    if not _is_section(node):
      return f"no such key ({above} is a value, not a section)"
    if part not in node:
      close = _closest(part, node)
      if close:
        return f"no such key (did you mean {'.'.join([*parts[:i], close, *parts[i + 1:]])}?)"
      return f"no such key ({above or name} has no {'key' if above else 'section'} {part})"
    node = node[part]
  if _is_section(node) and has_value:
    keys = ", ".join(f"{key}.{k}" for k in list(node)[:4]) + (", ..." if len(node) > 4 else "")
    return f"{key} is a section, not a value" + (f" (its keys: {keys})" if keys else "")
  return None


def _is_section(x: Any) -> bool:
  return isinstance(x, (Mapping, ml_collections.ConfigDict))


def _closest(word: str, choices: Any) -> str | None:
  """The choice closest to a mistyped `word`, if one is close."""
  close = difflib.get_close_matches(word, [str(c) for c in choices], n=1)
  return close[0] if close else None


def last_line(e: BaseException) -> str:
  """The most specific line of an error message (config loaders nest their causes)."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return lines[-1] if lines else "failed"


def _strip_errno(message: str) -> str:
  return re.sub(r"\[Errno \d+\]\s*", "", message)


def _one_line(message: str) -> str:
  """`message` as one line without Python's exception class names or escaped quotes."""
  message = " ".join(line.strip() for line in str(message).splitlines() if line.strip())
  message = re.sub(r"\b[A-Z]\w*(?:Error|Exception|Warning):\s*", "", message)
  return _strip_errno(message).replace("\\'", "'").replace('\\"', '"')
