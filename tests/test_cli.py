"""The launchers as absl programs: help, one-line flag errors, where log lines go, console scripts.

Every case but one is a Python process that parses flags and exits (about 0.2 s); the `--log_dir`
case is one tiny training run. Bad flags, configs and overrides in detail: test_bad_inputs.py.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
import sys
import tomllib

import pytest

from tests.helpers import ROOT

# Each launcher, and flags its --help must list (its own, not absl's).
LAUNCHERS = {
  "launch.train": ["--config", "--workdir"],
  "launch.local": ["--num_processes", "--kill", "--stop", "--term", "--timeout"],
  "launch.simulate": ["--config", "--out"],
  "launch.checkpoint": [],
}
SCRIPTS = {
  "resilient-jax-train": "launch.train",
  "resilient-jax-local": "launch.local",
  "resilient-jax-simulate": "launch.simulate",
  "resilient-jax-checkpoint": "launch.checkpoint",
}


def _docstring(module: str) -> str:
  """A launcher's docstring, read without importing it (that would define its flags here)."""
  path = os.path.join(ROOT, *module.split("."))
  path = os.path.join(path, "__main__.py") if os.path.isdir(path) else path + ".py"
  return ast.get_docstring(ast.parse(open(path).read()), clean=False)


def _python(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


def _as_script(name: str, *args: str) -> subprocess.CompletedProcess:
  """Runs console script `name` as pip's wrapper does: `__main__` is not the launcher."""
  target = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["scripts"]
  module, func = target[name].split(":")
  return _python("-c", f"import sys; sys.argv[0] = {name!r}; from {module} import {func}; "
                 f"sys.exit({func}())", *args)


@pytest.mark.parametrize("launcher, flag", [*((x, "--help") for x in LAUNCHERS),
                                            ("launch.train", "--helpshort")])
def test_help_exits_0_listing_the_launchers_flags(launcher, flag):
  proc = _python("-m", launcher, flag)
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr == ""
  assert "Try --helpfull" in proc.stdout
  for name in LAUNCHERS[launcher]:
    assert f"  {name}:" in proc.stdout, name
  assert "  --log_dir:" not in proc.stdout  # absl's flags are in --helpfull


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_scripts_are_the_launchers_with_full_help(script):
  """Each console script runs its launcher's absl entry point: --helpfull lists every flag,
  and --help the launcher's own under the script's name."""
  full = _as_script(script, "--helpfull")
  assert full.returncode == 0, full.stderr
  for name in [*LAUNCHERS[SCRIPTS[script]], "--log_dir", "--alsologtostderr", "--verbosity"]:
    # `  --name:`, `  --[no]name:` (a boolean) or `  -v,--name:` (with a short name)
    assert re.search(rf"^  (-\w,)?--(\[no\])?{name[2:]}:", full.stdout, re.M), name
  short = _as_script(script, "--help")
  assert short.returncode == 0, short.stderr
  assert short.stdout.startswith(_docstring(SCRIPTS[script]).splitlines()[0])
  for name in LAUNCHERS[SCRIPTS[script]]:
    assert f"  {name}:" in short.stdout, name


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_bad_flag_is_one_line_and_exit_2(launcher):
  proc = _python("-m", launcher, "--verbosityy=1")
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip() == "error: unknown flag --verbosityy (did you mean --verbosity?)"


def test_a_bad_logging_flag_is_one_line_and_exit_2(tmp_path):
  (tmp_path / "file").write_text("")
  proc = _python("-m", "launch.train", f"--log_dir={tmp_path / 'file'}")
  assert proc.returncode == 2
  assert proc.stderr.strip() == f"error: --log_dir={tmp_path / 'file'}: is a file, not a directory"
  proc = _python("-m", "launch.simulate", "--verbosity=loud")
  assert proc.returncode == 2
  assert proc.stderr.strip() == "error: --verbosity=loud: not an integer"


# A launcher-shaped program that logs one INFO and one WARNING line through absl.
_LOGS_TWO = ("from absl import logging; from launch import cli; "
             "cli.run(lambda argv: logging.info('progress line') or logging.warning('warned'))")


@pytest.mark.parametrize("flags, stdout, stderr, file", [
  ([], ["progress line", "warned"], [], []),  # the console: stdout, stderr kept for errors
  (["--logtostderr"], [], ["progress line", "warned"], []),
  (["--alsologtostderr"], [], ["progress line", "warned"], []),
  (["--log_dir={d}"], [], [], ["progress line", "warned"]),
  (["--log_dir={d}", "--alsologtostderr"], [], ["progress line", "warned"],
   ["progress line", "warned"]),
  (["--log_dir={d}", "--stderrthreshold=warning"], [], ["warned"], ["progress line", "warned"]),
  (["-v", "-1"], ["warned"], [], []),
], ids=["default", "logtostderr", "alsologtostderr", "log_dir", "log_dir+also", "threshold",
        "quiet"])
def test_log_lines_go_where_absls_flags_say(tmp_path, flags, stdout, stderr, file):
  d = tmp_path / "logs"
  proc = _python("-c", _LOGS_TWO, *(f.format(d=d) for f in flags))
  assert proc.returncode == 0, proc.stderr
  for got, want in ((proc.stdout, stdout), (proc.stderr, stderr)):
    assert [m for m in ("progress line", "warned") if m in got] == want, (flags, got)
  files = sorted(d.glob("*.INFO.*")) if d.exists() else []
  text = files[0].read_text() if files else ""
  assert [m for m in ("progress line", "warned") if m in text] == file


def test_other_libraries_info_lines_are_held_back_but_not_their_warnings():
  import jax

  from resilient_jax.observe.logs import LibraryInfoFilter

  keep = LibraryInfoFilter()
  inside = os.path.join(os.path.dirname(jax.__file__), "_src", "xla_bridge.py")

  def record(level, path):
    return logging.LogRecord("absl", level, path, 1, "m", None, None)

  assert not keep.filter(record(logging.INFO, inside))
  assert keep.filter(record(logging.WARNING, inside))
  ours = os.path.join(ROOT, "resilient_jax", "training", "loop.py")
  assert keep.filter(record(logging.INFO, ours))
  from absl import logging as absl_logging

  before = absl_logging.get_verbosity()
  absl_logging.set_verbosity(1)  # debug verbosity: theirs too
  try:
    assert keep.filter(record(logging.INFO, inside))
  finally:
    absl_logging.set_verbosity(before)


# The --log_dir run: tests/test_launcher.py (one launcher run with every optional output).


@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # config_flags loader
def test_shipped_configs_load_from_any_directory(tmp_path, monkeypatch):
  """`--config=configs/gpt_tiny.py` outside the checkout is the config the package ships; a
  file of that name in the working directory comes first."""
  from launch import cli

  monkeypatch.chdir(tmp_path)
  args = ["launch.train", "--config=configs/gpt_tiny.py:runlocal", "--config.mesh.dp=1",
          f"--workdir={tmp_path / 'run'}"]
  cfg, _ = cli.parse_train_args(args)
  assert cfg.model.d_model == 32 and cfg.mesh.dp == 1
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "gpt_tiny.py").write_text(
    "from configs.gpt_tiny import get_config as shipped\n\n\n"
    "def get_config(arg=None):\n  c = shipped(arg)\n  c.model.d_model = 48\n  return c\n")
  cfg, _ = cli.parse_train_args(args)
  assert cfg.model.d_model == 48
