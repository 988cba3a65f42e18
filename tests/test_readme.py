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
    from resilient_jax.spec.placement import process_slots

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
  elif module == "launch.checkpoint":
    from launch.checkpoint import USAGE

    assert args[0] in USAGE.split("{")[1].split("}")[0].split(",") and len(args) == 2
  else:
    pytest.fail(f"no check for the README's {module} command")



def readme_config_keys() -> dict[str, set[str]]:
  """The config keys the README's key tables document, each with the model families that have
  it: the first column's keys (`distributed.coordinator`, `num_processes`: a bare name is in the
  section of the cell's first key), and the family keys `model.name`'s row lists."""
  import re

  with open(f"{ROOT}/README.md") as f:
    lines = f.read().splitlines()
  families = {"gpt", "llama"}
  keys: dict[str, set[str]] = {}
  in_table = False
  for line in lines:
    if line.startswith("| key | meaning |"):
      in_table = True
      continue
    if not line.startswith("|"):
      in_table = False
    if not in_table or line.startswith("| ---"):
      continue
    first, meaning = line.split("|")[1:3]
    section = None
    for name in re.findall(r"`([^`]+)`", first):
      section = name.split(".")[0] if "." in name else section
      keys[name if "." in name else f"{section}.{name}"] = families
    if "the other `model.*` keys are the family's (" in meaning:
      listed = meaning.split("the family's (", 1)[1].split(")", 1)[0]
      common, _, llama = listed.partition("llama adds")
      keys.update({f"model.{n}": families for n in re.findall(r"`([^`]+)`", common)})
      keys.update({f"model.{n}": {"llama"} for n in re.findall(r"`([^`]+)`", llama)})
  return keys


@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")  # config_flags' loader
@pytest.mark.parametrize("config,family", [("configs/gpt_tiny.py", "gpt"),
                                           ("configs/llama_tiny.py", "llama")])
def test_every_documented_key_can_be_set_with_every_config(tmp_path, config, family):
  """Each key of the README's tables, set on the command line to its value in the shipped config
  (`--config.KEY=VALUE`), parses and validates as `launch.train` does."""
  import runpy

  from launch import cli

  keys = readme_config_keys()
  assert len(keys) > 50 and "train.accumulate_steps" in keys and "model.norm_eps" in keys
  cd = runpy.run_path(f"{ROOT}/{config}")["get_config"]()
  missing = []
  for key, fams in sorted(keys.items()):
    if family not in fams:
      continue
    section, name = key.split(".")
    if section not in cd or name not in cd[section]:
      missing.append(key)
      continue
    value = cd[section][name]
    text = str(value).lower() if isinstance(value, bool) else str(value)
    cli.parse_train_args(["launch.train", f"--config={config}", f"--config.{key}={text}",
                          f"--workdir={tmp_path / 'run'}"])
  assert not missing, f"{config} lacks the README's keys {missing}"
