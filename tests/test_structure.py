"""The house's shape, checked from the code's own imports (`ast`): what a reader relies on when
they open one module without the others."""

from __future__ import annotations

import ast
import os

from tests.helpers import ROOT

PACKAGES = ("resilient_jax", "models")


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _modules() -> dict[str, str]:
  """Every module of `PACKAGES`: its dotted name -> its file."""
  out = {}
  for top in PACKAGES:
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(folder, f)
          out[_module_name(path)] = path
  return out


def _imports(path: str, name: str, known: set[str]) -> set[str]:
  """The modules `name` imports: at module level, under `TYPE_CHECKING` and inside functions
  alike (`from a import b` counts as `a.b` where that is a module, else `a`)."""
  package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
      for a in node.names:
        out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
  return {m for m in out if m in known or m.split(".")[0] in ("launch", "models", "configs")}


def import_graph() -> dict[str, set[str]]:
  mods = _modules()
  known = set(mods)
  return {n: _imports(p, n, known) - {n} for n, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in graph:
        continue
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycles():
  assert _cycles(import_graph()) == []


def test_the_library_imports_neither_launchers_nor_example_models():
  graph = import_graph()
  wrong = {n: sorted(m for m in deps if m.split(".")[0] in ("launch", "models", "configs"))
           for n, deps in graph.items() if n.startswith("resilient_jax")}
  assert {n: d for n, d in wrong.items() if d} == {}


def test_every_package_folder_is_installed_under_the_library_s_name():
  """`pyproject.toml` lists the packages (the checkout's `launch/`, `configs/` and `models/`
  mapped under `resilient_jax`, so site-packages gains no generic top-level name): a package
  folder missing from the list would be missing from every install."""
  import tomllib

  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    setup = tomllib.load(f)["tool"]["setuptools"]
  mapped = setup["package-dir"]

  def folder(package: str) -> str:
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
      if ".".join(parts[:n]) in mapped:
        return os.path.join(mapped[".".join(parts[:n])], *parts[n:])
    return os.path.join(*parts)

  assert all(p.split(".")[0] == "resilient_jax" for p in setup["packages"])
  found = {os.path.relpath(d, ROOT) for top in ("resilient_jax", "launch", "configs", "models")
           for d, _, files in os.walk(os.path.join(ROOT, top)) if "__init__.py" in files}
  assert sorted(folder(p) for p in setup["packages"]) == sorted(found)


# The packages from the bottom up (issue 51): a module imports only its own package and those
# below it. Leaves with no library import at the bottom; what a run is asked (`spec`, `config`);
# plans as data (`schedule`); records and their renderings (`observe`); the user's model and the
# universal checkpoints; the policies (shared with the simulator, which sits right above them and
# never reaches the runtime); the stage programs; the runtime that runs them; and the training
# loop that steers the runtime with the policies. `launch/` is above all of them.
LAYERS = (
  ("checks", "exit_codes", "files", "data"),
  ("spec",),
  ("config",),
  ("schedule",),
  ("observe",),
  ("model",),
  ("checkpoint",),
  ("policy",),
  ("sim",),
  ("programs",),
  ("runtime",),
  ("recipe",),
  ("reference",),
  ("training",),
)


def _package(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if parts[0] == "resilient_jax" and len(parts) > 1 else None


def test_every_package_has_its_layer():
  found = {_package(n) for n in _modules()} - {None}
  assert found == {p for layer in LAYERS for p in layer}


def test_no_arrow_runs_back_up():
  """A package imports only from its own layer's packages and the layers below: no arrow back
  up, so no cycle between packages either."""
  rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
  up = sorted(f"{n} -> {d}" for n, deps in import_graph().items() if _package(n) for d in deps
              if _package(d) and _package(d) != _package(n)
              and rank[_package(d)] > rank[_package(n)])
  assert up == []


def test_the_leaves_import_nothing_of_the_library():
  graph = import_graph()
  for leaf in LAYERS[0]:
    assert {m for m in graph[f"resilient_jax.{leaf}"] if m.startswith("resilient_jax")} \
        <= {f"resilient_jax.{p}" for p in LAYERS[0]}, leaf


def test_exit_codes_and_records_are_leaves():
  graph = import_graph()
  assert graph["resilient_jax.exit_codes"] == set()
  assert {m for m in graph["resilient_jax.observe.records"]
          if not m.startswith("resilient_jax.schedule")} == set()


def test_the_top_level_holds_at_most_eight_modules():
  top = [f for f in os.listdir(os.path.join(ROOT, "resilient_jax")) if f.endswith(".py")]
  assert len(top) <= 8, sorted(top)


def test_no_module_of_the_library_passes_600_lines():
  long = {n: open(p).read().count("\n") for n, p in _modules().items()
          if n.startswith("resilient_jax")}
  assert {n: c for n, c in long.items() if c > 600} == {}


def test_the_loop_reads_on_one_screenful_of_files():
  """The loop file stays short and names no kind of run: one process or a job is the group's
  business (`training/group.py`)."""
  src = open(os.path.join(ROOT, "resilient_jax", "training", "loop.py")).read()
  assert src.count("\n") < 300
  assert "cluster is None" not in src and "cluster is not None" not in src


def test_no_function_of_the_library_passes_100_lines():
  """Issue 31: a function a reader can hold in mind at once (hot loops included: a loop is
  hoisted whole into its own function, not cut)."""
  long = {}
  for name, path in _modules().items():
    if not name.startswith("resilient_jax"):
      continue
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > 100:
          long[f"{name}:{node.name} (line {node.lineno})"] = lines
  assert not long, f"functions over 100 lines: {long}"


def test_the_public_surface_is_what_users_call():
  """At most 20 names, each importable (the runtime's parts stay in their modules)."""
  import resilient_jax

  assert len(resilient_jax.__all__) <= 20
  assert all(getattr(resilient_jax, n) is not None for n in resilient_jax.__all__)
  assert not {"Interpreter", "StagePrograms", "Op", "RunCoordinator"} & set(resilient_jax.__all__)
