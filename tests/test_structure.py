"""Code structure rules: no module, test or script reaches into a private (underscore) name of
another of our modules (ao_mdm's, or a test module's)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _sources():
  for folder in ("ao_mdm", "tests", "scripts"):
    yield from sorted((ROOT / folder).rglob("*.py"))


def _private_uses(path: pathlib.Path) -> list:
  """`module._name` and `from module import _name` in one file (dunder names allowed)."""
  tree = ast.parse(path.read_text(), str(path))
  modules, found = set(), []
  private = lambda name: name.startswith("_") and not name.startswith("__")
  ours = lambda module: module.split(".")[0] == "ao_mdm" or module.startswith("test")
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules |= {a.asname or a.name for a in node.names if ours(a.name)}
    elif isinstance(node, ast.ImportFrom) and ours(node.module or ""):
      for a in node.names:
        if private(a.name):
          found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}")
        modules.add(a.asname or a.name)
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and private(node.attr)
        and isinstance(node.value, ast.Name) and node.value.id in modules):
      found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
  return found


def test_no_module_uses_another_modules_private_names():
  found = [use for path in _sources() for use in _private_uses(path)]
  assert not found, "\n".join(found)


def test_the_rule_catches_both_forms(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("from ao_mdm import sampling\nfrom ao_mdm.model import _helper\n"
                 "sampling._decoder()\nlocal = object()\nlocal._fine = 1\n")
  global ROOT  # pylint: disable=global-statement
  root, ROOT = ROOT, tmp_path
  try:
    found = _private_uses(bad)
  finally:
    ROOT = root
  assert found == ["bad.py:2 imports _helper", "bad.py:3 uses sampling._decoder"]
