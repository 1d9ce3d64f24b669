"""Parallel multi-token decoding with a KV cache (DESIGN.md section 4), one jitted loop.

Step i turns the known count n_{i-1} into n_i. Its chunk holds the real slots whose inputs became
known in the previous step (their K/V go into the cache), the last of which (slot n_{i-1}) is the
first query, plus one phantom slot per extra target: a copy of slot n_{i-1}'s input with its own
target. Each query sees the cached slots, the earlier real slots of the chunk, and itself.
"""
import dataclasses
import functools
import itertools
import json
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ao_mdm import model as model_lib

SCHEDULES = ("linear", "cosine")
CACHE_BUCKETS = 4  # decode loops, each reading only the cache prefix its steps can see
ORDER_MODES = ("random", "l2r")


def schedule_counts(t: int, known: int, steps: int, schedule: str) -> np.ndarray:
  """Cumulative known counts n_0 = P, ..., n_S = T after each of S steps, as the authors count.

  Their model_AOGPT_generate.py (`generate`, `cond_generate`): time = torch.linspace(1, 0, S + 1)
  in float32, cosine maps it to cos((1 - time) * pi * 0.5), and step i reveals up to
  n_i = max(P + int((T - P) * (1 - time_i)), n_{i-1} + 1), every operation in float32 and int()
  truncating; T is our block_size where they write 1024. With P = 0 this is their `generate`.
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r}; accepted: {', '.join(SCHEDULES)}")
  if not 0 <= known < t:
    raise ValueError(f"{known} known tokens leave nothing to generate in T={t} positions")
  if not 1 <= steps <= t - known:
    raise ValueError(f"steps={steps} must be in [1, {t - known}] (the number of unknown tokens)")
  f32 = np.float32
  # torch.linspace(1, 0, S + 1) in float32: step = -1 / S; the first half of the points is
  # 1 + step * j as one fused multiply-add (exact in float64, then one rounding), the second half
  # 0 - step * (S - j) (equal to torch's values for every S up to 4096, checked on its CPU kernel).
  j = np.arange(steps + 1)
  step = np.float64(f32(-1.0) / f32(steps))
  time = np.where(j < (steps + 1) // 2, (step * j + 1.0).astype(f32),
                  (-(step * (steps - j))).astype(f32))
  if schedule == "cosine":  # the argument in float32, its cosine rounded from float64
    time = np.cos((((f32(1) - time) * f32(np.pi)) * f32(0.5)).astype(np.float64)).astype(f32)
  # (T - P) * (1 - time_i) in float32, truncated as int() does (the values are >= 0).
  reached = known + (f32(t - known) * (f32(1) - time[1:])).astype(np.int64)
  counts = [known]
  for n in reached.tolist():  # at least one new token per step
    counts.append(max(n, counts[-1] + 1))
  # time_S is 0 (or cos(pi/2) ~ -4e-8, 1.0 after the float32 subtraction): n_S = T; and for
  # S <= T - P no earlier step reaches T (checked for every P and S with T up to 1024).
  assert counts[-1] == t, (t, known, steps, schedule, counts)
  return np.asarray(counts, np.int32)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static shape of one decode loop: counts per step and the padded chunk widths."""
  counts: tuple  # n_0 .. n_S
  starts: tuple  # first real slot of each step's chunk
  real_width: int  # W_r: real slots per chunk
  phantom_width: int  # W_p: phantom slots per chunk
  segments: tuple  # (first step, end step, cache length read): attention skips the empty tail

  @staticmethod
  def make(counts: np.ndarray, use_cache: bool = True) -> "Plan":
    counts = tuple(int(n) for n in counts)
    t = counts[-1]
    k = np.diff(counts)
    if use_cache:
      starts = (counts[0],) + tuple(n + 1 for n in counts[:-2])
      real = max(n - c + 1 for n, c in zip(counts[:-1], starts))
    else:  # every step recomputes all real slots: the encoder-only cost model
      starts, real = (0,) * len(k), t
    # Step i reads cache slots < starts[i]; group the steps into CACHE_BUCKETS cache lengths.
    bounds = [-(-t * g // CACHE_BUCKETS) for g in range(1, CACHE_BUCKETS + 1)]
    bucket = [min(b for b in bounds if b >= c) for c in starts]
    segments = []
    for i, length in enumerate(bucket):
      if segments and segments[-1][2] == length:
        segments[-1] = (segments[-1][0], i + 1, length)
      else:
        segments.append((i, i + 1, length))
    return Plan(counts, starts, int(real), int(k.max()) - 1, tuple(segments))


TOP_P_RULES = ("authors", "nucleus")


def filter_logits(logits_NV: jax.Array, top_p: jax.Array, top_k: jax.Array,
                  rule: str = "authors") -> jax.Array:
  """Keep the top_k largest (0: all), then apply top-p by `rule`; top_p >= 1 keeps everything.

  "authors" (their catsample.py, the default): drop every token whose inclusive cumulative
  probability exceeds top_p, the one that crosses it included, but always keep the most likely.
  "nucleus": keep the smallest set of most likely tokens whose probability reaches top_p.
  """
  v = logits_NV.shape[-1]
  sorted_NV = jnp.sort(logits_NV, axis=-1)[:, ::-1]
  kth = jnp.take(sorted_NV, jnp.clip(top_k - 1, 0, v - 1), axis=-1)[:, None]
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


def sample_tokens(key: jax.Array, logits_NV: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  top_k: jax.Array, use_filter: bool, rule: str = "authors",
                  vocab_limit: Optional[int] = None) -> jax.Array:
  """Argmax when temperature == 0, else a draw from softmax(logits / temperature), filtered.

  Ids >= vocab_limit (e.g. the padding rows 50257..50303 of GPT-2's padded vocab) are never picked.
  """
  logits_NV = logits_NV.astype(jnp.float32)
  if vocab_limit is not None and vocab_limit < logits_NV.shape[-1]:
    logits_NV = jnp.where(jnp.arange(logits_NV.shape[-1]) < vocab_limit, logits_NV, -jnp.inf)
  scaled = logits_NV / jnp.maximum(temperature, 1e-6)
  if use_filter:
    scaled = filter_logits(scaled, top_p, top_k, rule)
  # A categorical draw is the argmax of Gumbel-perturbed logits (as jax.random.categorical).
  drawn = scaled + jax.random.gumbel(key, scaled.shape, scaled.dtype)
  return first_argmax(jnp.where(temperature > 0, drawn, logits_NV))


def first_argmax(x_NV: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (first index of the maximum), as two plain reductions:
  XLA:CPU runs argmax's (value, index) reduction unvectorised, several times slower."""
  v = x_NV.shape[-1]
  top_N1 = jnp.max(x_NV, axis=-1, keepdims=True)
  first = jnp.min(jnp.where(x_NV == top_N1, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
  return jnp.minimum(first, v - 1)  # a row of NaNs has no maximum


def make_orders(key: jax.Array, known_BT: jax.Array, mode: str) -> jax.Array:
  """Known positions first (left to right), then the unknown ones at random or left to right."""
  b, t = known_BT.shape
  pos = jnp.arange(t, dtype=jnp.float32)
  rest = jax.random.uniform(key, (b, t)) * t if mode == "random" else jnp.broadcast_to(pos, (b, t))
  return jnp.argsort(jnp.where(known_BT, pos - 2 * t, rest), axis=1).astype(jnp.int32)


def _embed_stack(module, prev_tok, prev_pos, target, cache, mask):
  x, c = module.embed(prev_tok, prev_pos, target)
  h, kv = module.stack(x, c, cache, mask)
  return h, c, kv


def prefilled_cache(apply: Callable, cfg: ml_collections.ConfigDict, tokens_BT: jax.Array,
                    order_BT: jax.Array, known: int) -> dict:
  """The empty [L, B, H, T, K] K/V cache with slots 0..known-1 (the known tokens) written.

  `apply(prev_tok, prev_pos, target, cache, mask)` runs _embed_stack of the decode model.
  """
  dtype = model_lib.DTYPES[cfg.dtype]
  b, t = tokens_BT.shape
  shape = (cfg.n_layer, b, cfg.n_head, t, cfg.n_embd // cfg.n_head)
  cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
  if known:  # the slots of the known tokens are real and all their inputs are known
    slots = jnp.broadcast_to(jnp.arange(known), (b, known))
    _, _, kv = apply(*_slot_inputs(tokens_BT, order_BT, slots), order_BT[:, :known], None, None)
    cache = {name: cache[name].at[:, :, :, :known].set(
        kv[name].transpose(0, 1, 3, 2, 4).astype(dtype)) for name in cache}
  return cache


def _slot_inputs(tokens_BT, order_BT, slots_BW):
  """Token and position fed at slots (slot 0: [None], position -1)."""
  t = order_BT.shape[1]
  prev_pos = jnp.take_along_axis(order_BT, jnp.clip(slots_BW - 1, 0, t - 1), axis=1)
  prev_pos = jnp.where(slots_BW == 0, -1, prev_pos)
  prev_tok = jnp.take_along_axis(tokens_BT, jnp.maximum(prev_pos, 0), axis=1)
  return prev_tok, prev_pos


def _chunk_masks(plan: Plan, n: jax.Array, c: jax.Array, cache_len: int) -> dict:
  """Attention masks of one chunk (real slots c.., then phantoms) over itself and the cache."""
  w_r, w = plan.real_width, plan.real_width + plan.phantom_width
  j = jnp.arange(w)
  is_real = j < w_r
  real_slot = jnp.where(is_real, c + j, plan.counts[-1] + 1)
  # A real query sees the real keys up to itself; a phantom, the real keys before slot n, and itself.
  new = jnp.where(is_real[:, None], is_real[None, :] & (j[None, :] <= j[:, None]),
                  (real_slot[None, :] < n) | (j[None, :] == j[:, None]))
  return {"new": new,
          "cache": jnp.broadcast_to(jnp.arange(cache_len)[None, :] < c, (w, cache_len))}


@functools.lru_cache(maxsize=32)
def _decoder(cfg_json: str, plan: Plan, order_mode: str, use_filter: bool, use_cache: bool,
             return_logits: bool, top_p_rule: str = "authors", vocab_limit: Optional[int] = None):
  """The jitted decode loop for one (model, plan): compiled once per batch shape."""
  cfg = ml_collections.ConfigDict(json.loads(cfg_json))
  model = model_lib.make_model(cfg, decode=True)
  t, v = cfg.block_size, cfg.vocab_size
  dtype = model_lib.DTYPES[cfg.dtype]
  counts = jnp.asarray(plan.counts, jnp.int32)
  starts = jnp.asarray(plan.starts, jnp.int32)
  w_r, w_p = plan.real_width, plan.phantom_width
  known = plan.counts[0]

  def run(params, tokens_BT, known_BT, key, temperature, top_p, top_k):
    b = tokens_BT.shape[0]
    k_order, k_steps = jax.random.split(key)
    order_BT = make_orders(k_order, known_BT, order_mode)
    apply = lambda *args: model.apply({"params": params}, *args, method=_embed_stack)
    cache = prefilled_cache(apply, cfg, tokens_BT, order_BT, known) if use_cache else None

    def step(i, carry, cache_len):
      tokens_BT, cache, logits_BTV = carry
      n, n_next, c = counts[i], counts[i + 1], starts[i]
      real_W = c + jnp.arange(w_r)
      slots_W = jnp.concatenate([jnp.minimum(real_W, n), jnp.full((w_p,), n)])
      targets_W = jnp.minimum(jnp.concatenate([real_W, n + 1 + jnp.arange(w_p)]), t - 1)
      prev_tok, prev_pos = _slot_inputs(tokens_BT, order_BT, jnp.broadcast_to(slots_W, (b, w_r + w_p)))
      target_pos = jnp.take(order_BT, targets_W, axis=1)
      masks = _chunk_masks(plan, n, c, cache_len)
      if use_cache:
        hidden, cond, kv = apply(prev_tok, prev_pos, target_pos, cache, masks)  # reads cache_len
      else:
        hidden, cond, kv = apply(prev_tok, prev_pos, target_pos, None, {"new": masks["new"]})
      if use_cache:  # the real slots' K/V join the cache; padding rows are dropped
        write = jnp.where(real_W <= n, real_W, t)
        cache = {name: cache[name].at[:, :, :, write].set(
            kv[name][:, :, :w_r].transpose(0, 1, 3, 2, 4).astype(dtype), mode="drop")
                 for name in cache}
      rows_Q = jnp.concatenate([(n - c)[None], w_r + jnp.arange(w_p)])  # slot n, then phantoms
      h_BQD = jnp.take(hidden, rows_Q, axis=1)
      cond_Q = None if cond is None else (cond[0], jnp.take(cond[1], rows_Q, axis=1))
      logits_BQV = model.apply({"params": params}, h_BQD, cond_Q, method="logits")
      picked_BQ = sample_tokens(jax.random.fold_in(k_steps, i), logits_BQV.reshape(-1, v),
                                temperature, top_p, top_k, use_filter, top_p_rule,
                                vocab_limit).reshape(b, 1 + w_p)
      q_slots = n + jnp.arange(1 + w_p)
      pos_BQ = jnp.take(order_BT, jnp.minimum(q_slots, t - 1), axis=1)
      pos_BQ = jnp.where(q_slots < n_next, pos_BQ, t)  # padding queries write nothing
      rows_B1 = jnp.arange(b)[:, None]
      tokens_BT = tokens_BT.at[rows_B1, pos_BQ].set(picked_BQ, mode="drop")
      if return_logits:
        logits_BTV = logits_BTV.at[rows_B1, pos_BQ].set(logits_BQV, mode="drop")
      return tokens_BT, cache, logits_BTV

    tokens_BT = jnp.where(known_BT, tokens_BT, 0)
    logits_BTV = jnp.zeros((b, t, v), jnp.float32) if return_logits else None
    carry = (tokens_BT, cache, logits_BTV)
    for first, end, cache_len in plan.segments:
      carry = jax.lax.fori_loop(first, end, functools.partial(step, cache_len=cache_len), carry)
    tokens_BT, _, logits_BTV = carry
    return tokens_BT, order_BT, logits_BTV

  return jax.jit(run)


@dataclasses.dataclass
class SampleOutput:
  tokens: np.ndarray  # [B, T] int32
  order: np.ndarray  # [B, T] int32: the generation order (known positions first)
  logits: Optional[np.ndarray] = None  # [B, T, V] float32: logits each position was drawn from
  stats: Optional[dict] = None  # mode-specific counts (speculative: forwards, accepted per row)


def default_order(order: Optional[str], num_known: int) -> str:
  """`order`, or for None the authors' choice: with known tokens (a prompt or infill context)
  the unknown positions left to right, as their `cond_generate` (its random permutation is
  commented out); without, a random order, as their `generate`."""
  if order is None:
    return "l2r" if num_known else "random"
  return order


def validate_sampling_args(steps: int, temperature: float, top_p: float, top_k: int,
                           order: Optional[str], top_p_rule: str = "authors",
                           schedule: str = "linear") -> None:
  """One clear ValueError per bad sampling argument (order None: default_order)."""
  if int(steps) < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r}; accepted: {', '.join(SCHEDULES)}")
  if not temperature >= 0:
    raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy)")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p} must be in (0, 1]")
  if int(top_k) < 0:
    raise ValueError(f"top_k={top_k} must be >= 0 (0 is off)")
  if order is not None and order not in ORDER_MODES:
    raise ValueError(f"order={order!r}; accepted: {', '.join(ORDER_MODES)}")
  if top_p_rule not in TOP_P_RULES:
    raise ValueError(f"top_p_rule={top_p_rule!r}; accepted: {', '.join(TOP_P_RULES)}")


def known_arrays(t: int, batch: int, positions: Any = (), token_ids: Any = ()) -> tuple:
  """[B, T] known tokens and mask from positions and ids shared by the batch."""
  positions = [int(p) for p in positions]
  token_ids = [int(x) for x in token_ids]
  if len(positions) != len(token_ids):
    raise ValueError(f"{len(positions)} known positions but {len(token_ids)} known tokens")
  if len(positions) >= t:
    raise ValueError(f"{len(positions)} known tokens do not fit in T={t} positions with at "
                     f"least one left to generate (the prompt is too long)")
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


def known_inputs(cfg: ml_collections.ConfigDict, batch: int, positions: Any, token_ids: Any,
                 vocab_limit: Optional[int]) -> tuple:
  """known_arrays for a model config, refusing ids outside its vocab or at/above vocab_limit."""
  tokens, mask = known_arrays(cfg.block_size, batch, positions, token_ids)
  if np.any((tokens < 0) | (tokens >= cfg.vocab_size)):
    raise ValueError(f"known token ids must be in [0, {cfg.vocab_size})")
  if vocab_limit is not None and not 0 < vocab_limit <= cfg.vocab_size:
    raise ValueError(f"vocab_limit={vocab_limit} must be in [1, {cfg.vocab_size}]")
  if vocab_limit is not None and np.any(tokens[mask] >= vocab_limit):
    raise ValueError(f"known token ids must be below vocab_limit={vocab_limit}")
  return tokens, mask


def sample(params: Any, cfg: ml_collections.ConfigDict, *, batch_size: int, steps: int,
           schedule: str = "linear", temperature: float = 1.0, top_p: float = 1.0,
           top_k: int = 0, seed: int = 0, known_positions: Any = (), known_tokens: Any = (),
           order: Optional[str] = None, use_cache: bool = True, return_logits: bool = False,
           top_p_rule: str = "authors", vocab_limit: Optional[int] = None) -> SampleOutput:
  """Generate [batch_size, T] token ids in `steps` parallel steps (model config `cfg`).

  Known tokens (a prompt or infill context, shared by the batch) come first in the order and are
  never changed; the rest are decoded at random or left to right (order="random" or "l2r"; None:
  left to right with known tokens, random without, see default_order). temperature=0 is greedy.
  use_cache=False recomputes every real slot at every step (the encoder-only cost model).
  vocab_limit: the tokenizer's vocab size when the model's is padded; larger ids are never drawn.
  """
  validate_sampling_args(steps, temperature, top_p, top_k, order, top_p_rule, schedule)
  t = cfg.block_size
  tokens, mask = known_inputs(cfg, batch_size, known_positions, known_tokens, vocab_limit)
  order = default_order(order, int(mask[0].sum()))
  plan = Plan.make(schedule_counts(t, int(mask[0].sum()), int(steps), schedule), use_cache)
  decode = _decoder(cfg.to_json(), plan, order, top_p < 1 or top_k > 0, use_cache, return_logits,
                    top_p_rule, vocab_limit)
  out = decode(params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(seed),
               jnp.float32(temperature), jnp.float32(top_p), jnp.int32(top_k))
  tokens_BT, order_BT, logits_BTV = jax.device_get(out)
  return SampleOutput(tokens_BT, order_BT, logits_BTV)


MASK = "[MASK]"


def layout_known(encode: Any, t: int, prompt: str = "", infill: str = "",
                 span: int = 8) -> tuple[list, list]:
  """Known (positions, token ids) for a prefix prompt or an infill text with [MASK] spans.

  Each [MASK] leaves `span` positions to generate; everything after the text is generated too.
  """
  if prompt and infill:
    raise ValueError("give either a prompt or an infill text, not both")
  if span < 1:
    raise ValueError(f"infill span={span} must be >= 1")
  if infill and MASK not in infill:
    raise ValueError(f"the infill text has no {MASK} to fill in; give e.g. --infill='a {MASK} "
                     "b', or --prompt=TEXT to continue a text")
  pieces = infill.split(MASK) if infill else [prompt] if prompt else []
  positions, ids, cursor = [], [], 0
  for i, piece in enumerate(pieces):
    piece_ids = encode(piece) if piece else []
    positions += range(cursor, cursor + len(piece_ids))
    ids += piece_ids
    cursor += len(piece_ids) + (span if i < len(pieces) - 1 else 0)
  if cursor >= t and infill:
    raise ValueError(f"the infill text and its {len(pieces) - 1} [MASK] span(s) of "
                     f"--infill_span={span} take {cursor} positions, but T={t}; use a smaller "
                     "--infill_span or a shorter text")
  if cursor >= t:
    raise ValueError(f"the prompt takes {cursor} positions but T={t}; the prompt is too long "
                     "(at least one position must be left to generate)")
  return positions, ids


def decode_text(decode: Any, ids: Any, eos_id: int, vocab_size: int) -> str:
  """Text of generated ids: documents split at EOS, ids beyond the tokenizer's vocab dropped."""
  docs, current = [], []
  for i in ids:
    if i == eos_id:
      docs.append(current)
      current = []
    elif i < vocab_size:
      current.append(int(i))
  docs.append(current)
  return "\n\n".join(decode(d) for d in docs)


def mark_generated(decode: Any, ids: Any, known: Any, eos_id: int, vocab_size: int) -> str:
  """The text with every run of generated tokens in [[ ]]; known tokens (prompt, infill
  context) as they are: shows what the model filled in."""
  pieces = []
  for generated, run in itertools.groupby(range(len(ids)), key=lambda i: not known[i]):
    text = decode_text(decode, [ids[i] for i in run], eos_id, vocab_size)
    pieces.append(f"[[{text}]]" if generated else text)
  return "".join(pieces)
