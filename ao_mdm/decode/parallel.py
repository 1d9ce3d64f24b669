"""Parallel multi-token decoding with a KV cache (docs/design.md, "Sampling"), one jitted loop.

Step i turns the known count n_{i-1} into n_i. Its chunk holds the real slots whose inputs became
known in the previous step (their K/V go into the cache), the last of which (slot n_{i-1}) is the
first query, plus one phantom slot per extra target: a copy of slot n_{i-1}'s input with its own
target. Each query sees the cached slots, the earlier real slots of the chunk, and itself.

With `block_len` the unknown positions are decoded in blocks left to right (any order inside a
block, the steps spread over the blocks by their sizes), and with `eos_id` the loop stops after
the block that holds a row's first EOS once every row has one (docs/sampling.md, "Until EOS").
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import specs
from ao_mdm.decode import common, engine, options, policies

CACHE_BUCKETS = 4  # decode loops, each reading only the cache prefix its steps can see


def schedule_counts(t: int, known: int, steps: int, schedule: str) -> np.ndarray:
  """Cumulative known counts n_0 = P, ..., n_S = T after each of S steps, as the authors count.

  Their model_AOGPT_generate.py (`generate`, `cond_generate`): time = torch.linspace(1, 0, S + 1)
  in float32, cosine maps it to cos((1 - time) * pi * 0.5), and step i reveals up to
  n_i = max(P + int((T - P) * (1 - time_i)), n_{i-1} + 1), every operation in float32 and int()
  truncating; T is our block_size where they write 1024. With P = 0 this is their `generate`.
  """
  options.check_choice("schedule", schedule, options.SCHEDULES)
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
  time = np.where(
    j < (steps + 1) // 2, (step * j + 1.0).astype(f32), (-(step * (steps - j))).astype(f32)
  )
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


def block_counts(
  t: int, known: int, steps: int, schedule: str, block_len: int | None = None
) -> np.ndarray:
  """schedule_counts for the unknown positions in blocks of `block_len` (None: one block), left to
  right: block j of l_j positions gets floor(S e_j / U) - floor(S e_{j-1} / U) of the S steps
  (e_j: the unknown positions up to its end, U: all of them), at least one each, S in all, and
  counts by the schedule inside it (schedule_counts with T = l_j)."""
  options.check_block_len(block_len)
  unknown = t - known
  if block_len is None or block_len >= unknown:
    return schedule_counts(t, known, steps, schedule)
  ends = list(range(block_len, unknown, block_len)) + [unknown]
  if not len(ends) <= steps <= unknown:
    raise ValueError(
      f"steps={steps} must be in [{len(ends)}, {unknown}]: the {unknown} unknown "
      f"positions make {len(ends)} blocks of block_len={block_len}, each decoded "
      "in at least one step (give more steps or a larger block_len)"
    )
  counts, start, done = [known], 0, 0
  for end in ends:
    block_steps = steps * end // unknown - done
    done += block_steps
    inner = schedule_counts(end - start, 0, block_steps, schedule)
    counts += (known + start + inner[1:]).tolist()
    start = end
  return np.asarray(counts, np.int32)


def steps_within(
  t: int, known: int, per_step: int, schedule: str = "linear", block_len: int | None = None
) -> int:
  """The fewest steps (block_counts) that commit no more than per_step tokens in any step: an
  even split of the unknown positions, or one step more where the schedule's float32 rounding
  would put per_step + 1 tokens in a step."""
  unknown = t - known
  blocks = -(-unknown // block_len) if block_len and block_len < unknown else 1
  widest = lambda steps: np.diff(block_counts(t, known, steps, schedule, block_len)).max()
  steps = max(-(-unknown // per_step), blocks)
  while steps < unknown and widest(steps) > per_step:
    steps += 1
  return steps


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static shape of one decode loop: counts per step and the padded chunk widths."""

  counts: tuple  # n_0 .. n_S
  starts: tuple  # first real slot of each step's chunk
  real_width: int  # W_r: real slots per chunk
  phantom_width: int  # W_p: phantom slots per chunk
  segments: tuple  # (first step, end step, cache length held and read): skips the empty tail

  @staticmethod
  def make(step_counts: np.ndarray, use_cache: bool = True) -> "Plan":
    counts = tuple(int(n) for n in step_counts)
    t = counts[-1]
    k = np.diff(counts)
    if use_cache:
      starts = (counts[0],) + tuple(n + 1 for n in counts[:-2])
      real = max(n - c + 1 for n, c in zip(counts[:-1], starts))
    else:  # every step recomputes all real slots: the encoder-only cost model
      starts, real = (0,) * len(k), t
    # Step i reads cache slots < starts[i] and writes those up to counts[i]: CACHE_BUCKETS
    # loops, each with a cache of the length its steps read and write.
    held = [n + 1 for n in counts[:-1]] if use_cache else starts
    return Plan(
      counts, starts, int(real), int(k.max()) - 1, common.bucket_segments(held, t, CACHE_BUCKETS)
    )


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
  """What one jitted decode loop is made for (hashable: the key of its cache)."""

  model: specs.ModelSpec
  plan: Plan
  order: str  # of the unknown positions: "random" or "l2r"
  draw: common.DrawRule = common.DrawRule()
  use_cache: bool = True  # False: every real slot recomputed at every step
  return_logits: bool = False
  block_len: int | None = None  # unknown positions per block (None: one block)
  eos_id: int | None = None  # stop after the block holding each row's first EOS


class PlanRows(NamedTuple):
  """The parallel policy's state per row: its plan (counts n_0..n_S, padded with n_S) and where
  it is in it."""

  counts_BS: jax.Array
  bounds_BS: jax.Array  # a row is done before step i when an EOS sits at order slots [known, bound)
  step_B: jax.Array


class State(NamedTuple):
  """The decode state between steps: the rows, the cache, the policy's per-row plans."""

  rows: engine.Rows
  cache: engine.KVCache | None
  plan: PlanRows
  logits_BTV: jax.Array | None


def plan_rows(spec: DecoderSpec, counts: Any, known: int, steps: int) -> tuple:
  """(counts, bounds) of one row's plan padded to `steps` steps: the EOS check's bound before
  each step is the end of the blocks before it (L2R: every slot decoded)."""
  block = spec.block_len or spec.model.block_size
  counts = list(counts) + [counts[-1]] * (steps + 1 - len(counts))
  bounds = [n if spec.order == "l2r" else known + (n - known) // block * block for n in counts]
  return counts, bounds


def empty(spec: DecoderSpec, batch: int, steps: int, cache_len: int | None = None) -> State:
  """A state of `batch` free rows, whose plans may have up to `steps` steps, and a cache of
  cache_len slots (default T)."""
  b, t, v = batch, spec.model.block_size, spec.model.vocab_size
  zeros_BT, zeros_B = jnp.zeros((b, t), jnp.int32), jnp.zeros((b,), jnp.int32)
  rows = engine.new_rows(
    zeros_BT,
    zeros_BT,
    zeros_B,
    engine.row_keys(jax.random.key(0), b),
    jnp.zeros((b,), jnp.float32),
    jnp.zeros((b,), jnp.float32),
    zeros_B,
  )._replace(active_B=jnp.zeros((b,), bool))
  cache = engine.KVCache.empty(spec.model, b, cache_len) if spec.use_cache else None
  zeros_BS = jnp.zeros((b, steps + 1), jnp.int32)
  logits_BTV = jnp.zeros((b, t, v), jnp.float32) if spec.return_logits else None
  return State(rows, cache, PlanRows(zeros_BS, zeros_BS, zeros_B), logits_BTV)


def insert(
  spec: DecoderSpec,
  dm: engine.DecodeModel,
  params: Any,
  s: State,
  rows_R: jax.Array,
  tokens_RT: jax.Array,
  order_RT: jax.Array,
  counts_RS: jax.Array,
  bounds_RS: jax.Array,
  keys_R: jax.Array,
  draw_R: tuple,
  width: int,
  prefix: tuple | None = None,
  cache_len: int = 0,
) -> State:
  """The state with rows rows_R starting new requests: their tokens (the known ones at the
  first counts_RS[:, 0] slots of their orders), plans, draw keys and settings (temperature,
  top_p, top_k per row); each row's known slots are prefilled by one forward of `width` >= its
  known count slots. prefix (start_R, stored): each row's slots before start_R are copied from
  `stored`, a KVCache of R rows (KVCache.with_prefix), and the forward starts there (reading
  cache_len)."""
  known_R = counts_RS[:, 0]
  new = engine.new_rows(tokens_RT, order_RT, known_R, keys_R, *draw_R)
  put = lambda old, x: old.at[rows_R].set(x)
  rows = jax.tree.map(put, s.rows, new)
  cache = s.cache
  if cache is not None and prefix is not None:
    start_R, stored = prefix
    cache = cache.with_prefix(rows_R, start_R, stored)
    cache = dm.prefill(
      params, cache, tokens_RT, order_RT, known_R, width, rows_R, start_R, cache_len
    )
  elif cache is not None:
    cache = dm.prefill(params, cache, tokens_RT, order_RT, known_R, width, rows_R)
  else:
    rows = rows._replace(cached_B=rows.cached_B.at[rows_R].set(0))
  plan = PlanRows(
    put(s.plan.counts_BS, counts_RS),
    put(s.plan.bounds_BS, bounds_RS),
    put(s.plan.step_B, jnp.zeros_like(known_R)),
  )
  logits_BTV = None if s.logits_BTV is None else s.logits_BTV.at[rows_R].set(0.0)
  return State(rows, cache, plan, logits_BTV)


def step(spec: DecoderSpec, dm: engine.DecodeModel, params: Any, s: State, cache_len: int) -> State:
  """One parallel step of every active row: its real slots from the cached count to n (their
  K/V join the cache), then one phantom per extra target (a copy of slot n's input); slot n and
  the phantoms draw the tokens of order slots n .. n_next - 1."""
  rows, plan = s.rows, s.plan
  tokens_BT, order_BT = rows.tokens_BT, rows.order_BT
  b, t = tokens_BT.shape
  w_r, w_p = spec.plan.real_width, spec.plan.phantom_width
  at = lambda x_BS, i_B: jnp.take_along_axis(x_BS, i_B[:, None], axis=1)[:, 0]
  i_B, n_B = plan.step_B, rows.filled_B
  n_next_B = at(plan.counts_BS, jnp.minimum(i_B + 1, plan.counts_BS.shape[1] - 1))
  active_B = rows.active_B
  c_B = rows.cached_B  # stays 0 without a cache (insert): every real slot is recomputed
  real_BR = c_B[:, None] + jnp.arange(w_r)
  n_B1 = n_B[:, None]
  tok, pos = engine.slot_inputs(
    tokens_BT, order_BT, jnp.concatenate([jnp.minimum(real_BR, n_B1), jnp.repeat(n_B1, w_p, 1)], 1)
  )
  targets = jnp.minimum(jnp.concatenate([real_BR, n_B1 + 1 + jnp.arange(w_p)], 1), t - 1)
  sees = jnp.concatenate(
    [jnp.broadcast_to(jnp.arange(w_r), (b, w_r)), jnp.repeat((n_B - c_B)[:, None], w_p, 1)], 1
  )
  chunk = engine.Chunk(tok, pos, jnp.take_along_axis(order_BT, targets, 1), sees, c_B)
  # The real slots' K/V join the cache (hidden from this step's queries there); padding columns
  # are dropped.
  write_BR = jnp.where((real_BR <= n_B1) & active_B[:, None], real_BR, t)
  cols_BQ = jnp.concatenate(
    [(n_B - c_B)[:, None], jnp.broadcast_to(w_r + jnp.arange(w_p), (b, w_p))], 1
  )
  hidden, cond, _, cache = dm.forward(
    params, s.cache, chunk, cache_len if s.cache is not None else None, write_BR, cols_BQ
  )
  logits_BQV = dm.logits(params, hidden, cond)
  tok_BQ, lp_BQ, raw_BQ = engine.draw(rows, spec.draw, logits_BQV, i_B)
  q_slots = n_B1 + jnp.arange(1 + w_p)
  live = (q_slots < n_next_B[:, None]) & active_B[:, None]  # padding queries write nothing
  pos_BQ = jnp.where(live, jnp.take_along_axis(order_BT, jnp.minimum(q_slots, t - 1), 1), t)
  rows = engine.commit(rows, pos_BQ, tok_BQ, lp_BQ, raw_BQ, i_B)
  logits_BTV = s.logits_BTV
  if logits_BTV is not None:  # spec.return_logits
    logits_BTV = logits_BTV.at[jnp.arange(b)[:, None], pos_BQ].set(logits_BQV, mode="drop")
  filled_B = jnp.where(active_B, n_next_B, n_B)
  rows = rows._replace(
    filled_B=filled_B,
    cached_B=jnp.where(active_B & spec.use_cache, n_B + 1, rows.cached_B),
    active_B=active_B & (filled_B < plan.counts_BS[:, -1]),
    forwards_B=rows.forwards_B + active_B,
  )
  plan = plan._replace(step_B=i_B + active_B)
  if spec.eos_id is not None:  # done once an EOS sits in a block before the next step's
    slot_1T = jnp.arange(t)[None, :]
    eos_BT = jnp.take_along_axis(rows.tokens_BT, order_BT, axis=1) == spec.eos_id
    bound_B1 = at(plan.bounds_BS, plan.step_B)[:, None]
    known_B1 = plan.counts_BS[:, :1]
    done_B = jnp.any(eos_BT & (slot_1T >= known_B1) & (slot_1T < bound_B1), 1)
    rows = rows._replace(active_B=rows.active_B & ~done_B)
  return State(rows, cache, plan, logits_BTV)


def request_keys(key: jax.Array, known_BT: jax.Array, spec: DecoderSpec, end: int) -> tuple:
  """(orders, per-row draw keys) of a batch drawn with `key`: the orders from one split of it
  (common.make_orders of the batch), row r's draws from fold_in(the other, r)."""
  k_order, k_steps = jax.random.split(key)
  order_BT = common.make_orders(k_order, known_BT, spec.order, spec.block_len, end)
  return order_BT, engine.row_keys(k_steps, known_BT.shape[0])


@functools.lru_cache(maxsize=32)
def decoder(spec: DecoderSpec):
  """The jitted decode loop of a spec: run(params, tokens, known, key, temperature, top_p,
  top_k) -> State after every step; compiled once per batch shape."""
  dm = engine.DecodeModel.of(spec.model)

  def run(params, tokens_BT, known_BT, key, temperature, top_p, top_k):
    b = tokens_BT.shape[0]
    plan = spec.plan
    known, steps = plan.counts[0], len(plan.counts) - 1
    counts, bounds = plan_rows(spec, plan.counts, known, steps)
    rows = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (b, len(x)))
    full = lambda x: jnp.full((b,), x)
    order_BT, keys_B = request_keys(key, known_BT, spec, plan.counts[-1])
    draw_B = (full(temperature), full(top_p), full(top_k))
    tokens_BT = jnp.where(known_BT, tokens_BT, 0)
    s = empty(spec, b, steps, spec.plan.segments[0][2])
    s = insert(
      spec,
      dm,
      params,
      s,
      jnp.arange(b),
      tokens_BT,
      order_BT,
      rows(counts),
      rows(bounds),
      keys_B,
      draw_B,
      known,
    )
    if spec.use_cache:
      params = dm.loop_params(params)
    for first, end, cache_len in spec.plan.segments:
      if s.cache is not None:
        s = s._replace(cache=s.cache.grown(cache_len))
      body = lambda i, s, cache_len=cache_len: step(spec, dm, params, s, cache_len)
      if spec.eos_id is not None:  # nothing to do once every row is done
        body = lambda i, s, cache_len=cache_len: jax.lax.cond(
          jnp.any(s.rows.active_B), lambda s: step(spec, dm, params, s, cache_len), lambda s: s, s
        )
      s = jax.lax.fori_loop(first, end, body, s)
    return s

  return jax.jit(run)


def sample(
  params: Any,
  cfg: specs.ModelSpec,
  *,
  batch_size: int,
  steps: int,
  schedule: str = "linear",
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  seed: int = 0,
  known_positions: Any = (),
  known_tokens: Any = (),
  order: str | None = None,
  use_cache: bool = True,
  return_logits: bool = False,
  top_p_rule: str = "authors",
  vocab_limit: int | None = None,
  dtype: str = "float32",
  block_len: int | None = None,
  eos_id: int | None = None,
  end: int | None = None,
) -> common.SampleOutput:
  """Generate [batch_size, T] token ids in `steps` parallel steps (model config `cfg`).

  Known tokens (a prompt or infill context, shared by the batch) come first in the order and are
  never changed; the rest are decoded at random or left to right (order="random" or "l2r"; None:
  left to right with known tokens, random without: policies.authors_order). temperature=0 is greedy.
  use_cache=False recomputes every real slot at every step (the encoder-only cost model).
  vocab_limit: the tokenizer's vocab size when the model's is padded; larger ids are never drawn.
  block_len: decode the unknown positions in blocks of that many, left to right, in `order`
  inside each (block_counts spreads the steps). eos_id: a row is done after the block that holds
  its first EOS after the known tokens (in L2R order: after the step), and the loop runs no
  further step once every row is done; then `stats` holds per row the steps it took part in
  ("forwards") and its "length", the tokens up to and including that EOS (T without one); the
  tokens after it are not meaningful. Known tokens must then be a prefix (a prompt).
  end: only the positions before it are drawn (the steps spread over them); the later ones are
  last in the order, never drawn, and 0 in the output (an infill that ends at its text).
  """
  options.check_sampling(steps, temperature, top_p, top_k, order, top_p_rule, schedule)
  params, cfg = common.with_dtype(params, cfg, dtype)
  tokens, mask = common.known_inputs(cfg, batch_size, known_positions, known_tokens, vocab_limit)
  known = int(mask[0].sum())
  if eos_id is not None and not mask[0, :known].all():
    raise ValueError(
      "eos_id (stop at the first EOS) needs the known tokens to be a prefix "
      "(a prompt), not scattered (an infill)"
    )
  end = common.decode_end(end, mask[0])
  order = order or policies.authors_order(known)
  block_len = None if block_len is None else int(block_len)
  plan = Plan.make(block_counts(end, known, int(steps), schedule, block_len), use_cache)
  decode = decoder(
    DecoderSpec(
      cfg,
      plan,
      order,
      common.DrawRule(top_p_rule, vocab_limit),
      use_cache,
      return_logits,
      block_len,
      None if eos_id is None else int(eos_id),
    )
  )
  out = decode(
    params,
    jnp.asarray(tokens),
    jnp.asarray(mask),
    jax.random.key(seed),
    jnp.float32(temperature),
    jnp.float32(top_p),
    jnp.int32(top_k),
  )
  rows = jax.device_get(out.rows)
  tokens_BT = np.asarray(rows.tokens_BT)
  stats = None
  if eos_id is not None:
    stats = {
      "forwards": np.asarray(rows.forwards_B),
      "length": common.eos_lengths(tokens_BT, known, int(eos_id)),
    }
  logits = None if out.logits_BTV is None else np.asarray(out.logits_BTV)
  return common.SampleOutput(
    tokens_BT,
    np.asarray(rows.order_BT),
    logits,
    stats,
    **common.drawn_arrays(rows.drawn),
  )
