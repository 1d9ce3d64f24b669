"""docs/architecture.md names every module, and the code points to the repository's own docs.

The design lives in docs/design.md; no file of the package or the tests refers to a design
brief outside the repository.
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ao_mdm"
OUTSIDE_BRIEF = "DESIGN" + ".md"  # built here so that this file does not contain it
_NAMED = re.compile(r"`(ao_mdm/[\w/]+\.py)`")


def _modules() -> list:
  """ao_mdm/... paths of every Python module of the package (not the __init__ files)."""
  return sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")
                if p.name != "__init__.py" and "__pycache__" not in p.parts)


def _files(*dirs: pathlib.Path) -> list:
  """Every file under dirs but caches (compiled bytecode may predate the sources)."""
  return sorted(p for d in dirs for p in d.rglob("*") if p.is_file()
                and not any(part == "__pycache__" or part.startswith(".") for part in
                            p.relative_to(ROOT).parts))


def _named() -> set:
  """The `ao_mdm/...py` paths docs/architecture.md names."""
  return set(_NAMED.findall((ROOT / "docs" / "architecture.md").read_text()))


def test_every_module_is_on_the_code_map():
  modules = _modules()
  assert "ao_mdm/model.py" in modules and "ao_mdm/data/prepared.py" in modules
  missing = [m for m in modules if m not in _named()]
  assert missing == [], f"docs/architecture.md does not name {', '.join(missing)}"


def test_the_code_map_names_no_module_that_is_gone():
  gone = sorted(n for n in _named() if not (ROOT / n).is_file())
  assert gone == [], f"docs/architecture.md names modules that do not exist: {', '.join(gone)}"


def test_no_file_refers_to_the_outside_brief():
  files = _files(PACKAGE, ROOT / "tests")
  assert PACKAGE / "model.py" in files and pathlib.Path(__file__).resolve() in files
  found = [p.relative_to(ROOT).as_posix() for p in files
           if OUTSIDE_BRIEF.encode() in p.read_bytes()]
  assert found == [], f"{', '.join(found)} refer to {OUTSIDE_BRIEF}; point to docs/design.md"
