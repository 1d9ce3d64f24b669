"""The embedded State of the Union corpus (see SOTU_ATTRIBUTION.md)."""
import functools
import importlib.resources
import json
import lzma
import math
import random

SPLITS = ("train", "validation")
VALIDATION_FRACTION = 0.05
_RESOURCE = "sotu.jsonl.xz"


@functools.cache
def sotu_records() -> tuple[dict, ...]:
  """All speeches as dicts (year, name, party, text), sorted by date; read once per process."""
  resource = importlib.resources.files("ao_mdm.data").joinpath(_RESOURCE)
  if not resource.is_file():
    raise FileNotFoundError(
        f"embedded corpus {resource} is missing; run scripts/make_sotu_corpus.py")
  with resource.open("rb") as raw, lzma.open(raw, "rt", encoding="utf-8") as f:
    return tuple(json.loads(line) for line in f if line.strip())


def sotu_documents(split: str) -> list[str]:
  """Speech texts of a split: the last 5% of speeches by date (rounded up) are validation."""
  if split not in SPLITS:
    raise ValueError(f"unknown SOTU split {split!r}; accepted: {', '.join(SPLITS)}")
  texts = [r["text"] for r in sotu_records()]
  n_val = math.ceil(VALIDATION_FRACTION * len(texts))
  return texts[:-n_val] if split == "train" else texts[-n_val:]


def synthetic_documents(n_chars: int, seed: int = 0,
                        sentences_per_document: tuple[int, int] = (4, 60)):
  """Yields documents of the embedded corpus's sentences in a seeded shuffled order (reshuffled
  after each pass) until they hold `n_chars` characters: a corpus of any size for benchmarks.

  Each document joins a uniform random count of sentences from `sentences_per_document` with
  spaces (about 1,100 GPT-2 tokens on average, near OpenWebText's) and holds no newline.
  """
  from ao_mdm.data.tokenizer import sentences  # pylint: disable=g-import-not-at-top
  pool = [s for r in sotu_records() for s in sentences(r["text"]) if "\n" not in s]
  rng = random.Random(seed)
  order, pos, written = [], 0, 0
  while written < n_chars:
    k = rng.randint(*sentences_per_document)
    picked = []
    while len(picked) < k:
      if pos == len(order):
        order, pos = rng.sample(pool, len(pool)), 0
      take = order[pos:pos + k - len(picked)]
      picked += take
      pos += len(take)
    doc = " ".join(picked)
    written += len(doc)
    yield doc
