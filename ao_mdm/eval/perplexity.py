"""Perplexities (L2R, any-order, context-order ensemble) and generative perplexity
(docs/design.md, "Orders and evaluation").

All NLLs are in nats per token; a perplexity is exp(mean NLL) over every scored token.
"""

from collections.abc import Callable, Sequence
import math
from typing import Any

import jax
import numpy as np

from ao_mdm import orders as orders_lib
from ao_mdm.decode import common
from ao_mdm.eval import scoring
from ao_mdm.storage import fs

ENSEMBLE_BUCKETS = 8  # slot-count buckets for the truncated ensemble forwards


def random_orders(seed: int, b: int, t: int) -> np.ndarray:
  return np.array(orders_lib.random_orders(jax.random.key(seed), b, t))


def ensemble_nll(
  scorer: scoring.Scorer,
  tokens_BT: np.ndarray,
  order_BT: np.ndarray,
  m: int,
  seed: int,
  max_rows: int = 256,
) -> tuple[np.ndarray, dict]:
  """[B, T] context-order ensemble NLL (paper eq. 7) per slot of `order_BT`, and its cost.

  For the target at slot i, the context set order[:i] is reshuffled m - 1 times; the target's
  probability is averaged over the m orders (the original included). Each reshuffled forward
  stops at slot i (slot counts rounded up to ENSEMBLE_BUCKETS sizes), and the reshuffles of many
  targets run in one batch.
  """
  if m < 1:
    raise ValueError(f"ensemble size M={m} must be >= 1")
  b, t = tokens_BT.shape
  logp_BTE = np.empty((b, t, m))
  logp_BTE[:, :, 0] = -scorer.slot_nll(tokens_BT, order_BT)
  rng = np.random.default_rng(seed)
  # Equal steps only, no floor (not the decoders' bounds): slot i pays at most i + T / 8 slots.
  bounds = common.equal_bounds(t, ENSEMBLE_BUCKETS)
  slots_computed = b * t  # the original order: one full forward
  for lo, hi in zip([0] + bounds[:-1], bounds):
    jobs = [(bi, i, r) for i in range(lo, min(hi, t)) for bi in range(b) for r in range(1, m)]
    for start in range(0, len(jobs), max_rows):
      chunk = jobs[start : start + max_rows]
      order_Nt = np.empty((len(chunk), hi), np.int32)
      for row, (bi, i, _) in enumerate(chunk):
        order_Nt[row, :i] = rng.permutation(np.array(order_BT[bi, :i]))
        order_Nt[row, i:] = order_BT[bi, i:hi]  # slot i holds the target; later slots unused
      nll = scorer.slot_nll(tokens_BT[[bi for bi, _, _ in chunk]], order_Nt)
      for row, (bi, i, r) in enumerate(chunk):
        logp_BTE[bi, i, r] = -nll[row, i]
      slots_computed += len(chunk) * hi
  # -log(mean_m p_m), computed stably from log-probabilities.
  top = logp_BTE.max(-1, keepdims=True)
  ens = -(top[..., 0] + np.log(np.mean(np.exp(logp_BTE - top), axis=-1)))
  cost = {
    "slot_forwards": slots_computed,
    "full_forward_equivalents_per_target": slots_computed / (b * t) / t,
  }
  return ens, cost


def evaluate_blocks(
  scorer: scoring.Scorer,
  blocks_NT: np.ndarray,
  *,
  orders: int = 1,
  any_order_blocks: int | None = None,
  ensemble: Sequence[int] = (),
  batch_size: int = 8,
  seed: int = 0,
  progress: Callable | None = None,
  per_sequence: bool = False,
) -> dict:
  """L2R and ensemble perplexities over every block; any-order over `any_order_blocks` of them.

  The any-order estimate (`orders` random orders per block, with its standard error) uses a seeded
  shuffle of the blocks cut to `any_order_blocks` (None: all), as the authors' loaders do. The
  ensemble draws one random order per block and reshuffles its contexts (paper eq. 7).
  `progress(n)` is called as blocks are done; the total is `evaluation_units(...)`. The orders
  depend only on `seed` and the block count, so two models evaluated alike are paired; with
  `per_sequence` the result also lists each sequence's mean NLL (for paired differences).
  """
  if orders < 1:
    raise ValueError(f"orders={orders} must be >= 1")
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1")
  n, t = blocks_NT.shape
  ao_rows = _any_order_rows(n, any_order_blocks, seed)
  l2r_parts: list[np.ndarray] = []
  ens: dict[int, list[np.ndarray]] = {m: [] for m in ensemble}
  cost = {m: 0.0 for m in ensemble}
  for start in range(0, n, batch_size):
    tokens = blocks_NT[start : start + batch_size]
    b = len(tokens)
    l2r_parts.append(scoring.l2r_nll(scorer, tokens).mean(1))
    if ensemble:
      order = random_orders(seed * 1_000_003 + start + 1, b, t)
      for m in ensemble:
        e, c = ensemble_nll(scorer, tokens, order, m, seed + start)
        ens[m].append(e.mean(1))
        cost[m] += c["full_forward_equivalents_per_target"] * b
    if progress:
      progress(b)
  any_order = []
  for start in range(0, len(ao_rows), batch_size):
    tokens = blocks_NT[ao_rows[start : start + batch_size]]
    b = len(tokens)
    per_order = [
      scorer.slot_nll(tokens, random_orders(seed * 1_000_003 + n + start * orders + k, b, t)).mean(
        1
      )
      for k in range(orders)
    ]
    any_order.append(np.stack(per_order, 1))
    if progress:
      progress(b)
  l2r = np.concatenate(l2r_parts)
  ao = np.concatenate(any_order)  # [sequences, orders]
  m_ao = len(ao)
  # Standard error of the any-order mean NLL over sequences (each averaged over its orders).
  se_nll = ao.mean(1).std(ddof=1) / math.sqrt(m_ao) if m_ao > 1 else float("nan")
  out: dict[str, Any] = {
    "l2r_ppl": math.exp(l2r.mean()),
    "l2r_nll": float(l2r.mean()),
    "any_order_ppl": math.exp(ao.mean()),
    "any_order_nll": float(ao.mean()),
    "any_order_se": math.exp(ao.mean()) * se_nll,  # delta method, in perplexity units
    "any_order_nll_se": float(se_nll),
    "orders": orders,
    "any_order_sequences": m_ao,
    "tokens": int(n * t),
    "sequences": int(n),
  }
  if per_sequence:
    out["l2r_nll_seq"] = l2r.tolist()
    out["any_order_nll_seq"] = ao.mean(1).tolist()
    out["any_order_rows"] = ao_rows.tolist()
  if ensemble:
    out["ensemble_ppl"] = {str(m): math.exp(np.concatenate(ens[m]).mean()) for m in ensemble}
    out["ensemble_cost_full_forwards_per_target"] = {str(m): cost[m] / n for m in ensemble}
  return out


def _any_order_rows(n: int, limit: int | None, seed: int) -> np.ndarray:
  if limit is None or limit >= n:
    return np.arange(n)
  if limit < 1:
    raise ValueError(f"any_order_blocks={limit} must be >= 1 (or None for all)")
  return np.sort(np.random.default_rng(seed).permutation(n)[:limit])


def evaluation_units(n: int, any_order_blocks: int | None) -> int:
  """Progress units of evaluate_blocks over n blocks."""
  return n + (n if any_order_blocks is None else min(n, any_order_blocks))


UNIGRAM_FILE = "tokenizer/train_token_counts.npy"  # saved with each run and its export


def unigram_nll(counts_V: np.ndarray, blocks_NT: np.ndarray) -> float:
  """Mean NLL (nats) of the blocks' tokens under the training split's unigram distribution,
  add-one smoothed: the baseline a model must beat to have used any context."""
  logp_V = np.log((counts_V + 1.0) / (counts_V.sum() + len(counts_V)))
  return float(-logp_V[np.asarray(blocks_NT)].mean())


def load_unigram_counts(checkpoint: str) -> np.ndarray | None:
  """The training token counts saved with a run or export (None for runs made before them)."""
  path = fs.join(checkpoint, UNIGRAM_FILE)
  return fs.read_npy(path) if fs.isfile(path) else None


def unigram_entropy(ids: Sequence[int]) -> float:
  """Entropy (nats) of a sample's token frequencies: low values expose repetition."""
  _, counts = np.unique(np.asarray(ids), return_counts=True)
  p = counts / counts.sum()
  return float(-(p * np.log(p)).sum())


def generative_perplexity(
  scorer: Any, samples: Sequence[Sequence[int]], batch_size: int = 8
) -> dict:
  """Mean over samples of exp(mean NLL of tokens 1..n-1) under an L2R scorer, and unigram entropy.

  As the authors score with GPT-2 Large: the first token is not scored, and the reported figure
  is the mean of per-sample perplexities (gen_ppl_sem: its standard error over the samples).
  `scorer` is a Scorer or a gpt2_scorer.GPT2Scorer;
  samples may differ in length (re-tokenized text) and are batched by length.
  """
  if not samples or min(len(s) for s in samples) < 2:
    raise ValueError("samples must be non-empty and hold at least 2 tokens each")
  longest = max(len(s) for s in samples)
  if longest > scorer.block_size:
    raise ValueError(f"a sample has {longest} tokens; the scorer reads at most {scorer.block_size}")
  top = max(max(s) for s in samples)
  if top >= scorer.vocab_size or min(min(s) for s in samples) < 0:
    raise ValueError(
      f"sample token id {top} is outside the scorer's vocab [0, {scorer.vocab_size})"
    )
  ppl = np.empty(len(samples))
  by_length: dict[int, list[int]] = {}
  for i, s in enumerate(samples):
    by_length.setdefault(len(s), []).append(i)
  for rows in by_length.values():
    for start in range(0, len(rows), batch_size):
      chunk = rows[start : start + batch_size]
      ids = np.asarray([samples[i] for i in chunk], np.int32)
      ppl[chunk] = np.exp(scorer.token_nll(ids).mean(1))
  entropy = np.asarray([unigram_entropy(s) for s in samples])
  sem = float(ppl.std(ddof=1) / np.sqrt(len(ppl))) if len(ppl) > 1 else float("nan")
  return {
    "gen_ppl": float(ppl.mean()),
    "gen_ppl_sem": sem,
    "gen_ppl_median": float(np.median(ppl)),
    "unigram_entropy": float(entropy.mean()),
    "samples": len(samples),
  }
