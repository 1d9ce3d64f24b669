"""The library's import graph, read with ast: packages ranked bottom to top, each importing only
from its own rank or below; no module cycles; no configs/."""

import ast
import pathlib

from helpers import ROOT

PACKAGE = ROOT / "ao_mdm"


def _module(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
  """module -> the ao_mdm modules it imports (at any depth of the file)."""
  modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
  graph = {}
  for name, path in modules.items():
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module:
        deps |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    graph[name] = {d for d in deps if d in modules and d != name}
  return graph


def _cycle(graph: dict):
  state = {}

  def visit(node, stack):
    state[node] = "open"
    for dep in sorted(graph[node]):
      if state.get(dep) == "open":
        return stack + [node, dep]
      if dep not in state and (found := visit(dep, stack + [node])):
        return found
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node, [])):
      return found
  return None


# Bottom to top (docs/architecture.md draws it): a package imports only packages below it and
# its own modules; "core" is the modules at the top of ao_mdm/.
RANKS = (
  "runtime",
  "storage",
  "core",
  "data",
  "checkpoint",
  "decode",
  "eval",
  "train",
  "interop",
  "serve",
  "perf",
  "cli",
)


def package(module: str) -> str:
  """The ranked package of an ao_mdm module: its folder under ao_mdm/, or core."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else "core"


def upward_imports(graph: dict) -> list:
  """`a -> b` for every import of a module from a package ranked above the importer's."""
  rank = {name: i for i, name in enumerate(RANKS)}
  return sorted(
    f"{m} -> {d}" for m, deps in graph.items() for d in deps if rank[package(d)] > rank[package(m)]
  )


def test_packages_import_only_downwards_and_no_module_cycles():
  graph = import_graph()
  assert (
    "ao_mdm.train.loop" in graph and "ao_mdm.checkpoint.checkpoints" in graph["ao_mdm.train.loop"]
  )
  folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
  assert folders | {"core"} == set(RANKS), "give every package of ao_mdm/ a rank"
  assert upward_imports(graph) == []
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_rank_rule_finds_an_upward_import():
  graph = import_graph()
  planted = {**graph, "ao_mdm.storage.fs": graph["ao_mdm.storage.fs"] | {"ao_mdm.train.loop"}}
  assert upward_imports(planted) == ["ao_mdm.storage.fs -> ao_mdm.train.loop"]
  assert upward_imports({"ao_mdm.train.loop": {"ao_mdm.model", "ao_mdm.storage.fs"}}) == []


def test_the_library_never_executes_the_repositorys_configs():
  for path in PACKAGE.rglob("*.py"):  # the library never executes the repository's configs/
    if path.name == "checks.py":  # loads the user's --config file again to explain its errors
      continue
    text = path.read_text()
    assert "spec_from_file_location" not in text and '"configs"' not in text, path


def test_the_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
  assert _cycle({"a": {"b"}, "b": set()}) is None
