"""docs/architecture.md names every folder and module, and the code points to the repository's own
docs.

The design lives in docs/design.md; no file of the package or the tests refers to a design
brief outside the repository.
"""

import pathlib
import re

from helpers import ROOT

PACKAGE = ROOT / "ao_mdm"
OUTSIDE_BRIEF = "DESIGN" + ".md"  # built here so that this file does not contain it
_NAMED = re.compile(r"`(ao_mdm/[\w/]+\.py)`")
_FOLDER = re.compile(r"^\| `(ao_mdm/(?:\w+/)*)` \|", re.M)
TOP_LEVEL_MODULES = 8  # at most, besides the subpackages: the rest lives in named folders


def _modules() -> list:
  """ao_mdm/... paths of every Python module of the package (not the __init__ files)."""
  return sorted(
    p.relative_to(ROOT).as_posix()
    for p in PACKAGE.rglob("*.py")
    if p.name != "__init__.py" and "__pycache__" not in p.parts
  )


def _folders() -> list:
  """ao_mdm/.../ of the package and every subpackage (folders with an __init__.py)."""
  return sorted(
    p.parent.relative_to(ROOT).as_posix() + "/"
    for p in PACKAGE.rglob("__init__.py")
    if "__pycache__" not in p.parts
  )


def _files(*dirs: pathlib.Path) -> list:
  """Every file under dirs but caches (compiled bytecode may predate the sources)."""
  return sorted(
    p
    for d in dirs
    for p in d.rglob("*")
    if p.is_file()
    and not any(part == "__pycache__" or part.startswith(".") for part in p.relative_to(ROOT).parts)
  )


def _named() -> set:
  """The `ao_mdm/...py` paths docs/architecture.md names."""
  return set(_NAMED.findall((ROOT / "docs" / "architecture.md").read_text()))


def test_every_module_is_on_the_code_map():
  modules = _modules()
  assert "ao_mdm/model.py" in modules and "ao_mdm/data/prepared.py" in modules
  missing = [m for m in modules if m not in _named()]
  assert missing == [], f"docs/architecture.md does not name {', '.join(missing)}"


def test_every_folder_is_on_the_code_map_and_every_named_folder_exists():
  folders = _folders()
  assert "ao_mdm/" in folders and "ao_mdm/decode/" in folders and "ao_mdm/data/" in folders
  named = set(_FOLDER.findall((ROOT / "docs" / "architecture.md").read_text()))
  assert sorted(set(folders) - named) == [], "docs/architecture.md's table of folders lacks them"
  assert sorted(named - set(folders)) == [], "docs/architecture.md names folders that are gone"


def test_the_top_level_holds_few_modules():
  top = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
  assert "model.py" in top
  assert len(top) <= TOP_LEVEL_MODULES, f"ao_mdm/ holds {len(top)} modules: {sorted(top)}"


def test_no_module_is_over_500_lines():
  long = {m: n for m in _modules() if (n := len((ROOT / m).read_text().splitlines())) > 500}
  assert long == {}, f"split these modules: {long}"


def test_the_code_map_names_no_module_that_is_gone():
  gone = sorted(n for n in _named() if not (ROOT / n).is_file())
  assert gone == [], f"docs/architecture.md names modules that do not exist: {', '.join(gone)}"


def test_no_file_refers_to_the_outside_brief():
  files = _files(PACKAGE, ROOT / "tests")
  assert PACKAGE / "model.py" in files and pathlib.Path(__file__).resolve() in files
  found = [
    p.relative_to(ROOT).as_posix() for p in files if OUTSIDE_BRIEF.encode() in p.read_bytes()
  ]
  assert found == [], f"{', '.join(found)} refer to {OUTSIDE_BRIEF}; point to docs/design.md"
