"""The README's commands, as written: the main job runs, and every launcher command parses.

A newcomer copies these lines. Renaming a flag or a config key, or moving a config file, must
fail here rather than on their machine. The main job runs in full (it is the first command
anyone runs); the others are long (multi-process jobs, cluster-scale simulations), so their
flags, config files and overrides are loaded and validated exactly as their launchers do before
starting any work.
"""

from __future__ import annotations

import json
import shlex

import pytest

from tests.helpers import ROOT, run_launcher


def readme_commands() -> list[list[str]]:
  """Every shell command in the README's fenced blocks, split into words (`\\` lines joined,
  comments dropped, an install step before `&&` dropped)."""
  with open(f"{ROOT}/README.md") as f:
    text = f.read()
  blocks, lang, lines = [], None, []
  for line in text.splitlines():
    if line.startswith("```"):
      if lang is None:
        lang, lines = line[3:].strip(), []
      else:
        if lang in ("", "sh", "bash", "shell"):
          blocks.append("\n".join(lines))
        lang = None
    elif lang is not None:
      lines.append(line)
  commands = []
  for block in blocks:
    for line in block.replace("\\\n", " ").splitlines():
      if "python -m " not in line:  # a file tree, output, or a YAML snippet
        continue
      words = shlex.split(line, comments=True)
      if "&&" in words:  # `pip install -e . && python -m ...`: the install is the user's
        words = words[words.index("&&") + 1:]
      if words[:2] == ["python", "-m"]:
        commands.append(words)
  return commands


def _module(words: list[str]) -> str:
  return words[2]


def _with_workdir(words: list[str], workdir: str) -> list[str]:
  return [f"--workdir={workdir}" if w.startswith("--workdir=") else w for w in words]


def test_the_readme_names_each_launcher():
  found = {_module(c) for c in readme_commands()}
  assert {"launch.train", "launch.local", "launch.simulate", "pytest"} <= found, found


def test_the_main_job_runs_as_written(tmp_path):
  main = next(c for c in readme_commands() if _module(c) == "launch.train")
  proc = run_launcher(*_with_workdir(main, str(tmp_path))[3:])
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout + proc.stderr
  rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, 21))
  assert [r["live_workers"] for r in rows[::5]] == [8, 7, 6, 6]  # failures at steps 5 and 10
  assert out.count("FAILURE") == 2 and "done: 20 steps" in out
  assert str(tmp_path / "metrics.jsonl") in out  # it says where its outputs went


@pytest.mark.parametrize("index", range(len([c for c in readme_commands()
                                              if _module(c).startswith("launch.")])))
def test_launcher_commands_parse(tmp_path, index):
  """Each launcher command's flags, config file and overrides load and validate."""
  from launch import cli

  words = [c for c in readme_commands() if _module(c).startswith("launch.")][index]
  words = _with_workdir(words, str(tmp_path / "run"))
  module, args = _module(words), words[3:]
  if module == "launch.train":
    cfg, _ = cli.parse_train_args(["launch.train", *args])
    assert cfg.train.steps > 0
  elif module == "launch.local":
    ours, train_args = args[:args.index("--")], args[args.index("--") + 1:]
    cfg, _ = cli.parse_train_args(["launch.train", *train_args])
    from resilient_jax.placement import process_slots

    num = int(next(a.split("=", 1)[1] for a in ours if a.startswith("--num_processes=")))
    devices = int(next((a.split("=", 1)[1] for a in ours
                        if a.startswith("--devices_per_process=")), 1))
    # The grid fills processes x devices exactly (raises otherwise).
    process_slots(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.placement, num, devices)
  elif module == "launch.simulate":
    import runpy

    from resilient_jax.sim import from_config_dict

    path = next(a.split("=", 1)[1] for a in args if a.startswith("--config="))
    assert not [a for a in args if a.startswith("--config.")], "parse the overrides too"
    sim = from_config_dict(runpy.run_path(f"{ROOT}/{path}")["get_config"]())
    assert sim.layout.devices > 0
  else:
    pytest.fail(f"no check for the README's {module} command")

