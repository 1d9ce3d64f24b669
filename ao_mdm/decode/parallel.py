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
from ao_mdm.decode import common, engine, options, policies, protocol, schedules


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static shape of one decode loop: counts per step and the padded chunk widths."""

  counts: tuple  # n_0 .. n_S
  starts: tuple  # first real slot of each step's chunk
  real_width: int  # W_r: real slots per chunk
  phantom_width: int  # W_p: phantom slots per chunk
  segments: tuple  # (first step, end step, cache length held and read): skips the empty tail

  @staticmethod
  def widths(real: int, phantom: int) -> "Plan":
    """The chunk widths alone: a continuous batch's, whose rows bring their own counts."""
    return Plan((), (), real, phantom, ())

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
    # Step i reads cache slots < starts[i] and writes those up to counts[i]: common.CACHE_BUCKETS
    # loops, each with a cache of the length its steps read and write.
    held = [n + 1 for n in counts[:-1]] if use_cache else starts
    return Plan(
      counts,
      starts,
      int(real),
      int(k.max()) - 1,
      common.bucket_segments(held, t, common.CACHE_BUCKETS),
    )


class RowPlan(NamedTuple):
  """One request's plan: known counts n_0..n_S after each step (padded with n_S), and before
  each step the bound of its EOS check: a row is done once an EOS sits at order slots
  [known, bound) (the end of the blocks before it; L2R: every slot decoded)."""

  counts: Any
  bounds: Any


class Fields(NamedTuple):
  """The parallel policy's state per row: its plan, where it is in it, and (return_logits) the
  logits each position was drawn from."""

  counts_BS: jax.Array
  bounds_BS: jax.Array
  step_B: jax.Array
  logits_BTV: jax.Array | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderSpec(protocol.PolicySpec):
  """The parallel policy for one model and chunk layout (hashable: the key of its programs)."""

  plan: Plan  # the chunk widths (and, for a static batch, its steps); use_cache False: every
  # real slot recomputed at every step (the encoder-only cost model)
  return_logits: bool = False

  def plan_request(
    self, known: int, end: int, steps: int, schedule: str, max_steps: int
  ) -> RowPlan:
    """A request's plan padded to max_steps steps; ValueError when it needs wider chunks."""
    counts = schedules.block_counts(end, known, steps, schedule, self.block_len)
    plan, built = Plan.make(counts), self.plan
    if (
      plan.real_width > built.real_width
      or plan.phantom_width > built.phantom_width
      or len(counts) - 1 > max_steps
    ):
      raise ValueError(
        f"{len(counts) - 1} steps of {plan.real_width} real + {plan.phantom_width} phantom "
        f"slots; this batch takes at most {max_steps} steps of {built.real_width} + "
        f"{built.phantom_width}"
      )
    return self.row_plan(counts.tolist(), max_steps)

  def row_plan(self, counts: list, max_steps: int) -> RowPlan:
    """The plan of counts n_0..n_S padded to max_steps steps, with its EOS bounds."""
    known, block = counts[0], self.block_len or self.model.block_size
    counts = [int(n) for n in counts] + [int(counts[-1])] * (max_steps + 1 - len(counts))
    bounds = [n if self.order == "l2r" else known + (n - known) // block * block for n in counts]
    return RowPlan(tuple(counts), tuple(bounds))

  def extent(self, plan: RowPlan) -> tuple:
    """(known, end, steps) of a plan."""
    return plan.counts[0], plan.counts[-1], len(plan.counts) - 1

  def fields(self, batch: int, steps: int) -> Fields:
    zeros_BS, zeros_B = jnp.zeros((batch, steps + 1), jnp.int32), jnp.zeros((batch,), jnp.int32)
    t, v = self.model.block_size, self.model.vocab_size
    logits = jnp.zeros((batch, t, v), jnp.float32) if self.return_logits else None
    return Fields(zeros_BS, zeros_BS, zeros_B, logits)

  def start(
    self, plan_R: RowPlan, order_RT: jax.Array, known_R: jax.Array, keys_R: jax.Array
  ) -> Fields:
    r, t, v = known_R.shape[0], self.model.block_size, self.model.vocab_size
    logits = jnp.zeros((r, t, v), jnp.float32) if self.return_logits else None
    return Fields(plan_R.counts, plan_R.bounds, jnp.zeros_like(known_R), logits)

  def segments(self, plan: RowPlan) -> tuple:
    made = Plan.make(np.asarray(plan.counts), self.use_cache)
    return tuple((a, b, protocol.Shape(n)) for a, b, n in made.segments)

  def needs(self, rows: engine.Rows, fields: Fields) -> tuple:
    """A step reads the cached slots and writes the real ones up to slot n."""
    return (rows.filled_B + 1,)

  def output(self, s: protocol.DecodeState, plan: RowPlan, **extra: Any) -> common.SampleOutput:
    """With return_logits, the logits each position was drawn from; with eos_id, each row's
    forwards and length (`static`)."""
    stats = None
    if self.eos_id is not None:
      length = common.eos_lengths(np.asarray(s.rows.tokens_BT), plan.counts[0], self.eos_id)
      stats = {"forwards": np.asarray(s.rows.forwards_B), "length": length}
    return super().output(s, plan, logits=s.fields.logits_BTV, stats=stats)

  def step(
    self, dm: engine.DecodeModel, params: Any, s: protocol.DecodeState, shape: protocol.Shape
  ) -> protocol.DecodeState:
    """One parallel step of every active row: its real slots from the cached count to n (their
    K/V join the cache), then one phantom per extra target (a copy of slot n's input); slot n
    and the phantoms draw the tokens of order slots n .. n_next - 1."""
    rows, plan = s.rows, s.fields
    tokens_BT, order_BT = rows.tokens_BT, rows.order_BT
    b, t = tokens_BT.shape
    w_r, w_p = self.plan.real_width, self.plan.phantom_width
    at = lambda x_BS, i_B: jnp.take_along_axis(x_BS, i_B[:, None], axis=1)[:, 0]
    i_B, n_B = plan.step_B, rows.filled_B
    n_next_B = at(plan.counts_BS, jnp.minimum(i_B + 1, plan.counts_BS.shape[1] - 1))
    active_B = rows.active_B
    c_B = rows.cached_B  # stays 0 without a cache (insert): every real slot is recomputed
    real_BR = c_B[:, None] + jnp.arange(w_r)
    n_B1 = n_B[:, None]
    tok, pos = engine.slot_inputs(
      tokens_BT,
      order_BT,
      jnp.concatenate([jnp.minimum(real_BR, n_B1), jnp.repeat(n_B1, w_p, 1)], 1),
    )
    targets = jnp.minimum(jnp.concatenate([real_BR, n_B1 + 1 + jnp.arange(w_p)], 1), t - 1)
    sees = jnp.concatenate(
      [jnp.broadcast_to(jnp.arange(w_r), (b, w_r)), jnp.repeat((n_B - c_B)[:, None], w_p, 1)], 1
    )
    chunk = engine.Chunk(tok, pos, jnp.take_along_axis(order_BT, targets, 1), sees, c_B)
    # The real slots' K/V join the cache (hidden from this step's queries there); padding
    # columns are dropped.
    write_BR = jnp.where((real_BR <= n_B1) & active_B[:, None], real_BR, t)
    cols_BQ = jnp.concatenate(
      [(n_B - c_B)[:, None], jnp.broadcast_to(w_r + jnp.arange(w_p), (b, w_p))], 1
    )
    cache_len = shape.cache_len if s.cache is not None else None
    hidden, cond, _, cache = dm.forward(params, s.cache, chunk, cache_len, write_BR, cols_BQ)
    logits_BQV = dm.logits(params, hidden, cond)
    tok_BQ, lp_BQ, raw_BQ = engine.draw(rows, self.draw, logits_BQV, i_B)
    q_slots = n_B1 + jnp.arange(1 + w_p)
    live = (q_slots < n_next_B[:, None]) & active_B[:, None]  # padding queries write nothing
    pos_BQ = jnp.where(live, jnp.take_along_axis(order_BT, jnp.minimum(q_slots, t - 1), 1), t)
    rows = engine.commit(rows, pos_BQ, tok_BQ, lp_BQ, raw_BQ, i_B)
    logits_BTV = plan.logits_BTV
    if logits_BTV is not None:  # return_logits
      logits_BTV = logits_BTV.at[jnp.arange(b)[:, None], pos_BQ].set(logits_BQV, mode="drop")
    filled_B = jnp.where(active_B, n_next_B, n_B)
    rows = rows._replace(
      filled_B=filled_B,
      cached_B=jnp.where(active_B & self.use_cache, n_B + 1, rows.cached_B),
      active_B=active_B & (filled_B < plan.counts_BS[:, -1]),
      forwards_B=rows.forwards_B + active_B,
    )
    plan = plan._replace(step_B=i_B + active_B, logits_BTV=logits_BTV)
    if self.eos_id is not None:  # done once an EOS sits in a block before the next step's
      slot_1T = jnp.arange(t)[None, :]
      eos_BT = jnp.take_along_axis(rows.tokens_BT, order_BT, axis=1) == self.eos_id
      bound_B1 = at(plan.bounds_BS, plan.step_B)[:, None]
      known_B1 = plan.counts_BS[:, :1]
      done_B = jnp.any(eos_BT & (slot_1T >= known_B1) & (slot_1T < bound_B1), 1)
      rows = rows._replace(active_B=rows.active_B & ~done_B)
    return protocol.DecodeState(rows, cache, plan)


def continuing(cfg: specs.ModelSpec, c: protocol.Continuing) -> DecoderSpec:
  """The spec of a continuous batch continuing prompts (a row done at its EOS in L2R, or after
  the block that holds it)."""
  k = c.tokens_per_step
  return DecoderSpec(
    model=cfg,
    plan=Plan.widths(k, k - 1),
    order=c.order,
    draw=common.DrawRule(vocab_limit=c.vocab_limit),
    block_len=c.block_len,
    eos_id=c.eos_id if c.order == "l2r" or c.block_len else None,
  )


def static(
  b: protocol.Batch,
  *,
  steps: int,
  schedule: str = "linear",
  order: str | None = None,
  use_cache: bool = True,
  return_logits: bool = False,
  block_len: int | None = None,
  eos_id: int | None = None,
) -> protocol.Static:
  """A static batch decoded in `steps` parallel steps (protocol.sample: `sample`).

  The unknown positions are decoded at random or left to right (order="random" or "l2r"; None:
  left to right with known tokens, random without: policies.authors_order). use_cache=False
  recomputes every real slot at every step (the encoder-only cost model); return_logits: the
  output's `logits` hold what each position was drawn from. block_len: decode the unknown
  positions in blocks of that many, left to right, in `order` inside each (block_counts spreads
  the steps). eos_id: a row is done after the block that holds its first EOS after the known
  tokens (in L2R order: after the step), and the loop runs no further step once every row is
  done; then `stats` holds per row the steps it took part in ("forwards") and its "length", the
  tokens up to and including that EOS (T without one); the tokens after it are not meaningful.
  Known tokens must then be a prefix (a prompt).
  """
  options.check_sampling(steps, order=order, schedule=schedule)
  known = int(b.known_T.sum())
  if eos_id is not None and not b.known_T[:known].all():
    raise ValueError(
      "eos_id (stop at the first EOS) needs the known tokens to be a prefix "
      "(a prompt), not scattered (an infill)"
    )
  block_len = None if block_len is None else int(block_len)
  counts = schedules.block_counts(b.end, known, int(steps), schedule, block_len)
  spec = DecoderSpec(
    model=b.cfg,
    plan=Plan.make(counts, use_cache),
    order=order or policies.authors_order(known),
    draw=b.draw,
    use_cache=use_cache,
    return_logits=return_logits,
    block_len=block_len,
    eos_id=None if eos_id is None else int(eos_id),
  )
  return protocol.Static(spec, spec.row_plan(counts.tolist(), len(counts) - 1), b.params)


sample = functools.partial(protocol.sample, static)
