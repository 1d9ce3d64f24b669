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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import specs
from ao_mdm.decode import common, engine, noise, options, parallel

QUERY_BUCKETS = 4  # decode loops, each with a query width for the unknown positions it can have


def confidence_score(logits_NV: jax.Array, score: str) -> jax.Array:
  """Confidence of each prediction (higher is more confident), from the raw softmax."""
  logp = jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1)
  if score == "max_prob":
    return jnp.max(logp, axis=-1)
  return jnp.sum(jnp.exp(logp) * logp, axis=-1)  # minus the entropy


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
  """What one jitted confidence-ordered loop is made for (hashable: the key of its cache)."""

  model: specs.ModelSpec
  counts: tuple  # known positions after each step, n_0 .. n_S (the last: the end slot)
  score: str  # options.SCORES
  draw: common.DrawRule = common.DrawRule()


class Carry(NamedTuple):
  """The loop's state between steps: the order grows as positions are committed."""

  tokens_BT: jax.Array
  closed_BT: jax.Array  # known, committed, or at/after the end slot
  order_BT: jax.Array
  cache: engine.KVCache
  drawn: engine.Drawn


@functools.lru_cache(maxsize=16)
def decoder(spec: DecoderSpec):
  """The jitted confidence-ordered loop of a spec: run(params, tokens, known, key, temperature,
  top_p, top_k) -> (tokens, order)."""
  cfg, counts = spec.model, spec.counts
  dm = engine.DecodeModel.of(cfg)
  t = cfg.block_size
  known = counts[0]
  commits = np.diff(counts)
  r_width, m_width = int(max(commits[:-1], default=1)), int(commits.max())
  counts_j = jnp.asarray(counts, jnp.int32)
  prev_j = jnp.asarray((known,) + counts[:-2], jnp.int32)  # n_{i-2}: first slot of step i's chunk
  # (first step, end step, query width): a width for the unknown positions each step can have
  end = counts[-1]  # positions from here on are never drawn
  segments = common.bucket_segments([end - n for n in counts[:-1]], end, QUERY_BUCKETS)

  def run(params, tokens_BT, known_BT, key, temperature, top_p, top_k):
    b = tokens_BT.shape[0]
    order_BT = common.make_orders(key, known_BT, "l2r")  # known first; the rest is chosen below
    closed_BT = known_BT | (jnp.arange(t) >= end)[None, :]  # no candidates at or after end
    draw = common.Draw(temperature, top_p, top_k, spec.draw)
    known_B = jnp.full((b,), known, jnp.int32)
    cache = dm.prefill(params, engine.KVCache.empty(cfg, b), tokens_BT, order_BT, known_B, known)
    params = dm.loop_params(params)
    rows_B1 = jnp.arange(b)[:, None]

    def step(i, carry: Carry, u_width: int) -> Carry:
      tokens_BT, closed_BT, order_BT, cache, drawn = carry
      n, c, m = counts_j[i], prev_j[i], counts_j[i + 1] - counts_j[i]
      w = r_width + u_width
      # Real slots c..n-1 (committed last step, targets now known), then one query per unknown
      # position (ascending), each a copy of slot n's input.
      real_R = c + jnp.arange(r_width)
      slots_W = jnp.concatenate([jnp.minimum(real_R, t - 1), jnp.full((u_width,), n)])
      prev_tok, prev_pos = engine.slot_inputs(
        tokens_BT, order_BT, jnp.broadcast_to(slots_W, (b, w))
      )
      cand_BU = jnp.argsort(closed_BT, axis=1, stable=True)[:, :u_width].astype(jnp.int32)
      target_BW = jnp.concatenate(
        [jnp.take(order_BT, jnp.minimum(real_R, t - 1), axis=1), cand_BU], axis=1
      )
      # A real slot sees the real slots before it; a query, every real slot in place.
      sees_W = jnp.where(jnp.arange(w) < r_width, jnp.arange(w), n - c)
      chunk = engine.Chunk(
        prev_tok, prev_pos, target_BW, jnp.broadcast_to(sees_W, (b, w)), jnp.full((b,), c)
      )
      write_BR = jnp.broadcast_to(jnp.where(real_R < n, real_R, t), (b, r_width))
      cols_BU = jnp.broadcast_to(r_width + jnp.arange(u_width), (b, u_width))
      hidden, cond, _, cache = dm.forward(params, cache, chunk, t, write_BR, cols_BU)
      logits_BUV = dm.logits(params, hidden, cond)
      conf_BU = jnp.where(
        jnp.arange(u_width)[None, :] < end - n, confidence_score(logits_BUV, spec.score), -jnp.inf
      )
      rank_BA = jnp.argsort(-conf_BU, axis=1, stable=True)[:, :m_width]  # ties: lower position
      logits_BAV = jnp.take_along_axis(logits_BUV, rank_BA[..., None], axis=1)
      logits_NV = logits_BAV.reshape(b * m_width, -1)
      gumbel_NV = noise.gumbel(jax.random.fold_in(key, i), logits_NV.shape)
      picked_N, scaled_NV = draw.perturbed(logits_NV, gumbel_NV)
      picked = picked_N.reshape(b, m_width)
      lp, raw = engine.logprobs(
        scaled_NV.reshape(logits_BAV.shape), logits_BAV, picked, temperature
      )
      live = jnp.arange(m_width)[None, :] < m
      pos_BA = jnp.where(live, jnp.take_along_axis(cand_BU, rank_BA, axis=1), t)
      tokens_BT = tokens_BT.at[rows_B1, pos_BA].set(picked, mode="drop")
      closed_BT = closed_BT.at[rows_B1, pos_BA].set(True, mode="drop")
      slot_BA = jnp.where(live, n + jnp.arange(m_width)[None, :], t)
      order_BT = order_BT.at[rows_B1, slot_BA].set(pos_BA, mode="drop")
      return Carry(tokens_BT, closed_BT, order_BT, cache, drawn.put(pos_BA, lp, raw, i))

    carry = Carry(
      jnp.where(known_BT, tokens_BT, 0), closed_BT, order_BT, cache, engine.Drawn.empty(b, t)
    )
    for first, last, u_width in segments:
      carry = jax.lax.fori_loop(first, last, functools.partial(step, u_width=u_width), carry)
    return carry.tokens_BT, carry.order_BT, carry.drawn

  return jax.jit(run)


def sample(
  params: Any,
  cfg: specs.ModelSpec,
  *,
  batch_size: int,
  steps: int,
  schedule: str = "linear",
  score: str = "max_prob",
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  seed: int = 0,
  known_positions: Any = (),
  known_tokens: Any = (),
  top_p_rule: str = "authors",
  vocab_limit: int | None = None,
  dtype: str = "float32",
  end: int | None = None,
) -> common.SampleOutput:
  """[batch_size, T] samples in `steps` steps, committing the most confident positions first.

  The output's `order` is the order the positions were committed in (known ones first). end:
  only the positions before it are drawn; the later ones stay 0 and last in the order.
  """
  options.check_sampling(steps, temperature, top_p, top_k, "l2r", top_p_rule, schedule)
  options.check_choice("score", score, options.SCORES)
  params, cfg = common.with_dtype(params, cfg, dtype)
  tokens, mask = common.known_inputs(cfg, batch_size, known_positions, known_tokens, vocab_limit)
  counts = parallel.schedule_counts(
    common.decode_end(end, mask[0]), int(mask[0].sum()), int(steps), schedule
  )
  decode = decoder(
    DecoderSpec(
      cfg,
      tuple(int(n) for n in counts),
      score,
      common.DrawRule(top_p_rule, vocab_limit),
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
  tokens_BT, order_BT, drawn = jax.device_get(out)
  return common.SampleOutput(tokens_BT, order_BT, **common.drawn_arrays(drawn))
