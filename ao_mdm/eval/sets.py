"""The data an evaluation scores: blocks of registry datasets or of a local text file (prepared
first if needed, packed by the paper's protocol or a custom one), their evaluation set by set,
and the samples of `ao-mdm sample --out` for generative perplexity."""

from collections.abc import Callable, Sequence
import math
import time
from typing import Any

import numpy as np

from ao_mdm import specs
from ao_mdm.eval import perplexity, scoring
from ao_mdm.storage import paths

PROTOCOLS = ("paper", "custom")


def eval_sets(
  data_cfg: specs.DataSpec,
  tokenizer: Any,
  block_size: int,
  *,
  names: Sequence[str] = (),
  text_file: str | None = None,
  lambada_file: str | None = None,
  protocol: str = "paper",
  split: str = "validation",
  max_blocks: int | None = None,
) -> dict:
  """{name: int32 [N, T] blocks} of registry datasets (prepared first if needed), or of one
  local text file.

  The paper protocol takes each dataset's split from paper.eval_split and packs it as the
  authors do (prepared.paper_blocks); the custom one takes `split`, the consecutive blocks of
  the split's token stream, and at most `max_blocks`.
  """
  from ao_mdm import paper
  from ao_mdm.data import datasets, pipeline, prepare

  if text_file:
    token_lists = [tokenizer.encode(d) for d in datasets.read_text_documents(text_file)]
    return {text_file: pipeline.pack_for_eval(token_lists, tokenizer.eos_id, block_size, text_file)}
  sets = {}
  for name in names:
    cfg = data_cfg.replace(dataset=name)
    if name == "lambada":
      if not lambada_file:
        raise ValueError(
          "--datasets=lambada needs --lambada_file=lambada_test.jsonl (OpenAI's "
          "LAMBADA test file, one JSON object with a 'text' field per line)"
        )
      cfg = cfg.replace(text_file=lambada_file)
    paper_protocol = protocol == "paper"
    prepared_split = prepare.ensure(
      cfg, tokenizer, paper.eval_split(name) if paper_protocol else split
    )
    sets[name] = pipeline.eval_blocks(
      prepared_split,
      block_size,
      max_blocks=None if paper_protocol else max_blocks,
      packing="paper" if paper_protocol else "stream",
    )
  return sets


def evaluate_sets(
  scorer: scoring.Scorer,
  sets: dict,
  *,
  protocol: str = "paper",
  orders: int = 4,
  ensemble: Sequence[int] = (),
  batch_size: int = 8,
  seed: int = 0,
  progress: Callable[[str, int], Callable] | None = None,
  unigram_counts: np.ndarray | None = None,
) -> dict:
  """evaluate_blocks per set, under the paper protocol (one order, the authors' block counts)
  or a custom one (`orders` per block, every block); adds the wall time of each.

  `progress(name, total)` may return a callback that is given the blocks done; with
  `unigram_counts` each result also holds the unigram perplexity of the same tokens.
  """
  from ao_mdm import paper

  results = {}
  for name, blocks in sets.items():
    if protocol == "paper":
      n_orders, ao_blocks = 1, paper.eval_any_order_blocks(name)
    else:
      n_orders, ao_blocks = orders, None
    units = perplexity.evaluation_units(len(blocks), ao_blocks)
    update = progress(name, units) if progress else None
    start = time.perf_counter()
    r = perplexity.evaluate_blocks(
      scorer,
      blocks,
      orders=n_orders,
      any_order_blocks=ao_blocks,
      ensemble=ensemble,
      batch_size=batch_size,
      seed=seed,
      progress=update,
    )
    r["seconds"] = time.perf_counter() - start
    if unigram_counts is not None:  # the baseline on the same tokens
      r["unigram_ppl"] = math.exp(perplexity.unigram_nll(unigram_counts, blocks))
    results[name] = r
  return results


def read_generated(path: str) -> list[dict]:
  """Records of `ao-mdm sample --out` (JSON lines with 'tokens' and 'text'), checked."""
  records = paths.jsonl_records(path, "--generated")
  for number, r in enumerate(records, 1):
    tokens = r.get("tokens")
    missing = [
      what
      for what, ok in (
        (
          "a 'tokens' list of integers",
          isinstance(tokens, list) and all(isinstance(i, int) for i in tokens),
        ),
        ("a 'text' string", isinstance(r.get("text"), str)),
      )
      if not ok
    ]
    if missing:
      raise ValueError(
        f"--generated {path} record {number} lacks {' and '.join(missing)} "
        "(expected what `ao-mdm sample --out` writes)"
      )
  return records


def generated_ids(records: list[dict], scorer: Any) -> list[list[int]]:
  """Token ids to score: the samples' own ids, or their text re-tokenized for a GPT-2 scorer."""
  from ao_mdm.data import gpt2
  from ao_mdm.eval import gpt2_scorer  # only here

  if not isinstance(scorer, gpt2_scorer.GPT2Scorer) or all(
    r.get("tokenizer") == "gpt2" for r in records
  ):
    return [r["tokens"] for r in records]
  encode = gpt2.GPT2Tokenizer().encode  # other tokenizers: score the text as GPT-2 reads it
  return [encode(r["text"])[: scorer.block_size] for r in records]
