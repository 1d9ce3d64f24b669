"""Confidence-ordered unmasking (docs/sampling.md): the order is chosen online, most confident
first.

Step i scores every still-unknown position (one query slot per position, each a copy of the
last known slot's input) and commits the n_i - n_{i-1} whose predictions are most confident
(highest max probability, or lowest entropy), ties broken by position. A slot's K/V depends on
its target, and the target of the last committed slot is only chosen at the next step, so the
committed slots enter the cache one step late: step i's real slots are those of step i - 1.
"""

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import specs
from ao_mdm.decode import common, engine, options, protocol, schedules

QUERY_BUCKETS = 4  # decode loops, each with a query width for the unknown positions it can have


def confidence_score(logits_NV: jax.Array, score: str) -> jax.Array:
  """Confidence of each prediction (higher is more confident), from the raw softmax."""
  logp = jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1)
  if score == "max_prob":
    return jnp.max(logp, axis=-1)
  return jnp.sum(jnp.exp(logp) * logp, axis=-1)  # minus the entropy


class RowPlan(NamedTuple):
  """One request's plan: known counts n_0..n_S after each step, padded with n_S (the end)."""

  counts: Any


class Fields(NamedTuple):
  """Per row: its plan, where it is in it, and which positions are closed (known, committed,
  or at/after its end): the rest are the candidates."""

  counts_BS: jax.Array
  step_B: jax.Array
  closed_BT: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderSpec(protocol.PolicySpec):
  """An adaptive order: each step commits the positions whose predictions score highest
  (`confidence`). width: the most positions a step commits; real_width: the most a step
  before the last commits (their slots enter the cache at the next step)."""

  buckets: ClassVar[protocol.Shape] = protocol.Shape(common.CACHE_BUCKETS, QUERY_BUCKETS)
  score: str = "max_prob"  # options.SCORES
  width: int = 1
  real_width: int = 1

  def confidence(self, logits_BUV: jax.Array) -> jax.Array:
    """[B, U] how sure each prediction is (higher: committed first)."""
    return confidence_score(logits_BUV, self.score)

  def plan_request(
    self, known: int, end: int, steps: int, schedule: str, max_steps: int
  ) -> RowPlan:
    counts = schedules.schedule_counts(end, known, steps, schedule).tolist()
    if max(np.diff(counts)) > min(self.width, self.real_width) or steps > max_steps:
      raise ValueError(
        f"{steps} steps of up to {max(np.diff(counts))} positions; this batch commits at most "
        f"{min(self.width, self.real_width)} a step in at most {max_steps} steps"
      )
    return self.row_plan(counts, max_steps)

  def row_plan(self, counts: list, max_steps: int) -> RowPlan:
    return RowPlan(tuple(counts) + (counts[-1],) * (max_steps + 1 - len(counts)))

  def extent(self, plan: RowPlan) -> tuple[int, int, int]:
    return plan.counts[0], plan.counts[-1], len(plan.counts) - 1

  def fields(self, batch: int, steps: int) -> Fields:
    t = self.model.block_size
    zeros_B = jnp.zeros((batch,), jnp.int32)
    return Fields(jnp.zeros((batch, steps + 1), jnp.int32), zeros_B, jnp.ones((batch, t), bool))

  def start(
    self, plan_R: RowPlan, order_RT: jax.Array, known_R: jax.Array, keys_R: jax.Array
  ) -> Fields:
    r, t = order_RT.shape
    known_RT = (
      jnp.zeros((r, t), bool)
      .at[jnp.arange(r)[:, None], order_RT]
      .set(jnp.arange(t) < known_R[:, None])
    )
    closed_RT = known_RT | (jnp.arange(t) >= plan_R.counts[:, -1:])
    return Fields(plan_R.counts, jnp.zeros_like(known_R), closed_RT)

  def segments(self, plan: RowPlan) -> tuple:
    counts = plan.counts
    end = counts[-1]
    return tuple(
      (a, b, protocol.Shape(self.model.block_size, u))
      for a, b, u in common.bucket_segments([end - n for n in counts[:-1]], end, QUERY_BUCKETS)
    )

  def needs(self, rows: engine.Rows, fields: Fields) -> tuple:
    """A step writes the real slots up to n - 1 and scores every candidate."""
    return rows.filled_B, fields.counts_BS[:, -1] - rows.filled_B

  def step(
    self, dm: engine.DecodeModel, params: Any, s: protocol.DecodeState, shape: protocol.Shape
  ) -> protocol.DecodeState:
    """Real slots c..n-1 (committed last step, their targets now known) enter the cache; one
    query per candidate (ascending; a copy of slot n's input) scores it; the m best commit."""
    rows, f = s.rows, s.fields
    tokens_BT, order_BT, active_B = rows.tokens_BT, rows.order_BT, rows.active_B
    b, t = tokens_BT.shape
    r_width, u_width, m_width = self.real_width, shape.width, self.width
    at = lambda x_BS, i_B: jnp.take_along_axis(x_BS, i_B[:, None], axis=1)[:, 0]
    i_B, n_B, c_B = f.step_B, rows.filled_B, rows.cached_B
    next_B = at(f.counts_BS, jnp.minimum(i_B + 1, f.counts_BS.shape[1] - 1))
    end_B1, n_B1 = f.counts_BS[:, -1:], n_B[:, None]
    real_BR = c_B[:, None] + jnp.arange(r_width)
    slots_BW = jnp.concatenate([jnp.minimum(real_BR, t - 1), jnp.repeat(n_B1, u_width, 1)], 1)
    prev_tok, prev_pos = engine.slot_inputs(tokens_BT, order_BT, slots_BW)
    cand_BU = jnp.argsort(f.closed_BT, axis=1, stable=True)[:, :u_width].astype(jnp.int32)
    target_BW = jnp.concatenate(
      [jnp.take_along_axis(order_BT, jnp.minimum(real_BR, t - 1), 1), cand_BU], 1
    )
    # A real slot sees the real slots before it; a query, every real slot in place.
    w = r_width + u_width
    sees_BW = jnp.where(jnp.arange(w) < r_width, jnp.arange(w), (n_B - c_B)[:, None])
    chunk = engine.Chunk(prev_tok, prev_pos, target_BW, sees_BW, c_B)
    write_BR = jnp.where((real_BR < n_B1) & active_B[:, None], real_BR, t)
    cols_BU = jnp.broadcast_to(r_width + jnp.arange(u_width), (b, u_width))
    hidden, cond, _, cache = dm.forward(params, s.cache, chunk, shape.cache_len, write_BR, cols_BU)
    logits_BUV = dm.logits(params, hidden, cond)
    conf_BU = jnp.where(jnp.arange(u_width) < end_B1 - n_B1, self.confidence(logits_BUV), -jnp.inf)
    rank_BA = jnp.argsort(-conf_BU, axis=1, stable=True)[:, :m_width]  # ties: lower position
    logits_BAV = jnp.take_along_axis(logits_BUV, rank_BA[..., None], axis=1)
    tok_BA, lp_BA, raw_BA = engine.draw(rows, self.draw, logits_BAV, i_B)
    live = (jnp.arange(m_width) < (next_B - n_B)[:, None]) & active_B[:, None]
    pos_BA = jnp.where(live, jnp.take_along_axis(cand_BU, rank_BA, axis=1), t)
    r_B1 = jnp.arange(b)[:, None]
    rows = engine.commit(rows, pos_BA, tok_BA, lp_BA, raw_BA, i_B)
    slot_BA = jnp.where(live, n_B1 + jnp.arange(m_width), t)
    filled_B = jnp.where(active_B, next_B, n_B)
    rows = rows._replace(
      order_BT=order_BT.at[r_B1, slot_BA].set(pos_BA, mode="drop"),
      filled_B=filled_B,
      cached_B=jnp.where(active_B, n_B, c_B),
      active_B=active_B & (filled_B < end_B1[:, 0]),
      forwards_B=rows.forwards_B + active_B,
    )
    f = Fields(f.counts_BS, i_B + active_B, f.closed_BT.at[r_B1, pos_BA].set(True, mode="drop"))
    return protocol.DecodeState(rows, cache, f)


def continuing(
  cfg: specs.ModelSpec, c: protocol.Continuing, rule: type[DecoderSpec] = DecoderSpec
) -> DecoderSpec:
  """The spec of a continuous batch committing up to c.tokens_per_step positions a step, in
  the order it chooses (an order or blocks are refused). eos_id stops no row early (what
  follows an EOS may be drawn before it): callers cut the text there."""
  if c.order != "l2r" or c.block_len is not None:
    raise ValueError(f"order={c.order!r}, block_len={c.block_len}: this policy chooses its order")
  k = c.tokens_per_step
  return rule(model=cfg, draw=common.DrawRule(vocab_limit=c.vocab_limit), width=k, real_width=k)


def static(
  b: protocol.Batch,
  *,
  steps: int,
  schedule: str = "linear",
  score: str = "max_prob",
  rule: type[DecoderSpec] = DecoderSpec,
) -> protocol.Static:
  """A static batch decoded in `steps` steps, the most confident positions first (`rule`: an
  adaptive order's spec, whose `confidence` ranks the candidates; protocol.sample: `sample`).
  The output's `order` is the order the positions were committed in (known ones first)."""
  options.check_sampling(steps, schedule=schedule)
  options.check_choice("score", score, options.SCORES)
  counts = schedules.schedule_counts(b.end, int(b.known_T.sum()), int(steps), schedule).tolist()
  commits = np.diff(counts)
  spec = rule(
    model=b.cfg,
    draw=b.draw,
    score=score,
    width=int(commits.max()),
    real_width=int(max(commits[:-1], default=1)),
  )
  return protocol.Static(spec, spec.row_plan(counts, len(counts) - 1), b.params)


sample = functools.partial(protocol.sample, static)
