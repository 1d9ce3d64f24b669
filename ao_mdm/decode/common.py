"""What the decoders share besides the model's decode interface (engine.py): the draw from
filtered probabilities, orders, cache-length buckets, known-token inputs, the output, the exact
log-probability of what was drawn."""

from collections.abc import Sequence
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import noise

MIN_BUCKET = 16  # a smaller shape saves less than its compile costs
CACHE_BUCKETS = 4  # decode loops, each reading only the cache prefix its steps can see


@dataclasses.dataclass
class SampleOutput:
  tokens: np.ndarray  # [B, T] int32
  order: np.ndarray  # [B, T] int32: the generation order (known positions first)
  logits: np.ndarray | None = None  # [B, T, V] float32: logits each position was drawn from
  stats: dict | None = None  # mode-specific counts (speculative: forwards, accepted per row)
  # Per position (engine.Drawn): the log-prob its token was drawn with (after temperature, top-p,
  # top-k; 0 when greedy), the model's own, and the step (speculative: iteration) that drew it.
  logprobs: np.ndarray | None = None  # [B, T] float32
  raw_logprobs: np.ndarray | None = None  # [B, T] float32
  steps: np.ndarray | None = None  # [B, T] int32


def drawn_arrays(drawn: Any) -> dict:
  """SampleOutput's logprobs, raw_logprobs and steps from an engine.Drawn (fetched)."""
  return {
    "logprobs": np.asarray(drawn.logprob_BT),
    "raw_logprobs": np.asarray(drawn.raw_logprob_BT),
    "steps": np.asarray(drawn.step_BT),
  }


def with_dtype(params: Any, cfg: specs.ModelSpec, dtype: str) -> tuple:
  """(params, cfg) to decode in `dtype`: float32 (the default, exact) or bfloat16, where the
  params and the K/V cache are bf16 (half the bytes each step reads) and the logits, softmax and
  draw stay float32. The training config's own compute dtype is not used for decoding."""
  if dtype not in model_lib.DTYPES:
    raise ValueError(f"dtype={dtype!r}; accepted: {', '.join(model_lib.DTYPES)}")
  target = model_lib.DTYPES[dtype]
  cast = lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(cast, params), cfg.replace(dtype=dtype)


def first_argmax(x_NV: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (first index of the maximum), as two plain float reductions:
  XLA:CPU runs argmax's (value, index) reduction unvectorised, and an int32 min as well (4x and
  8x slower at V = 8192). Indices are exact in float32 up to 2**24."""
  v = x_NV.shape[-1]
  index = jnp.arange(v, dtype=jnp.float32 if v <= 2**24 else jnp.int32)
  top_N1 = jnp.max(x_NV, axis=-1, keepdims=True)
  first = jnp.min(jnp.where(x_NV == top_N1, index, v), axis=-1).astype(jnp.int32)
  return jnp.minimum(first, v - 1)  # a row of NaNs has no maximum


def filter_logits(
  logits_NV: jax.Array, top_p: jax.Array, top_k: jax.Array, rule: str = "authors"
) -> jax.Array:
  """Keep the top_k largest (0: all), then apply top-p by `rule`; top_p >= 1 keeps everything.

  "authors" (their catsample.py, the default): drop every token whose inclusive cumulative
  probability exceeds top_p, the one that crosses it included, but always keep the most likely.
  "nucleus": keep the smallest set of most likely tokens whose probability reaches top_p.
  """
  v = logits_NV.shape[-1]  # any leading axes (speculative decoding filters [B, W, V])
  sorted_NV = jnp.sort(logits_NV, axis=-1)[..., ::-1]
  top_k = jnp.broadcast_to(jnp.asarray(top_k), sorted_NV.shape[:-1] + (1,))  # per row or shared
  kth = jnp.take_along_axis(sorted_NV, jnp.clip(top_k - 1, 0, v - 1), axis=-1)
  logits_NV = jnp.where((top_k > 0) & (logits_NV < kth), -jnp.inf, logits_NV)
  sorted_NV = jnp.where((top_k > 0) & (sorted_NV < kth), -jnp.inf, sorted_NV)
  probs_NV = jax.nn.softmax(sorted_NV, axis=-1)
  cum_NV = jnp.cumsum(probs_NV, axis=-1)
  if rule == "authors":
    keep_NV = (cum_NV <= top_p) | (jnp.arange(v) == 0)
  else:
    keep_NV = cum_NV - probs_NV < top_p  # the mass of strictly more likely tokens
  kept = jnp.sum(keep_NV | (top_p >= 1), axis=-1, keepdims=True)  # a prefix, always >= 1
  cutoff = jnp.take_along_axis(sorted_NV, kept - 1, axis=-1)
  return jnp.where(logits_NV < cutoff, -jnp.inf, logits_NV)


@dataclasses.dataclass(frozen=True)
class DrawRule:
  """The static part of a draw (part of a decoder's spec): the top-p rule, and the ids >=
  vocab_limit (the padding rows of a padded vocab) that are never drawn. Whether a row is
  filtered is its own top_p and top_k (traced), never a static switch."""

  top_p_rule: str = "authors"
  vocab_limit: int | None = None


@dataclasses.dataclass(frozen=True)
class Draw:
  """How a token is drawn from logits: temperature (0: greedy), top-p and top-k (traced
  values), and the static `rule`."""

  temperature: Any
  top_p: Any
  top_k: Any
  rule: DrawRule = DrawRule()

  def scaled(self, logits_NV: jax.Array) -> jax.Array:
    """float32 logits / temperature, filtered: the draw is from their softmax."""
    logits_NV = self.limited(logits_NV)
    scaled = logits_NV / jnp.maximum(self.temperature, 1e-6)
    # Each row by its own top_p / top_k (an identity where top_p >= 1 and top_k = 0); the sort is
    # skipped when no row filters.
    filtering = jnp.any((jnp.asarray(self.top_p) < 1) | (jnp.asarray(self.top_k) > 0))
    return jax.lax.cond(
      filtering,
      lambda x: filter_logits(x, self.top_p, self.top_k, self.rule.top_p_rule),
      lambda x: x,
      scaled,
    )

  def limited(self, logits_NV: jax.Array) -> jax.Array:
    logits_NV = logits_NV.astype(jnp.float32)
    v, limit = logits_NV.shape[-1], self.rule.vocab_limit
    if limit is not None and limit < v:
      logits_NV = jnp.where(jnp.arange(v) < limit, logits_NV, -jnp.inf)
    return logits_NV

  def probs(self, logits_NV: jax.Array) -> jax.Array:
    """The distribution `tokens` draws from (float32, rows sum to 1)."""
    return jax.nn.softmax(self.scaled(logits_NV), axis=-1)

  def tokens(self, key: jax.Array, logits_NV: jax.Array) -> jax.Array:
    """Argmax when temperature == 0, else a draw from softmax(scaled logits)."""
    return self.perturbed(logits_NV, noise.gumbel(key, logits_NV.shape))[0]

  def perturbed(self, logits_NV: jax.Array, gumbel_NV: jax.Array) -> tuple:
    """(tokens, scaled logits) of `tokens` given its Gumbel noise: a categorical draw is the
    argmax of Gumbel-perturbed logits (as jax.random.categorical)."""
    scaled = self.scaled(logits_NV)
    drawn = scaled + gumbel_NV
    return first_argmax(jnp.where(self.temperature > 0, drawn, self.limited(logits_NV))), scaled


def draw_from_probs(u_N: jax.Array, probs_NV: jax.Array) -> jax.Array:
  """One categorical draw per row from probabilities (zeros never drawn), by the inverse CDF of
  one uniform u in [0, 1) per row: a single random number per draw, where the Gumbel-max draw
  needs V of them (most of a speculative iteration's time on a CPU)."""
  cum_NV = jnp.cumsum(probs_NV, axis=-1)
  drawn = jnp.sum(cum_NV <= u_N[:, None] * cum_NV[:, -1:], axis=-1)
  # Rounding can put u * total at the total: take the last token with any probability then.
  last = probs_NV.shape[-1] - 1 - first_argmax((probs_NV > 0)[:, ::-1].astype(jnp.int32))
  return jnp.minimum(drawn, last).astype(jnp.int32)


def make_orders(
  key: jax.Array,
  known_BT: jax.Array,
  mode: str,
  block_len: int | None = None,
  end: int | None = None,
) -> jax.Array:
  """Known positions first (left to right), then the unknown ones at random or left to right;
  with `block_len`, the unknown ones in blocks of that many (left to right), each block's
  positions in that order; with `end`, the positions from `end` on last of all (left to right):
  a decoder that stops at slot `end` never draws them."""
  b, t = known_BT.shape
  pos = jnp.arange(t, dtype=jnp.float32)
  rest = jax.random.uniform(key, (b, t)) * t if mode == "random" else jnp.broadcast_to(pos, (b, t))
  rank_BT = jnp.cumsum(~known_BT, axis=1) - 1  # among the unknown positions
  block_BT = jnp.where(known_BT, -1, rank_BT // (block_len or t))
  if end is not None:
    after_T = jnp.arange(t) >= end
    block_BT = jnp.where(after_T, t, block_BT)
    rest = jnp.where(after_T, pos, rest)
  return jnp.lexsort((jnp.where(known_BT, pos, rest), block_BT), axis=1).astype(jnp.int32)


def eos_lengths(tokens_BT: np.ndarray, start: int, eos_id: int) -> np.ndarray:
  """[B] tokens up to and including the first EOS at a position >= start (T without one)."""
  t = tokens_BT.shape[1]
  hit_BT = (tokens_BT == eos_id) & (np.arange(t) >= start)
  return np.where(hit_BT.any(1), hit_BT.argmax(1) + 1, t).astype(np.int32)


def equal_bounds(total: int, parts: int) -> list:
  """The distinct sizes ceil(total * g / parts), g = 1..parts, ascending."""
  return sorted({-(-total * g // parts) for g in range(1, parts + 1)})


def bucket_bounds(total: int, buckets: int) -> list:
  """The few static sizes a program is compiled for instead of one per size: ceil(total * g /
  buckets), g = 1..buckets, and below the first, total / 8 and total / 16 (none below
  MIN_BUCKET), ascending. A short request in a long context then reads at most twice its slots,
  a long generation at most total / buckets more than it needs."""
  steps = set(equal_bounds(total, buckets))
  halvings = {-(-total // d) for d in (8, 16) if d > buckets}
  return sorted({max(b, min(total, MIN_BUCKET)) for b in steps | halvings})


def bucket_for(size: int, total: int, buckets: int) -> int:
  """The smallest bound of bucket_bounds(total, buckets) that holds `size` (<= total)."""
  return min(b for b in bucket_bounds(total, buckets) if b >= size)


def bucket_segments(sizes: Sequence[int], total: int, buckets: int) -> tuple:
  """Consecutive steps grouped by the smallest bucket bound that holds each step's size:
  ((first step, end step, bound), ...), one loop each."""
  segments: list[tuple[int, int, int]] = []
  for i, size in enumerate(sizes):
    bound = bucket_for(size, total, buckets)
    if segments and segments[-1][2] == bound:
      segments[-1] = (segments[-1][0], i + 1, bound)
    else:
      segments.append((i, i + 1, bound))
  return tuple(segments)


def known_arrays(t: int, batch: int, positions: Any = (), token_ids: Any = ()) -> tuple:
  """[B, T] known tokens and mask from positions and ids shared by the batch."""
  positions = [int(p) for p in positions]
  token_ids = [int(x) for x in token_ids]
  if len(positions) != len(token_ids):
    raise ValueError(f"{len(positions)} known positions but {len(token_ids)} known tokens")
  if len(positions) >= t:
    raise ValueError(
      f"{len(positions)} known tokens do not fit in T={t} positions with at "
      f"least one left to generate (the prompt is too long)"
    )
  bad = [p for p in positions if not 0 <= p < t]
  if bad:
    raise ValueError(f"known positions {bad} are outside [0, {t})")
  dup = sorted({p for p in positions if positions.count(p) > 1})
  if dup:
    raise ValueError(f"known positions {dup} are given more than once")
  tokens = np.zeros((batch, t), np.int32)
  mask = np.zeros((batch, t), bool)
  tokens[:, positions] = token_ids
  mask[:, positions] = True
  return tokens, mask


def decode_end(end: int | None, known_T: np.ndarray) -> int:
  """The slot a decoder stops at: `end` (positions from it on are never drawn), T for None.
  Every known position must lie before it, and at least one unknown one."""
  t = known_T.shape[0]
  if end is None:
    return t
  end = int(end)
  if not 1 <= end <= t:
    raise ValueError(f"end={end} must be in [1, {t}] (T)")
  if known_T[end:].any():
    raise ValueError(
      f"end={end} leaves known positions after it (the last is at "
      f"{int(np.flatnonzero(known_T)[-1])})"
    )
  if known_T[:end].all():
    raise ValueError(f"end={end} leaves nothing to generate: every position before it is known")
  return end


def known_inputs(
  cfg: specs.ModelSpec, batch: int, positions: Any, token_ids: Any, vocab_limit: int | None
) -> tuple:
  """known_arrays for a model config, refusing ids outside its vocab or at/above vocab_limit."""
  tokens, mask = known_arrays(cfg.block_size, batch, positions, token_ids)
  if np.any((tokens < 0) | (tokens >= cfg.vocab_size)):
    raise ValueError(f"known token ids must be in [0, {cfg.vocab_size})")
  if vocab_limit is not None and not 0 < vocab_limit <= cfg.vocab_size:
    raise ValueError(f"vocab_limit={vocab_limit} must be in [1, {cfg.vocab_size}]")
  if vocab_limit is not None and np.any(tokens[mask] >= vocab_limit):
    raise ValueError(f"known token ids must be below vocab_limit={vocab_limit}")
  return tokens, mask


@functools.lru_cache(maxsize=8)
def _slot_nll(cfg: specs.ModelSpec) -> Any:
  return jax.jit(functools.partial(model_lib.slot_nll, model_lib.make_model(cfg)))


def drawn_logprob(
  params: Any, cfg: specs.ModelSpec, tokens_BT: Any, known_BT: Any, drawn_BT: Any
) -> np.ndarray:
  """[B] exact log p(each row's drawn tokens | its known ones), the positions in neither left
  out (an any-order model's marginal): one float32 forward, the known tokens first, then the
  drawn ones left to right. What likelihood-ranked sampling (best_of) ranks by, whatever order
  and however many tokens a step the decoder wrote them in."""
  order_BT = np.argsort(np.where(known_BT, 0, np.where(drawn_BT, 1, 2)), axis=1, kind="stable")
  tokens_BT = np.asarray(tokens_BT, np.int32)
  nll_BT = np.asarray(_slot_nll(cfg.replace(dtype="float32"))(params, tokens_BT, order_BT))
  return -(nll_BT.astype(np.float64) * np.take_along_axis(drawn_BT, order_BT, axis=1)).sum(1)
