"""Exact infill likelihood (eval/infill.py): the batched, padded scorer against one forward per
span token, and a hand-made task that a trained model must get right."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ao_mdm import model as model_lib
from ao_mdm import orders as orders_lib
from ao_mdm import specs
from ao_mdm.eval import infill, scoring

V, T = 64, 32


def _scorer(params=None, seed=0):
  cfg = specs.default().model.replace(block_size=T, vocab_size=V, n_layer=2, n_embd=32, n_head=4)
  if params is None:
    params = nn.unbox(model_lib.init_params(cfg, jax.random.key(seed)))
    params = jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, params)  # peaked predictions
  return scoring.Scorer(params, cfg)


def naive_infill_nll(scorer, prefix, span, suffix, span_order):
  """One unpadded forward per span token: its slot comes right after the prefix, the suffix and
  the span tokens before it in `span_order`; every later position follows in any order."""
  p, s = len(prefix), len(span)
  tokens = np.asarray([*prefix, *span, *suffix], np.int32)[None]
  context = [*range(p), *range(p + s, len(tokens[0]))]
  out = []
  for j, position in enumerate(span_order):
    before = [p + int(k) for k in span_order[:j]]
    rest = [p + int(k) for k in span_order[j + 1 :]]
    order = np.asarray([*context, *before, p + int(position), *rest], np.int32)[None]
    out.append(scorer.slot_nll(tokens, order)[0, len(context) + j])
  return np.asarray(out)


def test_batched_infill_equals_one_forward_per_span_token():
  scorer = _scorer()
  rng = np.random.default_rng(1)
  items = []
  for p, s, u in [(5, 3, 7), (0, 4, 9), (12, 1, 0), (3, 10, 19), (0, 32, 0), (20, 6, 2)]:
    ids = lambda n: rng.integers(0, V, n).tolist()
    kind = ("l2r", "r2l", "random")[len(items) % 3]
    items.append((ids(p), ids(s), ids(u), infill.span_order(s, kind, seed=len(items))))
  fast = infill.infill_nll(scorer, items, batch_size=4, bucket=8)  # two batches, padded rows
  for item, nll in zip(items, fast):
    naive = naive_infill_nll(scorer, *item)
    assert nll.shape == (len(item[1]),)
    np.testing.assert_allclose(nll, naive, rtol=1e-5, atol=1e-5)
  # The order inside the span changes the factors but, for a model that is not exact, not
  # only their sum; l2r and r2l of one span differ somewhere.
  prefix, span, suffix, _ = items[3]
  l2r, r2l = infill.infill_nll(
    scorer,
    [
      (prefix, span, suffix, infill.span_order(10, "l2r")),
      (prefix, span, suffix, infill.span_order(10, "r2l")),
    ],
  )
  assert not np.allclose(l2r, r2l[::-1])


def test_infill_layout_errors():
  with pytest.raises(ValueError, match="at least one token"):
    infill.layout([1], [], [2])
  with pytest.raises(ValueError, match="no permutation of 0..2"):
    infill.layout([1], [3, 4, 5], [2], np.array([0, 0, 2]))
  with pytest.raises(ValueError, match="span order 'zigzag'; accepted: l2r, r2l, random"):
    infill.span_order(3, "zigzag")
  with pytest.raises(
    ValueError, match="infill 2: an infill span of 33 tokens is longer than the model's T=32"
  ):
    infill.infill_nll(_scorer(), [([1], [2], [3]), ([1], [2] * 33, [3])])


def test_a_long_infill_keeps_the_context_nearest_its_span():
  p, u = list(range(20)), list(range(100, 103))
  assert infill.fit(p, [7] * 4, u, 16) == (p[-9:], u)  # the short suffix leaves room for more
  assert infill.fit(p, [7] * 4, p, 16) == (p[-6:], p[:6])
  assert infill.fit(p[:2], [7] * 4, p, 16) == (p[:2], p[:10])
  assert infill.fit(p, [7] * 16, p, 16) == ([], [])
  scorer = _scorer()
  rng = np.random.default_rng(2)
  prefix, span, suffix = (rng.integers(0, V, n).tolist() for n in (30, 5, 40))
  (cut,) = infill.infill_nll(scorer, [(prefix, span, suffix)])
  kept = infill.fit(prefix, span, suffix, T)
  np.testing.assert_allclose(
    cut, naive_infill_nll(scorer, kept[0], span, kept[1], np.arange(5)), rtol=1e-5, atol=1e-5
  )


def _count(start, n):
  return [(start + i) % V for i in range(n)]


@pytest.mark.slow  # about 40 s of training
def test_a_trained_model_fills_in_the_right_span():
  """Sequences count up mod V from a random start; trained on random orders, the model scores
  the true middle of a sequence above a shifted, a reversed and a repeated one."""
  scorer = _scorer()
  model, params = scorer.model, nn.unbox(model_lib.init_params(scorer.cfg, jax.random.key(0)))
  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, key):
    k1, k2 = jax.random.split(key)
    tokens = (jax.random.randint(k1, (32, 1), 0, V) + jnp.arange(T)) % V
    order = orders_lib.random_orders(k2, 32, T)
    loss, grads = jax.value_and_grad(lambda p: model_lib.slot_nll(model, p, tokens, order).mean())(
      params
    )
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  key = jax.random.key(1)
  for _ in range(600):
    key, sub = jax.random.split(key)
    params, opt_state, loss = step(params, opt_state, sub)
  assert float(loss) < 1.0, float(loss)  # slot 0 alone costs log(V) / T = 0.13
  scorer.set_params(params)
  wins = 0
  for start in range(0, V, 8):
    prefix, span, suffix = _count(start, 6), _count(start + 6, 5), _count(start + 11, 6)
    candidates = [span, [(t + 1) % V for t in span], span[::-1], [span[0]] * 5]
    nll = infill.infill_nll(scorer, [(prefix, c, suffix) for c in candidates])
    logp = [-float(n.sum()) for n in nll]
    wins += int(np.argmax(logp) == 0)
  assert wins == V // 8
