"""The docs say each fact once and briefly: pages stay within their word budget, every table of
measurements names its date and the command that made it, and no page narrates history (git log
keeps that)."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
# Word budgets (as `wc -w` counts) of groups of pages; each group is one topic's pages.
BUDGETS = {
  ("sampling.md", "performance.md", "evaluation.md"): 6_500,
  ("design.md", "architecture.md", "reproducing.md", "launching.md", "checkpoints.md"): 8_500,
}
PAGES = sorted({page for group in BUDGETS for page in group})
# Pages whose tables are all measurements; the others also hold reference tables (the shape
# letters, the code map, the recipe, the key mapping).
MEASURED = ("evaluation.md", "performance.md", "sampling.md")
_HISTORY = re.compile(
  r"\b(previously|previous session|earlier (session|table|run|layout)|this session|"
  r"as first measured|before issue|issue \d+)\b",
  re.IGNORECASE,
)
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_COMMAND = re.compile(r"ao-mdm [a-z]|(scripts|benchmarks)/[a-z0-9_]+\.(py|sh)")


def sections(text: str) -> list:
  """The text of each section: a heading and what follows it up to the next heading."""
  return re.split(r"\n(?=#+ )", text)


@pytest.mark.parametrize("group", list(BUDGETS), ids=lambda g: "+".join(g))
def test_pages_fit_their_word_budget(group):
  words = {page: len((DOCS / page).read_text().split()) for page in group}
  assert sum(words.values()) <= BUDGETS[group], words


@pytest.mark.parametrize("page", MEASURED)
def test_every_table_is_dated_with_its_command(page):
  """A table's section, up to the table, holds a date and the command that produced it."""
  undated = []
  for section in sections((DOCS / page).read_text()):
    for table in re.finditer(r"^\|.*\|\n\|[-| :]+\|$", section, re.MULTILINE):
      before = section[: table.start()]
      if not (_DATE.search(before) and _COMMAND.search(before)):
        undated.append(table.group(0).splitlines()[0][:80])
  assert undated == [], f"{page}: tables without a date or a command: {undated}"


@pytest.mark.parametrize("page", PAGES)
def test_no_narrative_history(page):
  found = [m.group(0) for m in _HISTORY.finditer((DOCS / page).read_text())]
  assert found == [], f"{page} tells history: {found}"


def test_docs_total_within_budget():
  """All of docs/*.md together, the generated command reference included, stays within 18,000
  words."""
  words = {page.name: len(page.read_text().split()) for page in sorted(DOCS.glob("*.md"))}
  assert sum(words.values()) <= 18_000, words


def test_readme_is_a_page():
  """README.md stays one page: at most 1,000 words (the rest lives in docs/)."""
  words = len((DOCS.parent / "README.md").read_text().split())
  assert words <= 1_000, words
