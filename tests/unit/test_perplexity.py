"""Evaluation: slot/target bookkeeping, the ensemble against a naive one, Jensen, determinism."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.eval import perplexity, scoring

T = 16


@pytest.fixture(scope="module")
def scorer():
  cfg = specs.default().model.replace(block_size=T, vocab_size=64, n_layer=2, n_embd=32, n_head=4)
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  params = jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, params)
  return scoring.Scorer(params, cfg)


def tokens(b=3, seed=0):
  return np.random.default_rng(seed).integers(0, 64, (b, T)).astype(np.int32)


def test_any_order_nll_is_sum_of_training_slot_nlls(scorer):
  x = tokens()
  order = perplexity.random_orders(3, 3, T)
  slot = scorer.slot_nll(x, order)
  logits = np.asarray(
    scorer.model.apply({"params": scorer.params}, jnp.asarray(x), jnp.asarray(order)), np.float64
  )
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  by_hand = -np.take_along_axis(logp, np.take_along_axis(x, order, 1)[..., None], -1)[..., 0]
  np.testing.assert_allclose(slot, by_hand, rtol=1e-5, atol=1e-6)
  # L2R is causal: changing the tokens after position p leaves the NLLs up to p unchanged.
  p = T // 2
  changed = x.copy()
  changed[:, p + 1 :] = (changed[:, p + 1 :] + 1) % 64
  a, b = scoring.l2r_nll(scorer, x), scoring.l2r_nll(scorer, changed)
  np.testing.assert_allclose(a[:, : p + 1], b[:, : p + 1], rtol=1e-6)
  assert np.all(np.abs(a[:, p + 1 :] - b[:, p + 1 :]).max(1) > 1e-4)


def naive_ensemble(scorer, x, order, m, seed):
  """One full forward per (target, reshuffle), the reshuffles drawn like the real one."""
  b = len(x)
  rng = np.random.default_rng(seed)
  logp = np.zeros((b, T, m))
  logp[:, :, 0] = -scorer.slot_nll(x, order)
  perms = {}
  for i in range(T):  # same draw sequence as ensemble_nll: by target, then row, then reshuffle
    for bi in range(b):
      for r in range(1, m):
        perms[bi, i, r] = rng.permutation(np.array(order[bi, :i]))
  for (bi, i, r), p in perms.items():
    full = np.concatenate([p, order[bi, i:]])[None]
    logp[bi, i, r] = -scorer.slot_nll(x[bi : bi + 1], full)[0, i]
  return -np.log(np.exp(logp).mean(-1)), logp


@pytest.mark.slow  # an ensemble of orders against its naive sum (about 18 s)
def test_ensemble_matches_naive_and_jensen(scorer):
  x = tokens(2, seed=1)
  order = perplexity.random_orders(5, 2, T)
  fast, cost = perplexity.ensemble_nll(scorer, x, order, 4, seed=7, max_rows=5)
  slow, logp = naive_ensemble(scorer, x, order, 4, seed=7)
  np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-6)
  assert np.all(fast <= (-logp).mean(-1) + 1e-12)  # Jensen, target by target
  assert cost["full_forward_equivalents_per_target"] < 4 * 0.75


def test_evaluate_blocks_deterministic_and_consistent(scorer):
  blocks = tokens(5, seed=2)
  a = perplexity.evaluate_blocks(scorer, blocks, orders=2, ensemble=(1, 3), batch_size=2, seed=4)
  b = perplexity.evaluate_blocks(scorer, blocks, orders=2, ensemble=(1, 3), batch_size=2, seed=4)
  assert a == b
  assert a["tokens"] == 5 * T and a["any_order_se"] > 0
  assert a["any_order_sequences"] == 5
  # The paper protocol: any-order on a seeded subset of the blocks, L2R and ensemble on all.
  d = perplexity.evaluate_blocks(
    scorer, blocks, orders=2, any_order_blocks=2, ensemble=(3,), batch_size=2, seed=4
  )
  assert d["any_order_sequences"] == 2 and d["sequences"] == 5
  assert d["l2r_ppl"] == a["l2r_ppl"] and d["ensemble_ppl"]["3"] == a["ensemble_ppl"]["3"]
  assert d["any_order_ppl"] != a["any_order_ppl"]
  # Per-sequence NLLs: they average to the totals, and a second model is scored on the same
  # orders (the orders depend on the seed only), so differences are paired.
  e = perplexity.evaluate_blocks(scorer, blocks, orders=2, batch_size=2, seed=4, per_sequence=True)
  assert np.mean(e["l2r_nll_seq"]) == pytest.approx(e["l2r_nll"], rel=1e-12)
  assert np.mean(e["any_order_nll_seq"]) == pytest.approx(e["any_order_nll"], rel=1e-12)
  assert len(e["any_order_nll_seq"]) == 5 and e["any_order_rows"] == list(range(5))

  class Recorder:  # another "model" (NLLs shifted by 1) that records the orders it is given
    block_size, vocab_size, seen = T, 64, []

    def slot_nll(self, tokens_BT, order_BL):
      self.seen.append(np.array(order_BL))
      return scorer.slot_nll(tokens_BT, order_BL) + 1.0

  first, second = Recorder(), Recorder()
  first.seen, second.seen = [], []
  f = perplexity.evaluate_blocks(first, blocks, orders=2, batch_size=2, seed=4, per_sequence=True)
  perplexity.evaluate_blocks(second, blocks, orders=2, batch_size=2, seed=4)
  assert len(first.seen) > 2 and all(np.array_equal(a, b) for a, b in zip(first.seen, second.seen))
  np.testing.assert_allclose(np.subtract(f["any_order_nll_seq"], e["any_order_nll_seq"]), 1.0)


def test_generative_perplexity_and_entropy(scorer):
  samples = tokens(3, seed=3).tolist()
  # Scorer.token_nll drops the first token (the authors score tokens 1..T-1 with GPT-2 Large).
  np.testing.assert_allclose(
    scorer.token_nll(np.asarray(samples)), scoring.l2r_nll(scorer, np.asarray(samples))[:, 1:]
  )

  class Stub:  # NLL of every token of a sample = its first id / 10: per-sample ppl exp(id / 10)
    block_size, vocab_size = 64, 64

    def token_nll(self, ids_BT):
      return np.repeat(ids_BT[:, :1] / 10.0, ids_BT.shape[1] - 1, 1)

  mixed = [[10, 1, 2], [20, 3, 4, 5, 6], [0, 7]]  # re-tokenized texts differ in length
  out = perplexity.generative_perplexity(Stub(), mixed, batch_size=1)
  np.testing.assert_allclose(out["gen_ppl"], (np.e + np.e**2 + 1) / 3, rtol=1e-12)
  np.testing.assert_allclose(out["gen_ppl_median"], np.e, rtol=1e-12)
  assert perplexity.unigram_entropy([5] * 10) == 0.0
  np.testing.assert_allclose(perplexity.unigram_entropy([1, 2, 3, 4]), np.log(4))
  with pytest.raises(ValueError, match="outside the scorer's vocab"):
    perplexity.generative_perplexity(scorer, [[1, 2], [1, 2, 10_000]])


def test_unigram_nll_is_add_one_smoothed():
  counts = np.array([3, 1, 0, 0])  # N = 4, V = 4: p = 4/8, 2/8, 1/8, 1/8
  blocks = np.array([[0, 1], [2, 0]])
  expected = -(2 * np.log(0.5) + np.log(0.25) + np.log(0.125)) / 4
  assert perplexity.unigram_nll(counts, blocks) == pytest.approx(expected, rel=1e-12)


def test_scorer_scores_in_float32_whatever_the_model_trains_in(scorer):
  """Validation during training and `ao-mdm eval` agree: both score through a float32 Scorer by
  default, also for a model that trains in bfloat16."""
  bf16 = scorer.cfg.replace(dtype="bfloat16")
  x, order = tokens(), perplexity.random_orders(5, 3, T)
  same = scoring.Scorer(scorer.params, bf16)
  assert same.cfg.dtype == "float32"
  np.testing.assert_array_equal(same.slot_nll(x, order), scorer.slot_nll(x, order))
  low = scoring.Scorer(scorer.params, bf16, dtype="bfloat16").slot_nll(x, order)
  assert not np.array_equal(low, scorer.slot_nll(x, order))  # the dtype is what changed
  np.testing.assert_allclose(low, scorer.slot_nll(x, order), rtol=0.1)


def test_the_placement_is_built_once(monkeypatch):
  """Loading params into place and the Scorer that scores with them share one mesh and one
  abstract state (eval_command builds both)."""
  from ao_mdm import sharding

  made = []
  make_mesh = sharding.make_mesh
  monkeypatch.setattr(sharding, "make_mesh", lambda *a, **k: made.append(1) or make_mesh(*a, **k))
  cfg = specs.default().model.replace(
    block_size=T, vocab_size=64, n_layer=1, n_embd=16, n_head=2, cond_dim=8
  )
  mesh_cfg = specs.default().mesh
  shardings = sharding.param_shardings(cfg, mesh_cfg)
  params = jax.device_put(nn.unbox(model_lib.init_params(cfg, jax.random.key(0))), shardings)
  scorer = scoring.Scorer(params, cfg, mesh_cfg)
  assert len(made) == 1 and scorer.mesh is sharding.placement(cfg, mesh_cfg)[0]
  assert scorer.slot_nll(tokens(1), np.arange(T)[None]).shape == (1, T)
