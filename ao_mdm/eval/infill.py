"""Exact infill likelihood: log p(span | prefix, suffix) of an any-order model in one forward,
the span's positions put last in the order (docs/evaluation.md, "Scoring an infill").

The pieces lie side by side, prefix at positions 0.., then the span, then the suffix; the order
is the prefix left to right, the suffix left to right, then the span (left to right by default,
or any fixed order of its positions), so the span's slots condition on every context token and
on the span tokens before them in that order: their NLLs sum to -log p(span | prefix, suffix),
exactly (AO-GPT is a causal model in every order). Many infills go in one padded batch; one
longer than the model's T slots loses the context farthest from its span.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

SPAN_ORDERS = ("l2r", "r2l", "random")


def span_order(n: int, kind: str = "l2r", seed: int = 0) -> np.ndarray:
  """The order of a span's n positions (0..n-1): left to right, right to left, or seeded."""
  if kind == "l2r":
    return np.arange(n)
  if kind == "r2l":
    return np.arange(n)[::-1].copy()
  if kind == "random":
    return np.random.default_rng(seed).permutation(n)
  raise ValueError(f"span order {kind!r}; accepted: {', '.join(SPAN_ORDERS)}")


def layout(
  prefix: Sequence[int], span: Sequence[int], suffix: Sequence[int], order: np.ndarray | None = None
) -> tuple:
  """(tokens, order) of one infill: the pieces side by side, the span's positions last in the
  order (`order`: of the span's own positions, default left to right)."""
  p, s, u = len(prefix), len(span), len(suffix)
  if s < 1:
    raise ValueError("an infill span needs at least one token")
  order = np.arange(s) if order is None else np.asarray(order)
  if sorted(order.tolist()) != list(range(s)):
    raise ValueError(f"the span order {order.tolist()} is no permutation of 0..{s - 1}")
  tokens = np.asarray([*prefix, *span, *suffix], np.int32)
  full = np.concatenate([np.arange(p), p + s + np.arange(u), p + order]).astype(np.int32)
  return tokens, full


def fit(prefix: Sequence[int], span: Sequence[int], suffix: Sequence[int], t: int) -> tuple:
  """(prefix, suffix) cut to the context nearest the span so that all three fill at most t
  positions: each side keeps half the room, or more where the other side is shorter."""
  room = t - len(span)
  if room < 0:
    raise ValueError(f"an infill span of {len(span)} tokens is longer than the model's T={t}")
  keep_prefix = min(len(prefix), max(room // 2, room - len(suffix)))
  keep_suffix = min(len(suffix), room - keep_prefix)
  return list(prefix)[len(prefix) - keep_prefix :], list(suffix)[:keep_suffix]


def infill_nll(
  scorer: Any, items: Sequence[tuple], batch_size: int = 8, bucket: int = 32
) -> list[np.ndarray]:
  """Per item (prefix ids, span ids, suffix ids[, span order]): the NLL of each span token in
  its order, in nats; their sum is -log p(span | prefix, suffix) (span_scores)."""
  return [nll for nll, _ in span_scores(scorer, items, batch_size, bucket)]


def span_scores(
  scorer: Any, items: Sequence[tuple], batch_size: int = 8, bucket: int = 32
) -> list[tuple]:
  """Per item (prefix ids, span ids, suffix ids[, span order]): (NLL, is-greedy) of each span
  token in its order, from `scorer.slot_scores`. With an empty suffix this is the L2R
  log-likelihood of a continuation, its context cut on the left to fit.

  An item longer than the model's T slots is cut by `fit`. Items go in batches of similar
  length, padded to a length rounded up to `bucket` (a few compiled shapes), the padding
  positions after every real slot in the order, so that no real slot attends to them."""
  t = scorer.block_size
  laid = []
  for number, (prefix, span, suffix, *order) in enumerate(items, 1):
    try:
      prefix, suffix = fit(prefix, span, suffix, t)
    except ValueError as e:
      raise ValueError(f"infill {number}: {e}") from None
    laid.append(layout(prefix, span, suffix, *order))
  out: list[tuple] = [()] * len(laid)
  by_length = sorted(range(len(laid)), key=lambda i: -len(laid[i][0]))
  for start in range(0, len(laid), batch_size):
    chunk = by_length[start : start + batch_size]
    n = min(t, -(-len(laid[chunk[0]][0]) // bucket) * bucket)
    tokens_BN = np.zeros((len(chunk), n), np.int32)
    order_BN = np.zeros((len(chunk), n), np.int32)
    for row, i in enumerate(chunk):
      tokens, order = laid[i]
      tokens_BN[row, : len(tokens)] = tokens
      order_BN[row] = np.concatenate([order, np.arange(len(tokens), n)])
    nll_BN, greedy_BN = scorer.slot_scores(tokens_BN, order_BN)
    for row, i in enumerate(chunk):
      end, s = len(laid[i][0]), len(items[i][1])
      out[i] = (nll_BN[row, end - s : end], greedy_BN[row, end - s : end])
  return out
