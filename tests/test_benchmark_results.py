"""Benchmark results are files the benchmarks write, and docs/benchmark_results.md's table is made
from them: a figure cannot be edited into the docs without its command, machine and commit."""

from __future__ import annotations

import json

from benchmarks import results


def test_record_keeps_the_figures_command_machine_and_commit(tmp_path):
  path = results.record("demo", {"ratio": 0.864, "bytes": 95}, "python benchmarks/demo.py",
                        directory=str(tmp_path))
  saved = json.loads(open(path).read())
  assert saved["figures"] == {"ratio": 0.864, "bytes": 95}
  assert list(saved["figures"]) == ["ratio", "bytes"]  # the order the script printed them in
  assert saved["command"] == "python benchmarks/demo.py" and saved["name"] == "demo"
  machine = saved["machine"]
  assert machine["cpu"] and machine["cores"] >= 1
  assert len(machine["load_start"]) == 3 and len(machine["load_end"]) == 3
  assert saved["commit"] and saved["date"].endswith("UTC")
  text = results.table(results.load(str(tmp_path)))
  assert "### demo" in text and "| `ratio` | 0.864 |" in text
  assert "`python benchmarks/demo.py`" in text


def test_the_docs_table_is_the_recorded_files():
  """Regenerate with `python -m benchmarks.results --write` after running a benchmark."""
  assert results.load(), "no benchmarks/results/*.json"
  assert results.generated_block() == results.table(results.load())
