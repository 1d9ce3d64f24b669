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
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import common, options

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


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static shape of one decode loop: counts per step and the padded chunk widths."""

  counts: tuple  # n_0 .. n_S
  starts: tuple  # first real slot of each step's chunk
  real_width: int  # W_r: real slots per chunk
  phantom_width: int  # W_p: phantom slots per chunk
  segments: tuple  # (first step, end step, cache length read): attention skips the empty tail

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
    # Step i reads cache slots < starts[i]: CACHE_BUCKETS loops, one per cache length read.
    return Plan(
      counts, starts, int(real), int(k.max()) - 1, common.bucket_segments(starts, t, CACHE_BUCKETS)
    )


def _chunk_masks(plan: Plan, n: jax.Array, c: jax.Array, cache_len: int) -> dict:
  """Attention masks of one chunk (real slots c.., then phantoms) over itself and the cache."""
  w_r, w = plan.real_width, plan.real_width + plan.phantom_width
  j = jnp.arange(w)
  is_real = j < w_r
  real_slot = jnp.where(is_real, c + j, plan.counts[-1] + 1)
  # A real query sees the real keys up to itself; a phantom, the real keys before slot n and itself.
  new = jnp.where(
    is_real[:, None],
    is_real[None, :] & (j[None, :] <= j[:, None]),
    (real_slot[None, :] < n) | (j[None, :] == j[:, None]),
  )
  return {"new": new, "cache": jnp.broadcast_to(jnp.arange(cache_len)[None, :] < c, (w, cache_len))}


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


class Carry(NamedTuple):
  """The decode loop's state between steps."""

  tokens_BT: jax.Array
  cache: dict | None
  logits_BTV: jax.Array | None
  forwards_B: jax.Array  # steps each row took part in before it was done


@functools.lru_cache(maxsize=32)
def decoder(spec: DecoderSpec):
  """The jitted decode loop of a spec: run(params, tokens, known, key, temperature, top_p,
  top_k) -> (tokens, order, logits, forwards); compiled once per batch shape."""
  cfg, plan = spec.model, spec.plan
  model = model_lib.make_model(cfg, decode=True)
  t, v = cfg.block_size, cfg.vocab_size
  counts = jnp.asarray(plan.counts, jnp.int32)
  starts = jnp.asarray(plan.starts, jnp.int32)
  w_r, w_p = plan.real_width, plan.phantom_width
  known = plan.counts[0]
  # A row is done before step i when an EOS sits at order slots [known, bound_i): the slots of
  # the blocks before step i's, or (L2R) every slot already decoded.
  block = spec.block_len or t
  bounds = jnp.asarray(
    [n if spec.order == "l2r" else known + (n - known) // block * block for n in plan.counts[:-1]],
    jnp.int32,
  )

  def run(params, tokens_BT, known_BT, key, temperature, top_p, top_k):
    b = tokens_BT.shape[0]
    k_order, k_steps = jax.random.split(key)
    draw = common.Draw(temperature, top_p, top_k, spec.draw)
    order_BT = common.make_orders(k_order, known_BT, spec.order, spec.block_len, plan.counts[-1])
    apply = common.stack_fn(model, params)
    cache = (
      common.prefilled_cache(apply, cfg, tokens_BT, order_BT, known) if spec.use_cache else None
    )

    def step(i, carry: Carry, cache_len: int) -> Carry:
      tokens_BT, cache, logits_BTV, forwards_B = carry
      n, n_next, c = counts[i], counts[i + 1], starts[i]
      real_R = c + jnp.arange(w_r)
      slots_W = jnp.concatenate([jnp.minimum(real_R, n), jnp.full((w_p,), n)])
      targets_W = jnp.minimum(jnp.concatenate([real_R, n + 1 + jnp.arange(w_p)]), t - 1)
      prev_tok, prev_pos = common.slot_inputs(
        tokens_BT, order_BT, jnp.broadcast_to(slots_W, (b, w_r + w_p))
      )
      target_pos = jnp.take(order_BT, targets_W, axis=1)
      masks = _chunk_masks(plan, n, c, cache_len)
      if spec.use_cache:
        hidden, cond, kv = apply(prev_tok, prev_pos, target_pos, cache, masks)  # reads cache_len
      else:
        hidden, cond, kv = apply(prev_tok, prev_pos, target_pos, None, {"new": masks["new"]})
      if cache is not None:  # the real slots' K/V join the cache; padding rows are dropped
        cache = common.write_cache(cache, kv, jnp.where(real_R <= n, real_R, t))
      rows_Q = jnp.concatenate([(n - c)[None], w_r + jnp.arange(w_p)])  # slot n, then phantoms
      h_BQD = jnp.take(hidden, rows_Q, axis=1)
      cond_Q = None if cond is None else (cond[0], jnp.take(cond[1], rows_Q, axis=1))
      logits_BQV = cast(jax.Array, model.apply({"params": params}, h_BQD, cond_Q, method="logits"))
      picked_BQ = draw.tokens(jax.random.fold_in(k_steps, i), logits_BQV.reshape(-1, v)).reshape(
        b, 1 + w_p
      )
      q_slots = n + jnp.arange(1 + w_p)
      pos_BQ = jnp.take(order_BT, jnp.minimum(q_slots, t - 1), axis=1)
      pos_BQ = jnp.where(q_slots < n_next, pos_BQ, t)  # padding queries write nothing
      rows_B1 = jnp.arange(b)[:, None]
      tokens_BT = tokens_BT.at[rows_B1, pos_BQ].set(picked_BQ, mode="drop")
      if logits_BTV is not None:  # spec.return_logits
        logits_BTV = logits_BTV.at[rows_B1, pos_BQ].set(logits_BQV, mode="drop")
      return Carry(tokens_BT, cache, logits_BTV, forwards_B)

    def counted_step(i, carry: Carry, cache_len: int) -> Carry:
      """step i for the rows not done (with eos_id: nothing once every row is done)."""
      done_B = jnp.zeros((b,), bool)
      if spec.eos_id is not None:
        slots_T = jnp.arange(t)
        eos_BT = jnp.take_along_axis(carry.tokens_BT, order_BT, axis=1) == spec.eos_id
        done_B = jnp.any(eos_BT & (slots_T >= known) & (slots_T < bounds[i]), axis=1)
      carry = carry._replace(forwards_B=carry.forwards_B + ~done_B)
      if spec.eos_id is None:
        return step(i, carry, cache_len)
      return jax.lax.cond(jnp.all(done_B), lambda c: c, lambda c: step(i, c, cache_len), carry)

    logits_BTV = jnp.zeros((b, t, v), jnp.float32) if spec.return_logits else None
    carry = Carry(jnp.where(known_BT, tokens_BT, 0), cache, logits_BTV, jnp.zeros((b,), jnp.int32))
    for first, end, cache_len in plan.segments:
      carry = jax.lax.fori_loop(
        first, end, functools.partial(counted_step, cache_len=cache_len), carry
      )
    return carry.tokens_BT, order_BT, carry.logits_BTV, carry.forwards_B

  return jax.jit(run)


def default_order(order: str | None, num_known: int) -> str:
  """`order`, or for None the authors' choice: with known tokens (a prompt or infill context)
  the unknown positions left to right, as their `cond_generate` (its random permutation is
  commented out); without, a random order, as their `generate`."""
  if order is None:
    return "l2r" if num_known else "random"
  return order


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
  left to right with known tokens, random without, see default_order). temperature=0 is greedy.
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
  order = default_order(order, known)
  block_len = None if block_len is None else int(block_len)
  plan = Plan.make(block_counts(end, known, int(steps), schedule, block_len), use_cache)
  decode = decoder(
    DecoderSpec(
      cfg,
      plan,
      order,
      common.DrawRule.of(top_p, top_k, top_p_rule, vocab_limit),
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
  tokens_BT, order_BT, logits_BTV, forwards_B = jax.device_get(out)
  stats = None
  if eos_id is not None:
    stats = {
      "forwards": np.asarray(forwards_B),
      "length": common.eos_lengths(tokens_BT, known, int(eos_id)),
    }
  return common.SampleOutput(tokens_BT, order_BT, logits_BTV, stats)
