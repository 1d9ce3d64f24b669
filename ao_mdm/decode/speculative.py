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
and top-p. One forward per iteration; rows keep their own counts; the loop ends when every row
is done (with `eos_id`, in L2R order: a row is done once it has drawn an EOS).
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import specs
from ao_mdm.decode import common, engine, options
from ao_mdm.decode import draft as draft_lib


def _layout(k: int, phantoms: bool = True) -> dict:
  """Static column layout of one forward: k + 1 real slots, then (self-drafting) k phantoms of
  real slot k. Column w copies the input of real slot `base[w]`, targets `base[w] + ahead[w]`
  and sees `sees[w]` columns before it (engine.Chunk): a real slot the real slots before it, a
  phantom the real slots before k."""
  n_ph = k if phantoms else 0
  base = np.concatenate([np.arange(k + 1), np.full(n_ph, k)])
  ahead = np.concatenate([np.zeros(k + 1, int), np.arange(1, n_ph + 1)])
  return {"base": base, "ahead": ahead, "sees": base}


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
  """What one jitted speculative loop is made for (hashable: the key of its cache)."""

  model: specs.ModelSpec
  k: int  # tokens drafted per forward
  known: int  # known positions (a prompt or infill context), first in the order
  draw: common.DrawRule = common.DrawRule()
  order: str = "l2r"  # of the unknown positions: "l2r" or "random"
  head: bool = False  # drafts from a learned head (decode/draft.py), else from phantoms
  verify: bool = True  # False accepts every draft: a wrong rule, for the exactness test
  eos_id: int | None = None  # a row is done once it has drawn this id (L2R order)
  end: int | None = None  # order slots from here on are never drawn (None: T)


class Loop(NamedTuple):
  """The speculative loop's state between iterations (per row: n_B known slots so far)."""

  tokens_BT: jax.Array
  cache: engine.KVCache
  n_B: jax.Array
  drafts_BG: jax.Array  # the k drafts of order slots n+1..n+k
  q_BGV: jax.Array  # their proposals
  it: jax.Array
  stats: dict
  drawn: engine.Drawn


@functools.lru_cache(maxsize=16)
def decoder(spec: DecoderSpec):
  """The jitted speculative loop of a spec: run(params, head_params, tokens, known, key,
  temperature, top_p, top_k) -> (tokens, order, stats, iterations); head_params is None unless
  spec.head."""
  cfg, k, known, head = spec.model, spec.k, spec.known, spec.head
  dm = engine.DecodeModel.of(cfg)
  model = dm.module
  t = cfg.block_size
  end = t if spec.end is None else spec.end
  lay = _layout(k, phantoms=not head)
  base_W, ahead_W = jnp.asarray(lay["base"]), jnp.asarray(lay["ahead"])
  sees_W = jnp.asarray(lay["sees"])

  def head_drafts(
    params, head_params, hidden_BWD, a_B, n_B, fix_B, order_BT, u_GB, temperature, probs
  ):
    """k drafts and their proposals [B, k, V], chained by the head from real slot a's hidden
    state and the token just drawn there (order slot n + a)."""
    at = lambda s_B: jnp.take_along_axis(order_BT, jnp.minimum(s_B, t - 1)[:, None], axis=1)
    f_B1D = jnp.take_along_axis(hidden_BWD, a_B[:, None, None], axis=1)

    def one(carry, xs):
      f_B1D, tok_B = carry
      j, u_B = xs
      slot_B = n_B + a_B + j  # the order slot of tok_B
      f_B1D, logits_B1V = draft_lib.step(
        model, params, head_params, f_B1D, tok_B[:, None], at(slot_B), at(slot_B + 1)
      )
      q_BV = probs(logits_B1V[:, 0])
      d_B = jnp.where(temperature > 0, common.draw_from_probs(u_B, q_BV), common.first_argmax(q_BV))
      return (f_B1D, d_B), (d_B, q_BV)

    _, (d_GB, q_GBV) = jax.lax.scan(one, (f_B1D, fix_B), (jnp.arange(k), u_GB))
    return d_GB.T, q_GBV.transpose(1, 0, 2)

  def run(params, head_params, tokens_BT, known_BT, key, temperature, top_p, top_k):
    b = tokens_BT.shape[0]
    k_order = key
    if spec.order == "random":  # an L2R order needs no key (and keeps its draws)
      k_order, key = jax.random.split(key)
    order_BT = common.make_orders(k_order, known_BT, spec.order, end=spec.end)
    draw = common.Draw(temperature, top_p, top_k, spec.draw)
    probs = draw.probs
    known_B = jnp.full((b,), known, jnp.int32)
    cache = dm.prefill(params, engine.KVCache.empty(cfg, b), tokens_BT, order_BT, known_B, known)
    params = dm.loop_params(params)
    rows_B1 = jnp.arange(b)[:, None]
    k_loop, k_first = jax.random.split(key)

    def body(carry: Loop) -> Loop:
      tokens_BT, cache, n_B, drafts_BG, q_BGV, it, stats, committed = carry
      m_B = jnp.clip(end - n_B, 0, k)  # drafts that fall inside the sequence
      # Every uniform of the iteration in one call: k to accept, 1 for the new token, the rest
      # for the drafts (the head's k, or the k + 1 candidates of real slot n+k and the phantoms).
      u_BU = jax.random.uniform(jax.random.fold_in(k_loop, it), (b, 2 * k + 1 + (not head)))
      u_BG, u_fix_B, u_draw_BU = u_BU[:, :k], u_BU[:, k], u_BU[:, k + 1 :]
      # Inputs of the real slots n..n+k: the last known token, then the drafts.
      slot_BW = n_B[:, None] + base_W[None, :]
      prev_tok_BW, prev_pos_BW = engine.slot_inputs(tokens_BT, order_BT, slot_BW)
      draft_in_BW = jnp.take_along_axis(
        drafts_BG, jnp.clip(base_W - 1, 0, k - 1)[None, :].repeat(b, 0), axis=1
      )
      prev_tok_BW = jnp.where(base_W[None, :] > 0, draft_in_BW, prev_tok_BW)
      target_BW = jnp.take_along_axis(order_BT, jnp.minimum(slot_BW + ahead_W, t - 1), axis=1)
      sees_BW = jnp.broadcast_to(sees_W, slot_BW.shape)
      chunk = engine.Chunk(prev_tok_BW, prev_pos_BW, target_BW, sees_BW, n_B)
      # The real slots' K/V join the cache before it is read (the chunk sees slots < n there).
      # Those past the accepted drafts had wrong inputs: the next forward, whose real slots
      # start after them, writes them again before any chunk may see them.
      real_BR = slot_BW[:, : k + 1]
      hidden, cond, _, cache = dm.forward(
        params, cache, chunk, t, jnp.where(real_BR < end, real_BR, t)
      )
      logits_BWV = dm.logits(params, hidden, cond)
      scaled_BWV = draw.scaled(logits_BWV)
      probs_BWV = jax.nn.softmax(scaled_BWV, axis=-1)
      p_BRV = probs_BWV[:, : k + 1]  # the conditionals at order slots n..n+k
      # Verify: accept the longest prefix of drafts, each with probability min(1, p/q).
      p_d = jnp.take_along_axis(p_BRV[:, :k], drafts_BG[..., None], axis=2)[..., 0]
      q_d = jnp.take_along_axis(q_BGV, drafts_BG[..., None], axis=2)[..., 0]
      greedy_ok = drafts_BG == common.first_argmax(p_BRV[:, :k])
      ok_BG = jnp.where(temperature > 0, u_BG * q_d < p_d, greedy_ok) | (not spec.verify)
      ok_BG &= jnp.arange(k)[None, :] < m_B[:, None]
      a_B = jnp.sum(jnp.cumprod(ok_BG.astype(jnp.int32), axis=1), axis=1)
      # P(first draft accepted) = sum_x min(p, q): the drafts' quality, without sampling noise.
      overlap_B = jnp.sum(jnp.minimum(p_BRV[:, 0], q_BGV[:, 0]), axis=-1)
      # The token after the accepted drafts: from the residual after a rejection, else from p.
      p_a = jnp.take_along_axis(p_BRV, a_B[:, None, None], axis=1)[:, 0]
      q_a = jnp.take_along_axis(q_BGV, jnp.minimum(a_B, k - 1)[:, None, None], axis=1)[:, 0]
      resid = jnp.maximum(p_a - jnp.where((a_B < m_B)[:, None], q_a, 0.0), 0.0)
      resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p_a)
      fix_B = jnp.where(
        temperature > 0, common.draw_from_probs(u_fix_B, resid), common.first_argmax(p_a)
      )
      # Write the accepted drafts and the new token at order[n .. n+a].
      j_1R = jnp.arange(k + 1)[None, :]
      new_tok = jnp.where(j_1R < a_B[:, None], jnp.pad(drafts_BG, ((0, 0), (0, 1))), fix_B[:, None])
      slot_new = n_B[:, None] + j_1R
      live = (j_1R <= a_B[:, None]) & (slot_new < end)
      pos_new = jnp.where(live, jnp.take_along_axis(order_BT, jnp.minimum(slot_new, t - 1), 1), t)
      tokens_BT = tokens_BT.at[rows_B1, pos_new].set(new_tok, mode="drop")
      # Each new token's log-prob at its slot n + j, as drawn (0 when greedy) and the model's own.
      lp, raw = engine.logprobs(
        scaled_BWV[:, : k + 1], logits_BWV[:, : k + 1], new_tok, temperature
      )
      committed = committed.put(pos_new, lp, raw, it)
      if head:  # the head drafts n+a+1 .. n+a+k from real slot n+a, which drew the new token
        drafts_next, q_next = head_drafts(
          params, head_params, hidden, a_B, n_B, fix_B, order_BT, u_draw_BU.T, temperature, probs
        )
      else:
        # Drafts and proposals for positions n+1..n+2k: the old drafts, real slot n+k's
        # conditional, the phantoms; positions n+a+1..n+a+k are the next drafts.
        cand_q = jnp.concatenate([q_BGV, probs_BWV[:, k:]], axis=1)
        drawn = common.draw_from_probs(
          u_draw_BU.reshape(-1), probs_BWV[:, k:].reshape(b * (k + 1), -1)
        )
        fresh = jnp.where(
          temperature > 0, drawn.reshape(b, -1), common.first_argmax(probs_BWV[:, k:])
        )
        cand_tok = jnp.concatenate([drafts_BG, fresh], axis=1)
        next_BG = a_B[:, None] + 1 + jnp.arange(k)[None, :]
        drafts_next = jnp.take_along_axis(cand_tok, next_BG, axis=1)
        q_next = jnp.take_along_axis(cand_q, next_BG[..., None], axis=1)
      done_before = n_B >= end
      n_next = jnp.where(done_before, n_B, n_B + a_B + 1)
      if spec.eos_id is not None:  # the tokens after a new EOS are not used
        n_next = jnp.where(jnp.any(live & (new_tok == spec.eos_id), axis=1), end, n_next)
      first = (m_B > 0) & ~done_before  # a first draft was verified
      stats = {
        "forwards": stats["forwards"] + jnp.where(done_before, 0, 1),
        "accepted": stats["accepted"] + jnp.where(done_before, 0, a_B),
        "first_drafts": stats["first_drafts"] + first,
        "first_accepted": stats["first_accepted"] + (first & (a_B > 0)),
        "first_overlap": stats["first_overlap"] + jnp.where(first, overlap_B, 0.0),
      }
      return Loop(tokens_BT, cache, n_next, drafts_next, q_next, it + 1, stats, committed)

    tokens_BT = jnp.where(known_BT, tokens_BT, 0)
    zeros_B = jnp.zeros((b,), jnp.int32)
    # First drafts: uniform over the allowed ids (a poor but exact proposal).
    limit = cfg.vocab_size if spec.draw.vocab_limit is None else spec.draw.vocab_limit
    drafts_BG = jax.random.randint(k_first, (b, k), 0, limit)
    q_BGV = jnp.broadcast_to(
      jnp.where(jnp.arange(cfg.vocab_size) < limit, 1.0 / limit, 0.0), (b, k, cfg.vocab_size)
    )
    carry = Loop(
      tokens_BT,
      cache,
      jnp.full((b,), known, jnp.int32),
      drafts_BG,
      q_BGV,
      jnp.int32(0),
      {
        "forwards": zeros_B,
        "accepted": zeros_B,
        "first_drafts": zeros_B,
        "first_accepted": zeros_B,
        "first_overlap": jnp.zeros((b,), jnp.float32),
      },
      engine.Drawn.empty(b, t),
    )
    carry = jax.lax.while_loop(lambda c: jnp.any(c.n_B < end), body, carry)
    return carry.tokens_BT, order_BT, carry.stats, carry.it, carry.drawn

  return jax.jit(run)


def sample(
  params: Any,
  cfg: specs.ModelSpec,
  *,
  batch_size: int,
  draft: int = 4,
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  seed: int = 0,
  known_positions: Any = (),
  known_tokens: Any = (),
  order: str | None = None,
  top_p_rule: str = "authors",
  vocab_limit: int | None = None,
  dtype: str = "float32",
  draft_head: Any = None,
  eos_id: int | None = None,
  end: int | None = None,
) -> common.SampleOutput:
  """Samples ([batch_size, T]) of sequential decoding in `order` ("l2r", the default, or
  "random": a random order of the unknown positions per row) by speculative decoding with
  `draft` tokens per forward, drafted by the model itself (phantom slots) or, given its params
  `draft_head` (draft.load), by a learned draft head.

  Known tokens come first in the order (as in parallel.sample). The output's `order` is the
  order used, and its `stats` hold, per row, the forwards it took, the drafts it accepted, and
  for the first draft of each forward: how many were verified, accepted, and the sum of their
  acceptance probabilities sum_x min(p, q).

  eos_id (L2R order only): a row is done once it draws an EOS after the known tokens, and the
  loop ends when every row is; `stats` then also holds each row's "length", the tokens up to
  and including that EOS (T without one); the tokens after it are not meaningful. The tokens
  up to it are those of the same call without eos_id.

  end: only the positions before it are drawn; the later ones are last in the order, never
  drawn, and 0 in the output (an infill that ends at its text).
  """
  order = order or "l2r"
  options.check_sampling(1, temperature, top_p, top_k, order, top_p_rule)
  t = cfg.block_size
  params, cfg = common.with_dtype(params, cfg, dtype)
  if draft_head is not None:
    draft_head = common.with_dtype(draft_head, cfg, dtype)[0]
  if not 1 <= int(draft) <= t - 1:
    raise ValueError(f"draft={draft} must be in [1, {t - 1}] (T - 1)")
  tokens, mask = common.known_inputs(cfg, batch_size, known_positions, known_tokens, vocab_limit)
  known = int(mask[0].sum())
  if eos_id is not None and (order != "l2r" or not mask[0, :known].all()):
    raise ValueError(
      "eos_id (stop at the first EOS) needs order='l2r' and the known tokens to "
      "be a prefix (a prompt)"
    )
  end = common.decode_end(end, mask[0])
  decode = decoder(
    DecoderSpec(
      cfg,
      int(draft),
      known,
      common.DrawRule(top_p_rule, vocab_limit),
      order,
      draft_head is not None,
      eos_id=None if eos_id is None else int(eos_id),
      end=None if end == t else end,
    )
  )
  out = decode(
    params,
    draft_head,
    jnp.asarray(tokens),
    jnp.asarray(mask),
    jax.random.key(seed),
    jnp.float32(temperature),
    jnp.float32(top_p),
    jnp.int32(top_k),
  )
  tokens_BT, order_BT, stats, iterations, drawn = jax.device_get(out)
  stats = {**{name: np.asarray(v) for name, v in stats.items()}, "iterations": int(iterations)}
  if eos_id is not None:
    stats["length"] = common.eos_lengths(tokens_BT, known, int(eos_id))
  return common.SampleOutput(tokens_BT, order_BT, stats=stats, **common.drawn_arrays(drawn))
