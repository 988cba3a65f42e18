"""The commands of the README and of docs/*.md, as written: the main job runs, and every other
command parses.

A newcomer copies these lines. Renaming a flag or a config key, or moving a config file, must
fail here rather than on their machine. The main job runs in full (it is the README's first
command, the first anyone runs); the others are long (multi-process jobs, cluster-scale
simulations, benchmarks), so their flags, config files and overrides are loaded and validated
exactly as their launchers do before starting any work, and a benchmark command's script and
flags must exist.
"""

from __future__ import annotations

import json
import os
import shlex

import pytest

from tests.helpers import ROOT, events_jsonl, run_launcher

DOCS = ["README.md", *sorted(f"docs/{f}" for f in os.listdir(f"{ROOT}/docs") if f.endswith(".md"))]
"""The files whose commands are checked: the README first, then every guide in docs/."""


def readme_commands(files: list[str] | None = None) -> list[list[str]]:
  """Every `python ...` command in the fenced shell blocks of `files` (default `DOCS`), split
  into words (`\\` lines joined, comments dropped, an install step before `&&` dropped)."""
  blocks = []
  for name in files or DOCS:
    with open(f"{ROOT}/{name}") as f:
      text = f.read()
    lang, lines = None, []
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
      if not line.lstrip().startswith(("python ", "pip ")):  # a file tree, output, YAML
        continue
      words = shlex.split(line, comments=True)
      if "&&" in words:  # `pip install -e . && python -m ...`: the install is the user's
        words = words[words.index("&&") + 1:]
      if words[:1] == ["python"] and len(words) > 1:
        commands.append(words)
  return commands


def _module(words: list[str]) -> str:
  """What a command runs: `launch.train`, `pytest`, or a script such as `benchmarks/x.py`."""
  return words[2] if words[1] == "-m" else words[1]


def _with_workdir(words: list[str], workdir: str) -> list[str]:
  return [f"--workdir={workdir}" if w.startswith("--workdir=") else w for w in words]


def test_the_readme_names_each_launcher():
  found = {_module(c) for c in readme_commands(["README.md"])}
  assert {"launch.train", "launch.local", "launch.simulate", "pytest"} <= found, found
  found = {_module(c) for c in readme_commands()}
  assert "launch.checkpoint" in found and "benchmarks.results" in found, found


def test_every_command_is_one_this_file_checks():
  """A command of another kind would go unchecked: name its check here first."""
  kinds = {_module(c) for c in readme_commands()}
  known = {m for m in kinds if m.startswith(("launch.", "benchmarks/"))}
  assert kinds - known <= {"pytest", "benchmarks.results"}, kinds - known


def test_the_main_job_runs_as_written(tmp_path):
  main = next(c for c in readme_commands(["README.md"]) if _module(c) == "launch.train")
  proc = run_launcher(*_with_workdir(main, str(tmp_path))[3:])
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout + proc.stderr
  rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, 21))
  assert [r["live_workers"] for r in rows[::5]] == [8, 7, 6, 6]  # failures at steps 5 and 10
  failures = events_jsonl(tmp_path, "failure")
  assert [(e["step"], e["worker"]) for e in failures] == [(5, [1, 1]), (10, [0, 3])]
  assert "done: 20 steps" in out
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
  elif module == "launch.cluster_box":
    from launch import cluster_box

    names = {f.name for f in (cluster_box._HOSTS, cluster_box._RATE, cluster_box._SLURM)}
    assert {a.lstrip("-").split("=")[0] for a in args} <= names, args
  else:
    pytest.fail(f"no check for the {module} command of README.md or docs/")


@pytest.mark.parametrize("index", range(len([c for c in readme_commands()
                                              if _module(c).startswith("benchmarks/")])))
def test_benchmark_commands_name_a_script_and_its_flags(index):
  """A benchmark command names a script that exists, and each `--flag` it passes is one the
  script defines (they run minutes: their arguments are checked, not run)."""
  words = [c for c in readme_commands() if _module(c).startswith("benchmarks/")][index]
  path = f"{ROOT}/{words[1]}"
  assert os.path.isfile(path), words
  with open(path) as f:
    source = f.read()
  ours = words[2:words.index("--")] if "--" in words else words[2:]
  for flag in (w.split("=", 1)[0] for w in ours if w.startswith("--")):
    assert f'"{flag}"' in source, f"{words[1]} defines no {flag}"


def test_the_results_table_command_runs():
  """`python -m benchmarks.results --table` (docs/benchmarks.md) renders every recorded file."""
  from benchmarks import results

  assert [c for c in readme_commands() if c[:3] == ["python", "-m", "benchmarks.results"]]
  text = results.table(results.load())
  assert all(f"### {r['name']}" in text for r in results.load())



def readme_config_keys() -> dict[str, set[str]]:
  """The config keys the key tables of the README and docs/ document, each with the model
  families that have it: the first column's keys (`distributed.coordinator`, `num_processes`: a
  bare name is in the section of the cell's first key), and the family keys `model.name`'s row
  lists."""
  import re

  lines = []
  for name in DOCS:
    with open(f"{ROOT}/{name}") as f:
      lines += f.read().splitlines() + [""]
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
  """Each key of the key tables (README, docs/), set on the command line to its value in the
  shipped config (`--config.KEY=VALUE`), parses and validates as `launch.train` does."""
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
  assert not missing, f"{config} lacks the documented keys {missing}"
