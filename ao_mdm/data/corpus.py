"""The embedded State of the Union corpus (see SOTU_ATTRIBUTION.md)."""

import functools
import importlib.resources
import json
import lzma
import math

SPLITS = ("train", "validation")
VALIDATION_FRACTION = 0.05
_RESOURCE = "sotu.jsonl.xz"


@functools.cache
def sotu_records() -> tuple[dict, ...]:
  """All speeches as dicts (year, name, party, text), sorted by date; read once per process."""
  resource = importlib.resources.files("ao_mdm.data").joinpath(_RESOURCE)
  if not resource.is_file():
    raise FileNotFoundError(
      f"embedded corpus {resource} is missing; run scripts/make_sotu_corpus.py"
    )
  with resource.open("rb") as raw, lzma.open(raw, "rt", encoding="utf-8") as f:
    return tuple(json.loads(line) for line in f if line.strip())


def sotu_documents(split: str) -> list[str]:
  """Speech texts of a split: the last 5% of speeches by date (rounded up) are validation."""
  if split not in SPLITS:
    raise ValueError(f"unknown SOTU split {split!r}; accepted: {', '.join(SPLITS)}")
  texts = [r["text"] for r in sotu_records()]
  n_val = math.ceil(VALIDATION_FRACTION * len(texts))
  return texts[:-n_val] if split == "train" else texts[-n_val:]
