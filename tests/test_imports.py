"""The library's import graph, read with ast: no cycles, nothing imports the CLI, no configs/."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "ao_mdm"


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


def test_no_import_cycles_and_no_library_module_imports_the_cli():
  graph = import_graph()
  assert "ao_mdm.train.loop" in graph and "ao_mdm.train.checkpoints" in graph["ao_mdm.train.loop"]
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))
  assert [m for m, deps in graph.items() if "ao_mdm.cli.main" in deps] == []
  for path in PACKAGE.rglob("*.py"):  # the library never executes the repository's configs/
    if path.name == "checks.py":  # loads the user's --config file again to explain its errors
      continue
    text = path.read_text()
    assert "spec_from_file_location" not in text and '"configs"' not in text, path


def test_the_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
  assert _cycle({"a": {"b"}, "b": set()}) is None
