"""benchmarks/ holds the measurement scripts, each with an entry in benchmarks/README.md naming its
command and the docs table it fills; scripts/ holds only the tools its README lists; every path
of either that the repository cites exists."""

import re

from helpers import ROOT

BENCHMARKS, SCRIPTS = ROOT / "benchmarks", ROOT / "scripts"
_CITED = re.compile(r"\b(?:scripts|benchmarks)/\w+\.(?:py|sh)\b")
_FILLS = re.compile(r'^Fills (docs/\w+\.md), "([^"]+)"', re.M)


def _entries() -> dict:
  """benchmarks/README.md's entries: a `## NAME.py` heading -> its text."""
  parts = re.split(r"^## ", (BENCHMARKS / "README.md").read_text(), flags=re.M)[1:]
  return {p.split("\n", 1)[0].strip(): p for p in parts}


def _section(page: str, title: str) -> str:
  """The text of the section of docs page `page` whose heading starts with `title` ('' if none),
  up to the next heading."""
  for part in re.split(r"\n(?=#+ )", (ROOT / page).read_text()):
    if re.match(rf"#+ {re.escape(title)}", part):
      return part
  return ""


def test_every_benchmark_has_an_entry_with_its_command_and_docs_table():
  scripts = sorted(p.name for p in BENCHMARKS.glob("*.py"))
  entries = _entries()
  assert "reproduce.py" in scripts and "until_eos.py" in scripts
  assert sorted(entries) == scripts, "benchmarks/README.md's entries and files differ"
  for name, text in entries.items():
    assert f"`python benchmarks/{name}" in text, f"{name}: no command"
    fills = _FILLS.findall(text)
    assert fills, f"{name}: no 'Fills docs/PAGE.md, \"SECTION\"' line"
    for page, title in fills:
      assert f"benchmarks/{name}" in _section(page, title), (
        f"{page}, {title!r} does not cite {name}"
      )


def test_scripts_holds_only_the_tools_its_readme_lists():
  tools = sorted(p.name for p in SCRIPTS.iterdir() if p.is_file() and p.name != "README.md")
  listed = re.findall(r"^- `([\w.]+)", (SCRIPTS / "README.md").read_text(), re.M)
  assert "gpu_check.sh" in tools and "local_gcs.py" in tools
  assert sorted(listed) == tools


def test_every_cited_script_or_benchmark_exists():
  files = [ROOT / "README.md", ROOT / "setup.py", ROOT / "Makefile", *(ROOT / "docs").glob("*.md")]
  for folder in ("ao_mdm", "tests", "benchmarks", "scripts"):
    files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
  cited = {m: p for p in files for m in _CITED.findall(p.read_text())}
  assert "benchmarks/reproduce.py" in cited and "scripts/local_gcs.py" in cited
  gone = {m: str(p.relative_to(ROOT)) for m, p in cited.items() if not (ROOT / m).is_file()}
  assert gone == {}, f"cited but not there (path: a file citing it): {gone}"
