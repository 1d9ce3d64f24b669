"""Speculative decoding (docs/sampling.md): exact samples of sequential decoding in a fixed
order (L2R, or a random order of the unknown positions), several tokens per forward, drafted
by the model itself (below) or by a learned draft head (decode/draft.py: the forward then holds
the k + 1 real slots only, and the head drafts the next k positions from the hidden state of
the real slot that drew the newest token).

An AO-GPT is also a sequential model in any order, and both run through one KV cache. With the
first n slots of the order known, one forward holds 2k + 1 slots: the real slots n..n+k (their
inputs: the last known token, then the k drafts), whose conditionals verify the drafts
(speculative sampling: accept draft x with probability min(1, p(x)/q(x)), on the first rejection
draw from max(0, p - q) normalised, after k acceptances draw one more from p), and k phantoms,
copies of real slot n+k's input that target the k order positions after n+k. Every order slot
n+1..n+2k then has a draft with a known proposal q: the unverified old drafts, real slot n+k's
conditional, the phantoms. With a drafts accepted, the drafts for n+a+1..n+a+k are taken from
that list. A proposal may depend on anything but the draft itself (here: on rejected drafts), so
the output is distributed exactly as ancestral sampling in that order with the same temperature
and top-p. One forward per step (protocol.PolicySpec): each row advances by its accepted drafts
plus one, with its own key and draw settings, and is done at its end (with `eos_id`, in L2R
order: once it has drawn an EOS; nothing after it is drawn).
"""

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import specs
from ao_mdm.decode import common, engine, options, protocol
from ao_mdm.decode import draft as draft_lib


def _layout(k: int, phantoms: bool) -> tuple:
  """(base, ahead) [W] of one forward's columns: k + 1 real slots, then (self-drafting) k
  phantoms of real slot k. Column w copies the input of real slot base[w], targets order slot
  base[w] + ahead[w] and sees base[w] columns before it (engine.Chunk): a real slot the real
  slots before it, a phantom the real slots before k."""
  n_ph = k if phantoms else 0
  base = np.concatenate([np.arange(k + 1), np.full(n_ph, k)])
  return base, np.concatenate([np.zeros(k + 1, int), np.arange(1, n_ph + 1)])


class RowPlan(NamedTuple):
  """One request's plan: (known, end, drafts): its known slots, the order slot it stops at, and
  the drafts it verifies per forward (at most the spec's k)."""

  extent: Any


class Fields(NamedTuple):
  """Per row: where it stops, how many drafts it verifies, the k drafts of order slots
  n+1..n+k and their proposals, and counts of its drafts (sample's stats)."""

  end_B: jax.Array
  width_B: jax.Array
  drafts_BG: jax.Array
  q_BGV: jax.Array
  accepted_B: jax.Array
  first_drafts_B: jax.Array  # forwards that verified a first draft
  first_accepted_B: jax.Array
  first_overlap_B: jax.Array  # their sum of P(accepted) = sum_x min(p, q)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderSpec(protocol.PolicySpec):
  """k drafts per forward. head: drafted by a learned head, whose params the step reads at
  params["draft_head"]; verify=False accepts every draft (a wrong rule, for the exactness
  test). Each token is drawn from its conditional given every slot before it (`sequential`)."""

  k: int = 4
  head: bool = False
  verify: bool = True
  sequential: ClassVar[bool] = True

  def plan_request(
    self, known: int, end: int, steps: int, schedule: str, max_steps: int
  ) -> RowPlan:
    """Speculative takes the forwards its drafts need: a request of `steps` steps verifies
    ceil((end - known) / steps) drafts per forward, at most k (its schedule does not apply)."""
    if steps < 1:
      raise ValueError(f"steps={steps} (at least 1)")
    return RowPlan((known, end, min(self.k, max(1, -(-(end - known) // steps)))))

  def extent(self, plan: RowPlan) -> tuple[int, int, int]:
    known, end, _ = plan.extent
    return known, end, end - known

  def fields(self, batch: int, steps: int) -> Fields:
    zeros_B, v = jnp.zeros((batch,), jnp.int32), self.model.vocab_size
    q_BGV = jnp.zeros((batch, self.k, v), jnp.float32)
    drafts_BG = jnp.zeros((batch, self.k), jnp.int32)
    return Fields(
      zeros_B, zeros_B, drafts_BG, q_BGV, zeros_B, zeros_B, zeros_B, jnp.zeros((batch,))
    )

  def start(self, plan_R: RowPlan, order_RT: jax.Array, known_R: jax.Array, keys_R) -> Fields:
    """First drafts uniform over the allowed ids (a poor but exact proposal), from each row's
    key folded with T (its steps fold 0..T-1)."""
    r, t, v = known_R.shape[0], self.model.block_size, self.model.vocab_size
    limit = v if self.draw.vocab_limit is None else self.draw.vocab_limit
    first = lambda key: jax.random.randint(jax.random.fold_in(key, t), (self.k,), 0, limit)
    q_RGV = jnp.broadcast_to(jnp.where(jnp.arange(v) < limit, 1.0 / limit, 0.0), (r, self.k, v))
    zeros_R, drafts_RG = jnp.zeros((r,), jnp.int32), jax.vmap(first)(keys_R)
    return Fields(
      plan_R.extent[:, 1], plan_R.extent[:, 2], drafts_RG, q_RGV, *(zeros_R,) * 3, jnp.zeros((r,))
    )

  def segments(self, plan: RowPlan) -> tuple:
    return ((0, self.extent(plan)[2], protocol.Shape(self.model.block_size)),)

  def needs(self, rows: engine.Rows, fields: Fields) -> tuple:
    """A step writes real slots n .. n + k inside the row's end."""
    return (jnp.minimum(rows.filled_B + self.k + 1, fields.end_B),)

  def output(self, s: protocol.DecodeState, plan: RowPlan, **extra: Any) -> common.SampleOutput:
    """With each row's counts of forwards and drafts (and, with eos_id, its length: `static`)."""
    f, forwards = s.fields, np.asarray(s.rows.forwards_B)
    stats = {
      "forwards": forwards,
      "accepted": np.asarray(f.accepted_B),
      "first_drafts": np.asarray(f.first_drafts_B),
      "first_accepted": np.asarray(f.first_accepted_B),
      "first_overlap": np.asarray(f.first_overlap_B),
      "iterations": int(forwards.max(initial=0)),
    }
    if self.eos_id is not None:
      known = plan.extent[0]
      stats["length"] = common.eos_lengths(np.asarray(s.rows.tokens_BT), known, self.eos_id)
    return super().output(s, plan, stats=stats)

  def step(
    self, dm: engine.DecodeModel, params: Any, s: protocol.DecodeState, shape: protocol.Shape
  ) -> protocol.DecodeState:
    """One forward of real slots n..n+k (inputs: the last known token, then the drafts) and,
    self-drafting, k phantoms: verify the drafts, draw the next token, draft the next k."""
    rows, f, k, head = s.rows, s.fields, self.k, self.head
    tokens_BT, order_BT, n_B, active_B = rows.tokens_BT, rows.order_BT, rows.filled_B, rows.active_B
    b, t = tokens_BT.shape
    end_B1 = f.end_B[:, None]
    base_W, ahead_W = (jnp.asarray(x) for x in _layout(k, phantoms=not head))
    hot_B = rows.temperature_B > 0
    settings = lambda *axes: common.Draw(
      jnp.expand_dims(rows.temperature_B, axes),
      jnp.expand_dims(rows.top_p_B, axes),
      jnp.expand_dims(rows.top_k_B, axes),
      self.draw,
    )
    m_B = jnp.clip(f.end_B - n_B, 0, f.width_B)  # drafts verified: inside the sequence
    # Each row's uniforms of the step, from its key and step: k to accept, 1 for the new token,
    # the rest for the drafts (the head's k, or the k + 1 of real slot n+k and the phantoms).
    u_BU = jax.vmap(
      lambda key, i: jax.random.uniform(jax.random.fold_in(key, i), (2 * k + 1 + (not head),))
    )(rows.key_B, rows.forwards_B)
    u_BG, u_fix_B, u_draw_BU = u_BU[:, :k], u_BU[:, k], u_BU[:, k + 1 :]
    slot_BW = n_B[:, None] + base_W[None, :]
    prev_tok_BW, prev_pos_BW = engine.slot_inputs(tokens_BT, order_BT, slot_BW)
    draft_in_BW = jnp.take_along_axis(
      f.drafts_BG, jnp.clip(base_W - 1, 0, k - 1)[None, :].repeat(b, 0), axis=1
    )
    prev_tok_BW = jnp.where(base_W[None, :] > 0, draft_in_BW, prev_tok_BW)
    target_BW = jnp.take_along_axis(order_BT, jnp.minimum(slot_BW + ahead_W, t - 1), axis=1)
    chunk = engine.Chunk(
      prev_tok_BW, prev_pos_BW, target_BW, jnp.broadcast_to(base_W, slot_BW.shape), n_B
    )
    # The real slots' K/V join the cache before it is read (the chunk sees slots < n there).
    # Those past the accepted drafts had wrong inputs: the next forward, whose real slots
    # start after them, writes them again before any chunk may see them.
    real_BR = slot_BW[:, : k + 1]
    write_BR = jnp.where((real_BR < end_B1) & active_B[:, None], real_BR, t)
    hidden, cond, _, cache = dm.forward(params, s.cache, chunk, shape.cache_len, write_BR)
    logits_BWV = dm.logits(params, hidden, cond)
    scaled_BWV = settings(1, 2).scaled(logits_BWV)
    probs_BWV = jax.nn.softmax(scaled_BWV, axis=-1)
    p_BRV = probs_BWV[:, : k + 1]  # the conditionals at order slots n..n+k
    # Verify: accept the longest prefix of drafts, each with probability min(1, p/q).
    drafts_BG, q_BGV = f.drafts_BG, f.q_BGV
    p_d = jnp.take_along_axis(p_BRV[:, :k], drafts_BG[..., None], axis=2)[..., 0]
    q_d = jnp.take_along_axis(q_BGV, drafts_BG[..., None], axis=2)[..., 0]
    greedy_ok = drafts_BG == common.first_argmax(p_BRV[:, :k])
    ok_BG = jnp.where(hot_B[:, None], u_BG * q_d < p_d, greedy_ok) | (not self.verify)
    ok_BG &= jnp.arange(k)[None, :] < m_B[:, None]
    a_B = jnp.sum(jnp.cumprod(ok_BG.astype(jnp.int32), axis=1), axis=1)
    # P(first draft accepted) = sum_x min(p, q): the drafts' quality, without sampling noise.
    overlap_B = jnp.sum(jnp.minimum(p_BRV[:, 0], q_BGV[:, 0]), axis=-1)
    # The token after the accepted drafts: from the residual after a rejection, else from p.
    p_a = jnp.take_along_axis(p_BRV, a_B[:, None, None], axis=1)[:, 0]
    q_a = jnp.take_along_axis(q_BGV, jnp.minimum(a_B, k - 1)[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(p_a - jnp.where((a_B < m_B)[:, None], q_a, 0.0), 0.0)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p_a)
    fix_B = jnp.where(hot_B, common.draw_from_probs(u_fix_B, resid), common.first_argmax(p_a))
    # The accepted drafts and the new token, at order slots n..n+a (none after a new EOS).
    j_1R = jnp.arange(k + 1)[None, :]
    new_tok = jnp.where(j_1R < a_B[:, None], jnp.pad(drafts_BG, ((0, 0), (0, 1))), fix_B[:, None])
    slot_new = n_B[:, None] + j_1R
    live = (j_1R <= a_B[:, None]) & (slot_new < end_B1) & active_B[:, None]
    n_next = n_B + a_B + 1
    if self.eos_id is not None:
      eos_BR = live & (new_tok == self.eos_id)
      live &= jnp.cumsum(eos_BR, axis=1) - eos_BR == 0
      n_next = jnp.where(jnp.any(eos_BR, axis=1), f.end_B, n_next)
    pos_new = jnp.where(live, jnp.take_along_axis(order_BT, jnp.minimum(slot_new, t - 1), 1), t)
    # Each new token's log-prob at its slot n + j, as drawn (0 when greedy) and the model's own.
    lp, raw = engine.logprobs(
      scaled_BWV[:, : k + 1], logits_BWV[:, : k + 1], new_tok, rows.temperature_B[:, None]
    )
    rows = engine.commit(rows, pos_new, new_tok, lp, raw, rows.forwards_B)
    if head:  # the head drafts n+a+1 .. n+a+k from real slot n+a, which drew the new token
      drafts_next, q_next = self._head_drafts(
        dm, params, hidden, a_B, n_B, fix_B, order_BT, u_draw_BU.T, hot_B, settings(1)
      )
    else:
      # Drafts and proposals for positions n+1..n+2k: the old drafts, real slot n+k's
      # conditional, the phantoms; positions n+a+1..n+a+k are the next drafts.
      cand_q = jnp.concatenate([q_BGV, probs_BWV[:, k:]], axis=1)
      drawn = common.draw_from_probs(
        u_draw_BU.reshape(-1), probs_BWV[:, k:].reshape(b * (k + 1), -1)
      )
      fresh = jnp.where(hot_B[:, None], drawn.reshape(b, -1), common.first_argmax(probs_BWV[:, k:]))
      cand_tok = jnp.concatenate([drafts_BG, fresh], axis=1)
      next_BG = a_B[:, None] + 1 + jnp.arange(k)[None, :]
      drafts_next = jnp.take_along_axis(cand_tok, next_BG, axis=1)
      q_next = jnp.take_along_axis(cand_q, next_BG[..., None], axis=1)
    n_next = jnp.where(active_B, n_next, n_B)
    first = (m_B > 0) & active_B  # a first draft was verified
    keep = lambda new, old: jnp.where(active_B.reshape((b,) + (1,) * (old.ndim - 1)), new, old)
    f = Fields(
      f.end_B,
      f.width_B,
      keep(drafts_next, drafts_BG),
      keep(q_next, q_BGV),
      f.accepted_B + jnp.where(active_B, a_B, 0),
      f.first_drafts_B + first,
      f.first_accepted_B + (first & (a_B > 0)),
      f.first_overlap_B + jnp.where(first, overlap_B, 0.0),
    )
    rows = rows._replace(
      filled_B=n_next,
      cached_B=n_next,
      active_B=active_B & (n_next < f.end_B),
      forwards_B=rows.forwards_B + active_B,
    )
    return protocol.DecodeState(rows, cache, f)

  def _head_drafts(
    self, dm, params, hidden_BWD, a_B, n_B, fix_B, order_BT, u_GB, hot_B, draw
  ) -> tuple:
    """k drafts and their proposals [B, k, V], chained by the head from real slot a's hidden
    state and the token just drawn there (order slot n + a)."""
    t = order_BT.shape[1]
    at = lambda s_B: jnp.take_along_axis(order_BT, jnp.minimum(s_B, t - 1)[:, None], axis=1)
    f_B1D = jnp.take_along_axis(hidden_BWD, a_B[:, None, None], axis=1)

    def one(carry, xs):
      f_B1D, tok_B = carry
      j, u_B = xs
      slot_B = n_B + a_B + j  # the order slot of tok_B
      f_B1D, logits_B1V = draft_lib.step(
        dm.module, params, params["draft_head"], f_B1D, tok_B[:, None], at(slot_B), at(slot_B + 1)
      )
      q_BV = draw.probs(logits_B1V[:, 0])
      d_B = jnp.where(hot_B, common.draw_from_probs(u_B, q_BV), common.first_argmax(q_BV))
      return (f_B1D, d_B), (d_B, q_BV)

    _, (d_GB, q_GBV) = jax.lax.scan(one, (f_B1D, fix_B), (jnp.arange(self.k), u_GB))
    return d_GB.T, q_GBV.transpose(1, 0, 2)


def continuing(cfg: specs.ModelSpec, c: protocol.Continuing) -> DecoderSpec:
  """The spec of a continuous batch continuing prompts, c.tokens_per_step drafts a forward
  (self-drafted), in c.order; a row done at its EOS in L2R order."""
  if c.block_len is not None:
    raise ValueError(f"block_len={c.block_len}: speculative decodes one block")
  return DecoderSpec(
    model=cfg,
    k=c.tokens_per_step,
    draw=common.DrawRule(vocab_limit=c.vocab_limit),
    order=c.order,
    eos_id=c.eos_id if c.order == "l2r" else None,
  )


def static(
  b: protocol.Batch,
  *,
  draft: int = 4,
  order: str | None = None,
  draft_head: Any = None,
  eos_id: int | None = None,
  verify: bool = True,
) -> protocol.Static:
  """A static batch of sequential decoding in `order` ("l2r", the default, or "random": a
  random order of the unknown positions per row), `draft` tokens per forward, drafted by the
  model itself (phantom slots) or, given its params `draft_head` (draft.load), by a learned
  draft head (protocol.sample: `sample`).

  The output's `order` is the order used, and its `stats` hold, per row, the forwards it took,
  the drafts it accepted, and for the first draft of each forward: how many were verified,
  accepted, and the sum of their acceptance probabilities sum_x min(p, q); "iterations": the
  most forwards of a row. eos_id (L2R order only): a row is done once it draws an EOS after the
  known tokens; `stats` then also holds each row's "length", the tokens up to and including that
  EOS (T without one); nothing after it is drawn (0). verify=False accepts every draft: a wrong
  rule, for the exactness test.
  """
  order = order or "l2r"
  options.check_sampling(order=order)
  if not 1 <= int(draft) <= b.cfg.block_size - 1:
    raise ValueError(f"draft={draft} must be in [1, {b.cfg.block_size - 1}] (T - 1)")
  known = int(b.known_T.sum())
  if eos_id is not None and (order != "l2r" or not b.known_T[:known].all()):
    raise ValueError(
      "eos_id (stop at the first EOS) needs order='l2r' and the known tokens to "
      "be a prefix (a prompt)"
    )
  params = b.params
  if draft_head is not None:
    params = {**params, "draft_head": common.with_dtype(draft_head, b.cfg, b.cfg.dtype)[0]}
  spec = DecoderSpec(
    model=b.cfg,
    k=int(draft),
    draw=b.draw,
    order=order,
    head=draft_head is not None,
    verify=verify,
    eos_id=None if eos_id is None else int(eos_id),
  )
  return protocol.Static(spec, RowPlan((known, b.end, int(draft))), params)


sample = functools.partial(protocol.sample, static)
