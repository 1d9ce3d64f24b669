"""The log-probability every drawn token comes with equals an independent recomputation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallel import T, cached_model

from ao_mdm import model as model_lib
from ao_mdm.decode import confidence, parallel, speculative
from helpers import default_stage_keeps


def naive_logprobs(cfg, params, out) -> np.ndarray:
  """[B, T] log p(token at order slot s | the tokens of the steps before its step), one training
  forward per token: the order cut to the earlier steps' slots, then slot s's position."""
  model = model_lib.make_model(cfg)
  b = out.tokens.shape[0]
  orders, tokens, where = [], [], []
  for r in range(b):
    for p in range(T):
      step = out.steps[r, p]
      if step < 0:
        continue
      # The step's first slot: the number of positions drawn before it (or known).
      n = int(np.sum(out.steps[r] < step))
      first = list(out.order[r, :n]) + [p]
      orders.append(first + [q for q in range(T) if q not in first])
      tokens.append(out.tokens[r])
      where.append((r, p, n))
  logits = model.apply({"params": params}, jnp.asarray(tokens), jnp.asarray(orders, jnp.int32))
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
  result = np.zeros((b, T), np.float32)
  for i, (r, p, n) in enumerate(where):
    result[r, p] = logp[i, n, out.tokens[r, p]]
  return result


@pytest.mark.parametrize(
  "order,steps,known",
  default_stage_keeps(
    [("l2r", T, ()), ("random", T // 4, ()), ("random", 6, (0, 1, 2, 9))],
    [("random", 6, (0, 1, 2, 9))],
  ),
)
def test_drawn_logprobs_equal_a_forward_on_the_earlier_steps_only(order, steps, known):
  cfg, params = cached_model("ao")
  out = parallel.sample(
    params,
    cfg,
    batch_size=2,
    steps=steps,
    seed=3,
    order=order,
    known_positions=known,
    known_tokens=[5] * len(known),
  )
  drawn = out.steps >= 0
  assert drawn.sum() == 2 * (T - len(known))
  expected = naive_logprobs(cfg, params, out)
  np.testing.assert_allclose(out.raw_logprobs[drawn], expected[drawn], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(out.logprobs, out.raw_logprobs)  # temperature 1, no filter


def test_filtered_logprobs_are_those_of_the_distribution_drawn_from():
  cfg, params = cached_model("ao")
  temperature, top_k = 0.7, 5
  out = parallel.sample(
    params,
    cfg,
    batch_size=2,
    steps=T // 2,
    seed=1,
    temperature=temperature,
    top_k=top_k,
    return_logits=True,
  )
  logits = out.logits.astype(np.float64) / temperature
  kth = np.sort(logits, axis=-1)[..., -top_k][..., None]
  kept = np.where(logits >= kth, logits, -np.inf)
  logp = (
    kept
    - np.log(np.sum(np.exp(kept - kept.max(-1, keepdims=True)), -1, keepdims=True))
    - kept.max(-1, keepdims=True)
  )
  picked = np.take_along_axis(logp, out.tokens[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(out.logprobs, picked, atol=1e-5, rtol=0)
  raw = np.take_along_axis(
    np.asarray(jax.nn.log_softmax(jnp.asarray(out.logits), -1)), out.tokens[..., None], -1
  )[..., 0]
  np.testing.assert_allclose(out.raw_logprobs, raw, atol=1e-6, rtol=0)
  assert np.all(out.logprobs > out.raw_logprobs - 1e-6)  # filtering moves mass onto the kept


@pytest.mark.parametrize(
  "order,known", default_stage_keeps([("l2r", (0, 1, 2)), ("random", ())], [("random", ())])
)
def test_speculative_logprobs_equal_a_teacher_forced_forward_along_the_order(order, known):
  """Speculative decoding draws from the sequential distribution along its order: each token's
  log-prob is the training forward's at its slot, whichever iteration drew it."""
  cfg, params = cached_model("ao")
  out = speculative.sample(
    params,
    cfg,
    batch_size=2,
    draft=4,
    seed=2,
    order=order,
    known_positions=known,
    known_tokens=[5] * len(known),
  )
  logits = model_lib.make_model(cfg).apply(
    {"params": params}, jnp.asarray(out.tokens), jnp.asarray(out.order)
  )
  labels_BT = np.take_along_axis(out.tokens, out.order, axis=1)
  logp_BT = np.take_along_axis(
    np.asarray(jax.nn.log_softmax(logits, axis=-1)), labels_BT[..., None], axis=-1
  )[..., 0]
  expected = np.zeros_like(logp_BT)
  np.put_along_axis(expected, out.order, logp_BT, axis=1)  # slot s -> position order[s]
  drawn = out.steps >= 0
  assert drawn.sum() == 2 * (T - len(known)) and out.steps.max() < T - len(known)
  np.testing.assert_allclose(out.raw_logprobs[drawn], expected[drawn], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(out.logprobs, out.raw_logprobs)  # temperature 1, no filter


@pytest.mark.parametrize(
  "variant,score",
  default_stage_keeps(
    [("ao", "max_prob"), ("ao", "entropy"), ("sigma", "max_prob")], [("sigma", "max_prob")]
  ),
)
def test_confidence_logprobs_equal_a_forward_on_the_earlier_steps_only(variant, score):
  """Also on sigma-GPT (no AdaLN), which confidence decoding could not run before the engine."""
  cfg, params = cached_model(variant)
  out = confidence.sample(params, cfg, batch_size=2, steps=T // 4, seed=4, score=score)
  drawn = out.steps >= 0
  assert drawn.all()
  np.testing.assert_allclose(out.raw_logprobs, naive_logprobs(cfg, params, out), atol=1e-5, rtol=0)
  np.testing.assert_array_equal(out.logprobs, out.raw_logprobs)
