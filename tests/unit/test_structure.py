"""Code structure rules: no module, test or script reaches into a private (underscore) name of
another of our modules (ao_mdm's, or a test module's)."""

import ast
import pathlib

from helpers import ROOT


def _sources():
  for folder in ("ao_mdm", "tests", "scripts", "benchmarks"):
    yield from sorted((ROOT / folder).rglob("*.py"))


def _private_uses(path: pathlib.Path) -> list:
  """`module._name` and `from module import _name` in one file (dunder names allowed)."""
  tree = ast.parse(path.read_text(), str(path))
  modules, found = set(), []
  private = lambda name: name.startswith("_") and not name.startswith("__")
  ours = lambda module: module.split(".")[0] in ("ao_mdm", "helpers") or module.startswith("test")
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules |= {a.asname or a.name for a in node.names if ours(a.name)}
    elif isinstance(node, ast.ImportFrom) and ours(node.module or ""):
      for a in node.names:
        if private(a.name):
          found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}")
        modules.add(a.asname or a.name)
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and private(node.attr)
      and isinstance(node.value, ast.Name)
      and node.value.id in modules
    ):
      found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
  return found


def test_no_module_uses_another_modules_private_names():
  found = [use for path in _sources() for use in _private_uses(path)]
  assert not found, "\n".join(found)


def _rule_on(rule, tmp_path, text: str) -> list:
  """What `rule` finds in a file bad.py of `text` (paths relative to tmp_path)."""
  bad = tmp_path / "bad.py"
  bad.write_text(text)
  global ROOT
  root, ROOT = ROOT, tmp_path
  try:
    return rule(bad)
  finally:
    ROOT = root


def test_the_rule_catches_both_forms(tmp_path):
  found = _rule_on(
    _private_uses,
    tmp_path,
    "from ao_mdm import sampling\nfrom ao_mdm.model import _helper\n"
    "sampling._decoder()\nlocal = object()\nlocal._fine = 1\n",
  )
  assert found == ["bad.py:2 imports _helper", "bad.py:3 uses sampling._decoder"]


# File access on a path goes through ao_mdm/storage/ (local or gs://). These modules touch only
# files that are no user's path, each for the reason given.
FILE_ACCESS_ALLOWED = {
  "ao_mdm/specs.py": "the package's own paper_orders.json",
  "ao_mdm/data/gpt2.py": "the GPT-2 BPE files shipped in the package",
  "ao_mdm/runtime/quiet.py": "/dev/null, to silence stderr",
  "ao_mdm/cli/main.py": "/dev/null, after a closed pipe",
  "ao_mdm/cli/checks.py": "the --config file: Python code, loaded from local disk only",
  "ao_mdm/perf/bench_data.py": "its own local scratch directory (bench.dir) and /proc",
}
_OS_FILE_CALLS = {
  "open",
  "replace",
  "rename",
  "remove",
  "unlink",
  "listdir",
  "makedirs",
  "mkdir",
  "rmdir",
  "stat",
  "walk",
  "preadv",
  "pread",
  "scandir",
}


def _file_access(path: pathlib.Path) -> list:
  """open(...), os.path.*, file calls of os, shutil.* and glob.* in one file."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if not isinstance(node, ast.Call):
      continue
    f = node.func
    name = None
    if isinstance(f, ast.Name) and f.id == "open":
      name = "open"
    elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
      if (f.value.id == "os" and f.attr in _OS_FILE_CALLS) or f.value.id in ("shutil", "glob"):
        name = f"{f.value.id}.{f.attr}"
    elif (
      isinstance(f, ast.Attribute)
      and isinstance(f.value, ast.Attribute)
      and isinstance(f.value.value, ast.Name)
      and f.value.value.id == "os"
      and f.value.attr == "path"
      and f.attr not in ("join", "basename", "dirname")
    ):
      name = f"os.path.{f.attr}"
    if name:
      found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
  return found


def test_file_access_goes_through_the_storage_layer():
  package = ROOT / "ao_mdm"
  found = [
    use
    for path in sorted(package.rglob("*.py"))
    if "storage" not in path.relative_to(package).parts
    and path.relative_to(ROOT).as_posix() not in FILE_ACCESS_ALLOWED
    for use in _file_access(path)
  ]
  assert not found, "use ao_mdm.storage (fs, paths) for these:\n" + "\n".join(found)


def test_the_file_access_rule_catches_each_form(tmp_path):
  found = _rule_on(
    _file_access,
    tmp_path,
    "import os, shutil\nopen('x')\nos.path.isfile('x')\nos.replace('a', 'b')\n"
    "shutil.rmtree('d')\nos.path.join('a', 'b')\nos.environ.get('X')\n",
  )
  assert found == [
    "bad.py:2 open",
    "bad.py:3 os.path.isfile",
    "bad.py:4 os.replace",
    "bad.py:5 shutil.rmtree",
  ]
