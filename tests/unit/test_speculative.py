"""Self-speculative decoding: exact in distribution, equal to sequential decoding when greedy, in
L2R and in random orders with known tokens scattered."""

import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy import stats

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import batching, draft, driver, parallel, protocol, speculative
from ao_mdm.perf import bench_sample
from helpers import default_stage_keeps, naive_greedy, random_model


def _l2r_joint(cfg, params):
  """The enumerated L2R joint p(x) = prod_i p(x_i | x_<i) over all V^T sequences."""
  v, t = cfg.vocab_size, cfg.block_size
  seqs = np.asarray(list(itertools.product(range(v), repeat=t)), np.int32)
  order = np.broadcast_to(np.arange(t, dtype=np.int32), seqs.shape)
  nll = model_lib.slot_nll(model_lib.make_model(cfg), params, jnp.asarray(seqs), jnp.asarray(order))
  return seqs, np.exp(-np.asarray(nll, np.float64).sum(1))


def random_head(cfg, seed=0, scale=4.0):
  """A randomly initialised draft head, its weights scaled so that its drafts are far from
  both uniform and the base's conditionals."""
  head = draft.init_head(cfg, jax.random.key(100 + seed))
  return jax.tree.map(lambda p: p * scale if p.ndim >= 2 else p, head)


def _chi_square(cfg, params, verify, n, head=None):
  seqs, joint = _l2r_joint(cfg, params)
  assert n * joint.min() >= 5, "too few samples for the chi-square test"
  out = speculative.sample(
    params, cfg, batch_size=n, draft=cfg.block_size - 1, seed=7, draft_head=head, verify=verify
  )
  tokens, st = out.tokens, out.stats
  index = np.asarray(tokens) @ (cfg.vocab_size ** np.arange(cfg.block_size)[::-1])
  counts = np.bincount(index, minlength=len(seqs))
  result = stats.chisquare(counts, n * joint / joint.sum())
  return result.statistic, result.pvalue, st


@pytest.mark.slow  # 20,000 draws (about 25 s); the greedy equalities stay in the default stage
@pytest.mark.parametrize("drafter", ["self", "head"])
def test_speculative_samples_follow_the_l2r_joint_and_always_accept_does_not(drafter):
  cfg, params = random_model(v=4, t=3, scale=4.0)
  head = random_head(cfg) if drafter == "head" else None
  stat, p, st = _chi_square(cfg, params, verify=True, n=20_000, head=head)
  accepted = st["accepted"].mean()
  # A draft drawn from its proposal q is accepted with probability sum_x min(p, q): the count
  # of accepted first drafts must match the summed probabilities (binomial SE).
  verified, hits, expected = (
    st["first_drafts"].sum(),
    st["first_accepted"].sum(),
    st["first_overlap"].astype(np.float64).sum(),
  )
  se = np.sqrt(expected * (1 - expected / verified))
  print(f"first drafts: {hits} of {verified} accepted, expected {expected:.1f} +- {se:.1f}")
  assert abs(hits - expected) < 5 * se and 0.05 < hits / verified < 0.95
  wrong_stat, wrong_p, _ = _chi_square(cfg, params, verify=False, n=20_000, head=head)
  print(
    f"speculative: chi2={stat:.1f} p={p:.3f} (accepted {accepted:.2f} drafts per row); "
    f"always accept: chi2={wrong_stat:.1f} p={wrong_p:.2e}"
  )
  assert p > 1e-3 and accepted > 0.2  # drafts are accepted, and the output is still exact
  assert wrong_p < 1e-6


def _order_joint(cfg, params, known_pos, known_tok):
  """Every (order, sequence) of a random order of the unknown positions after the known ones,
  with its probability: 1 / u! times the sequential joint prod_s p(x_order[s] | earlier)."""
  v, t = cfg.vocab_size, cfg.block_size
  unknown = [p for p in range(t) if p not in known_pos]
  orders = [list(known_pos) + list(o) for o in itertools.permutations(unknown)]
  fills = list(itertools.product(range(v), repeat=len(unknown)))
  seqs = np.zeros((len(orders) * len(fills), t), np.int32)
  seqs[:, known_pos] = known_tok
  seqs[:, unknown] = np.tile(np.asarray(fills, np.int32), (len(orders), 1))
  order = np.repeat(np.asarray(orders, np.int32), len(fills), axis=0)
  nll = model_lib.slot_nll(model_lib.make_model(cfg), params, jnp.asarray(seqs), jnp.asarray(order))
  logp = -np.asarray(nll, np.float64)[:, len(known_pos) :].sum(1)
  return seqs, order, np.exp(logp) / len(orders)


def _order_chi_square(cfg, params, verify, n, known_pos, known_tok, head=None):
  seqs, order, joint = _order_joint(cfg, params, known_pos, known_tok)
  assert n * joint.min() >= 5, "too few samples for the chi-square test"
  out = speculative.sample(
    params,
    cfg,
    batch_size=n,
    draft=2,
    seed=3,
    known_positions=known_pos,
    known_tokens=known_tok,
    order="random",
    draft_head=head,
    verify=verify,
  )
  out_tok, out_order = out.tokens, out.order
  cell = {(tuple(o), tuple(x)): i for i, (o, x) in enumerate(zip(order.tolist(), seqs.tolist()))}
  index = [
    cell[(tuple(o), tuple(x))]
    for o, x in zip(np.asarray(out_order).tolist(), np.asarray(out_tok).tolist())
  ]
  counts = np.bincount(index, minlength=len(seqs))
  return stats.chisquare(counts, n * joint / joint.sum()).pvalue


@pytest.mark.slow  # 20 s each; the greedy random-order tests stay in the default stage
@pytest.mark.parametrize("drafter", ["self", "head"])
def test_random_order_speculative_samples_follow_the_sequential_joint(drafter):
  """T = 4 with position 1 known: 3! orders x 3^3 fills; drafts of 2 tokens per forward."""
  cfg, params = random_model(v=3, t=4, scale=4.0, seed=2)
  head = random_head(cfg, seed=2) if drafter == "head" else None
  p = _order_chi_square(cfg, params, True, 30_000, [1], [2], head)
  wrong_p = _order_chi_square(cfg, params, False, 30_000, [1], [2], head)
  print(f"random-order speculative: p={p:.3f}; always accept: p={wrong_p:.2e}")
  assert p > 1e-3 and wrong_p < 1e-6


@pytest.mark.parametrize("drafter", ["self", "head"])
def test_greedy_random_order_speculative_equals_greedy_sequential_decoding(drafter):
  cfg, params = random_model(v=64, t=16, scale=4.0, seed=1)
  known = dict(known_positions=[0, 5, 6, 11], known_tokens=[5, 9, 3, 7])
  head = random_head(cfg, seed=1) if drafter == "head" else None
  out = speculative.sample(
    params, cfg, batch_size=3, draft=4, temperature=0.0, order="random", draft_head=head, **known
  )
  order = out.order
  assert np.all(order[:, :4] == [0, 5, 6, 11]) and len({tuple(o) for o in order}) == 3
  start = np.zeros_like(out.tokens)
  start[:, known["known_positions"]] = known["known_tokens"]
  one_per_step = np.arange(4, cfg.block_size + 1)  # sequential: one token per step
  want, _ = naive_greedy(cfg, params, start, order, one_per_step)
  np.testing.assert_array_equal(out.tokens, want)
  assert np.all(out.stats["forwards"] <= 12)


@pytest.mark.parametrize(
  "draft_len,drafter", [(4, "self"), (4, "head"), pytest.param(1, "self", marks=pytest.mark.slow)]
)
def test_greedy_speculative_equals_greedy_l2r(draft_len, drafter):
  cfg, params = random_model(v=64, t=16, scale=4.0, seed=1)
  prompt = dict(known_positions=[0, 1, 2], known_tokens=[5, 9, 3])
  want = parallel.sample(
    params, cfg, batch_size=3, steps=13, temperature=0.0, order="l2r", **prompt
  ).tokens
  head = random_head(cfg, seed=1) if drafter == "head" else None
  out = speculative.sample(
    params, cfg, batch_size=3, draft=draft_len, temperature=0.0, draft_head=head, **prompt
  )
  np.testing.assert_array_equal(out.tokens, want)
  assert np.all(out.stats["forwards"] <= 13)


@pytest.mark.parametrize("drafter", ["self", "head"])
def test_top_k_one_speculative_equals_greedy_l2r(drafter):
  """top-k filtering reaches drafts and verifier alike ([B, W, V] logits): with k = 1 the
  samples at temperature 1 are the greedy L2R tokens."""
  cfg, params = random_model(v=64, t=16, scale=4.0, seed=1)
  want = parallel.sample(params, cfg, batch_size=2, steps=16, temperature=0.0, order="l2r").tokens
  head = random_head(cfg, seed=1) if drafter == "head" else None
  out = speculative.sample(params, cfg, batch_size=2, draft=3, top_k=1, top_p=0.9, draft_head=head)
  np.testing.assert_array_equal(out.tokens, want)


def test_inverse_cdf_draw_follows_the_probabilities_and_never_draws_a_zero():
  from ao_mdm.decode import common

  probs = jnp.asarray([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
  n = 100_000
  u = jax.random.uniform(jax.random.key(0), (n,))
  drawn = np.asarray(common.draw_from_probs(u, jnp.broadcast_to(probs, (n, 6))))
  counts = np.bincount(drawn, minlength=6)
  assert counts[[0, 2, 5]].sum() == 0
  assert stats.chisquare(counts[[1, 3, 4]], n * np.asarray([0.2, 0.5, 0.3])).pvalue > 1e-3
  # u just below 1 (its product with the total can round up to it): the last nonzero token.
  edge = common.draw_from_probs(jnp.asarray([0.0, 1 - 2**-24]), jnp.stack([probs, probs]))
  np.testing.assert_array_equal(edge, [1, 4])


def test_bad_draft_length():
  cfg = specs.default().model.replace(block_size=4)
  with pytest.raises(ValueError, match="draft=4 must be in"):
    speculative.sample(None, cfg, batch_size=1, draft=4)  # refused before params are used


@pytest.mark.slow  # seven compiles, 25 s: the default stage stays under 10 minutes
def test_bench_counts_every_seed():
  cfg, params = random_model(v=16, t=8, scale=4.0)
  bench = ml_collections.ConfigDict({"speculative_batches": (2,), "seeds": 2, "drafts": (2,)})
  head = random_head(cfg)
  rows = bench_sample.bench_speculative(bench, params, cfg, draft_head=head)["rows"]
  assert [(r["order"], r["drafter"]) for r in rows] == [
    ("l2r", "self"),
    ("l2r", "head"),
    ("infill", "self"),
    ("infill", "head"),
  ]
  positions, ids = bench_sample.infill_context(params, cfg)
  assert positions == [0, 1, 6, 7]
  for row in rows:
    known = {} if row["order"] == "l2r" else dict(known_positions=positions, known_tokens=ids)
    outs = [
      speculative.sample(
        params,
        cfg,
        batch_size=2,
        draft=2,
        seed=s,
        order="random" if known else "l2r",
        draft_head=head if row["drafter"] == "head" else None,
        **known,
      )
      for s in range(2)
    ]
    forwards = np.mean([o.stats["forwards"] for o in outs])
    assert row["forwards_per_sequence"] == pytest.approx(forwards)
    assert row["tokens_per_forward"] == pytest.approx((8 if not known else 4) / forwards)
    assert 0 <= row["first_draft_acceptance"] <= 1 and 0 < row["first_draft_overlap"] <= 1


@pytest.mark.parametrize("temperature", default_stage_keeps([1.0, 0.0], [1.0]))
def test_rows_in_the_continuous_batcher_decode_as_they_do_alone(temperature):
  """Speculative through batching.Batcher (the server's and GRPO's driver): requests of other
  lengths, orders and plans join and leave a batch of 2 rows, each giving the tokens, order,
  log-probs and forwards of its plan decoded alone by the static driver with its seed; a
  request of `steps` steps verifies ceil(unknown / steps) drafts per forward, at most k (then
  it is speculative.sample's)."""
  cfg, params = random_model(v=64, t=16, scale=4.0, seed=1)
  spec = speculative.continuing(cfg, protocol.Continuing(3, order="random"))
  batcher = batching.Batcher(params, spec, batch=2, max_steps=16)
  cases = [
    ((0, 1, 2), 5, 3),
    ((), 16, 1),
    ((0, 4, 9), 7, 2),
    ((2,), 3, 3),
  ]  # (known, steps, drafts)
  requests = [
    batching.Request(pos, tuple(7 + p for p in pos), steps, seed=i, temperature=temperature)
    for i, (pos, steps, _) in enumerate(cases)
  ]
  done = driver.decode_all(batcher, requests)
  for (pos, steps, drafts), request, got in zip(cases, requests, done):
    tokens, known = np.zeros((1, 16), np.int32), np.zeros((1, 16), bool)
    tokens[0, list(pos)], known[0, list(pos)] = request.token_ids, True
    plan = spec.plan_request(len(pos), 16, steps, "linear", 16)
    assert plan.extent[2] == drafts
    draw = (jnp.float32(temperature), jnp.float32(1.0), jnp.int32(0))
    ref = protocol.decoder(spec, plan)(params, tokens, known, jax.random.key(request.seed), *draw)
    np.testing.assert_array_equal(got.order, ref.rows.order_BT[0])
    np.testing.assert_array_equal(got.tokens, ref.rows.tokens_BT[0])
    np.testing.assert_allclose(got.logprobs, ref.rows.drawn.logprob_BT[0], atol=1e-5)
    assert got.forwards == ref.rows.forwards_B[0]
    if drafts == 3:  # the spec's own k: the public sampler's
      out = speculative.sample(
        params, cfg, batch_size=1, draft=3, order="random", seed=request.seed,
        temperature=temperature, known_positions=pos, known_tokens=request.token_ids,
      )  # fmt: skip
      np.testing.assert_array_equal(got.tokens, out.tokens[0])
  assert len({f.forwards for f in done}) > 1
