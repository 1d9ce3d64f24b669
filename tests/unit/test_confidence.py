"""Confidence-ordered unmasking commits the most confident positions first."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import confidence, schedules


def _position_confident_model(alpha):
  """An AO-GPT whose logits depend only on the target position p: logit 0 = D * silu(alpha[p]),
  the others 0, so the prediction for p is more confident the larger alpha[p]."""
  t = len(alpha)
  cfg = specs.default().model.replace(
    vocab_size=8, block_size=t, n_layer=1, n_embd=16, n_head=2, cond_dim=16
  )
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  d = cfg.n_embd
  params["target_embed"] = jnp.asarray(np.repeat(np.asarray(alpha, np.float32)[:, None], d, 1))
  params["ln_f"]["scale"] = jnp.zeros(d)  # the context never reaches the logits
  kernel = np.zeros((d, 2, d), np.float32)
  kernel[:, 0, :] = np.eye(d)  # the final AdaLN shift is silu(target embedding)
  params["final_adaln"] = {"kernel": jnp.asarray(kernel), "bias": jnp.zeros((2, d))}
  head = np.zeros((d, cfg.vocab_size), np.float32)
  head[:, 0] = 1.0
  params["head"] = {"kernel": jnp.asarray(head), "bias": jnp.zeros(cfg.vocab_size)}
  return cfg, params


@pytest.mark.slow  # test_cached_equals_naive_full_forwards covers the order in the default stage
@pytest.mark.parametrize("score", ["max_prob", "entropy"])
def test_the_most_confident_position_is_committed_first(score):
  alpha = np.asarray([0.3, 2.0, 0.1, 1.5, 0.7, 2.5, 0.2, 1.0]) / 10  # softmax not saturated
  cfg, params = _position_confident_model(alpha)
  out = confidence.sample(params, cfg, batch_size=2, steps=8, temperature=0.0, score=score)
  np.testing.assert_array_equal(out.order[0], np.argsort(-alpha, kind="stable"))
  np.testing.assert_array_equal(out.order[1], out.order[0])
  # Two per step: the two most confident of what is left; a prompt stays first.
  out = confidence.sample(
    params,
    cfg,
    batch_size=1,
    steps=3,
    temperature=0.0,
    score=score,
    known_positions=[5, 6],
    known_tokens=[3, 4],
  )
  np.testing.assert_array_equal(out.order[0, :2], [5, 6])
  assert set(out.order[0, 2:4]) == {1, 3} and set(out.order[0, 4:6]) == {7, 4}
  np.testing.assert_array_equal(out.tokens[0, [5, 6]], [3, 4])


@pytest.mark.slow
def test_each_row_draws_from_the_model_with_its_own_key():
  """Temperature 1: every position's token is drawn from its softmax (the model's logits depend
  on the position alone), each row independently (a key per row): a counts test per position."""
  alpha = np.asarray([0.3, 2.0, 0.1, 1.5]) / 10
  cfg, params = _position_confident_model(np.concatenate([alpha, alpha]))
  rows = 3000
  out = confidence.sample(params, cfg, batch_size=rows, steps=4, seed=3)
  d = cfg.n_embd
  for p, a in enumerate(alpha):
    logits = np.zeros(cfg.vocab_size)
    logits[0] = d * a / (1 + np.exp(-a))  # D * silu(alpha)
    probs = np.exp(logits) / np.exp(logits).sum()
    counts = np.bincount(out.tokens[:, p], minlength=cfg.vocab_size)
    assert stats.chisquare(counts, probs * rows).pvalue > 1e-3, (p, counts)
  pairs = np.bincount(out.tokens[:, 0] * 8 + out.tokens[:, 1], minlength=64)  # rows independent
  expected = np.outer(*[np.bincount(out.tokens[:, i], minlength=8) / rows for i in (0, 1)])
  assert stats.chisquare(pairs, expected.ravel() * rows, ddof=14).pvalue > 1e-3


@pytest.mark.slow
def test_ties_break_by_position():
  cfg, params = _position_confident_model(np.full(6, 0.5))
  out = confidence.sample(params, cfg, batch_size=1, steps=6, temperature=0.0)
  np.testing.assert_array_equal(out.order[0], np.arange(6))


def naive_greedy(cfg, params, steps, score, known_positions=(), known_tokens=(), end=None):
  """Greedy confidence decoding by full forwards: each unknown p before `end` scored at slot n
  with the order so far plus p (`score`: a name in options.SCORES or a numpy function of the
  logits), the best n_i - n_{i-1} committed in confidence order."""

  t = cfg.block_size
  end = end or t
  # One compiled forward over t candidate rows (padded with copies): one row per unknown p.
  forward = jax.jit(lambda tok, o: model_lib.make_model(cfg).apply({"params": params}, tok, o))
  tokens = np.zeros(t, np.int32)
  tokens[list(known_positions)] = known_tokens
  order = sorted(known_positions)
  counts = schedules.schedule_counts(end, len(order), steps, "linear")
  for n, n_next in zip(counts[:-1], counts[1:]):
    unknown = [p for p in range(end) if p not in order]
    rest = lambda p: [q for q in range(t) if q not in order and q != p]  # later slots: causal
    orders = np.asarray([order + [p] + rest(p) for p in unknown], np.int32)
    orders = np.concatenate([orders, np.repeat(orders[-1:], t - len(unknown), 0)])
    logits = forward(jnp.asarray(np.repeat(tokens[None], t, 0)), jnp.asarray(orders))[
      : len(unknown), n
    ]
    named = lambda x: confidence.confidence_score(x, score)
    conf = np.asarray((score if callable(score) else named)(np.asarray(logits)))
    best = np.argsort(-conf, kind="stable")[: n_next - n]
    for i in best:
      tokens[unknown[i]] = int(np.argmax(logits[i]))
      order.append(unknown[i])
  return tokens, np.asarray(order + list(range(end, t)))


@pytest.mark.parametrize(
  "steps,known",
  [(5, 3), pytest.param(12, 0, marks=pytest.mark.slow), pytest.param(4, 0, marks=pytest.mark.slow)],
)
def test_cached_equals_naive_full_forwards(steps, known):
  cfg = specs.default().model.replace(
    vocab_size=32, block_size=12, n_layer=2, n_embd=32, n_head=4, cond_dim=16
  )
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(3)))
  params = jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)
  prompt = dict(known_positions=[2, 7, 9][:known], known_tokens=[4, 5, 6][:known])
  want_tokens, want_order = naive_greedy(cfg, params, steps, "max_prob", **prompt)
  out = confidence.sample(params, cfg, batch_size=1, steps=steps, temperature=0.0, **prompt)
  np.testing.assert_array_equal(out.order[0], want_order)
  np.testing.assert_array_equal(out.tokens[0], want_tokens)


def test_confidence_stops_at_end():
  """Positions from `end` on are never candidates: 0 in the output, last in the order."""
  cfg = specs.default().model.replace(
    vocab_size=32, block_size=12, n_layer=2, n_embd=32, n_head=4, cond_dim=16
  )
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(3)))
  params = jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)
  prompt = dict(known_positions=[2, 7], known_tokens=[4, 5])
  want_tokens, want_order = naive_greedy(cfg, params, 3, "max_prob", end=8, **prompt)
  out = confidence.sample(params, cfg, batch_size=1, steps=3, temperature=0.0, end=8, **prompt)
  np.testing.assert_array_equal(out.order[0], want_order)
  np.testing.assert_array_equal(out.tokens[0], want_tokens)
  assert np.all(out.tokens[0, 8:] == 0)
