"""Continuous batching: rows that join and leave a running batch decode as they do alone."""

import dataclasses
import itertools

import numpy as np
import pytest
from scipy import stats
from scipy.special import logsumexp
from test_parallel import T, cached_model, tiny_model

from ao_mdm.decode import batching, driver, parallel, schedules
from ao_mdm.train import grpo
from helpers import default_stage_keeps, filtered_probs

# (known positions, steps, end): prompts of 0, 3 and 7 tokens, an infill that ends at its text,
# plans of T, T/4 and T/8 steps.
REQUESTS = [
  ((), T, None),
  (tuple(range(3)), 8, None),
  (tuple(range(7)), T - 7, None),
  ((0, 1, 5, 6), 4, 12),
  ((), 4, None),
  (tuple(range(3)), T - 3, None),
]
ARRIVALS = [0, 0, 1, 3, 3, 9]  # the engine step each request arrives at


def alone(params, cfg, req, order):
  return parallel.sample(
    params,
    cfg,
    batch_size=1,
    steps=req.steps,
    seed=req.seed,
    temperature=req.temperature,
    known_positions=req.positions,
    known_tokens=req.token_ids,
    order=order,
    end=req.end,
  )


@pytest.mark.parametrize(
  "order,temperature",
  default_stage_keeps([("l2r", 0.0), ("random", 0.0), ("random", 1.0)], []),  # 20-40 s each
)
def test_rows_that_join_and_leave_decode_as_they_do_alone(order, temperature):
  cfg, params = cached_model("ao")
  prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, T)
  reqs = [
    batching.Request(
      pos, tuple(int(prompt[p]) for p in pos), steps, end=end, seed=i, temperature=temperature
    )
    for i, (pos, steps, end) in enumerate(REQUESTS)
  ]
  plans = [
    parallel.Plan.make(schedules.block_counts(r.end or T, len(r.positions), r.steps, "linear"))
    for r in reqs
  ]
  widths = parallel.Plan.widths(
    max(p.real_width for p in plans), max(p.phantom_width for p in plans)
  )
  spec = parallel.DecoderSpec(model=cfg, plan=widths, order=order)
  engine = batching.Batcher(params, spec, batch=3, max_steps=T)
  pending, finished, step = list(zip(ARRIVALS, reqs)), {}, 0
  while pending or any(r is not None for r in engine.requests):
    while pending and pending[0][0] <= step and engine.free_rows():
      engine.add(pending.pop(0)[1])
    for f in engine.step():
      finished[f.request.seed] = f
    step += 1
  assert sorted(finished) == list(range(len(reqs)))
  lengths = {f.forwards for f in finished.values()}
  assert len(lengths) > 2  # rows finished at different lengths
  for i, req in enumerate(reqs):
    ref = alone(params, cfg, req, order)
    got = finished[i]
    np.testing.assert_array_equal(got.order, ref.order[0])
    np.testing.assert_array_equal(got.tokens, ref.tokens[0])
    np.testing.assert_allclose(got.logprobs, ref.logprobs[0], atol=1e-5)
    assert got.forwards == req.steps


def test_the_tokens_of_one_step_are_independent_draws_of_their_conditionals():
  """Chi-square on counts, for the per-row draw keys: in L2R with two tokens per step, step 0
  draws positions 0 and 1 from the [None] slot alone, so over 4000 rows their pairs follow the
  product of the two conditionals."""
  cfg, params = tiny_model(vocab=4)
  out = parallel.sample(
    params, cfg, batch_size=4000, steps=T // 2, order="l2r", seed=7, return_logits=True
  )
  logits = out.logits[0, :2].astype(np.float64)
  p0, p1 = np.exp(logits - logsumexp(logits, axis=-1, keepdims=True))
  np.testing.assert_allclose(out.logits[:, :2], np.broadcast_to(out.logits[:1, :2], (4000, 2, 4)))
  pairs = np.bincount(out.tokens[:, 0] * 4 + out.tokens[:, 1], minlength=16)
  expected = np.outer(p0, p1).ravel()
  assert stats.chisquare(pairs, expected / expected.sum() * 4000).pvalue > 1e-3


def test_a_request_needing_wider_chunks_than_the_batch_is_refused():
  """Each width is checked on its own: 4 real and 3 phantom slots do not fit 5 + 1."""
  cfg, params = cached_model("ao")
  spec = parallel.DecoderSpec(model=cfg, plan=parallel.Plan.widths(5, 1))
  engine = batching.Batcher(params, spec, batch=1, max_steps=T)
  with pytest.raises(ValueError, match=r"needs 8 steps of 4 real \+ 3 phantom slots; .* 5 \+ 1"):
    engine.add(batching.Request(steps=8))
  assert engine.free_rows() == 1


@pytest.mark.parametrize("temperature", default_stage_keeps([0.0, 1.0], [1.0]))
def test_a_prompt_sharing_a_prefix_copies_its_cache_and_decodes_as_computed(temperature):
  """Prompts that share 10-12 tokens with an earlier one copy those cache slots (Batcher's
  prefixes): the same tokens as when computed, log-probs within 1e-5 (the slots after the copy
  are computed reading the cache rather than in one causal forward)."""
  cfg, params = cached_model("ao")
  rng = np.random.default_rng(3)
  shared = rng.integers(0, cfg.vocab_size, 12).tolist()
  prompts = [shared + rng.integers(0, cfg.vocab_size, n).tolist() for n in (4, 0, 7, 2, 9)]
  prompts.append(shared[:10])  # itself a prefix of the stored prompts
  requests = [
    batching.prompt_request(p, T, 1, seed=i, temperature=temperature) for i, p in enumerate(prompts)
  ]
  runs = []
  for prefixes in (0, 4):
    b = batching.Batcher.continuing(params, cfg, batch=2, tokens_per_step=1, prefixes=prefixes)
    runs.append((driver.decode_all(b, requests), b.reused_slots))
  (computed, none), (copied, slots) = runs
  assert none == 0 and slots >= 10 * (len(prompts) - 2)
  for a, b in zip(computed, copied):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, atol=1e-5)


def test_rows_joining_with_one_prompt_share_its_prefill_and_decode_as_they_do_alone():
  """8 rows joining at once, 3 answers to each of 2 prompts and 2 to an infill (a GRPO round's
  groups): one prefill forward of the 3 distinct prompts (4 rows: 2 and up round alike), each
  row's tokens and log-probs those it draws alone."""
  cfg, params = cached_model("ao")
  rng = np.random.default_rng(5)
  prompts = [(tuple(range(n)), tuple(rng.integers(0, cfg.vocab_size, n).tolist())) for n in (5, 9)]
  prompts.append(((0, 3, 8), tuple(rng.integers(0, cfg.vocab_size, 3).tolist())))
  reqs = [
    batching.Request(pos, ids, schedules.steps_within(T, len(pos), 2), seed=10 * i + j)
    for i, (pos, ids) in enumerate(prompts)
    for j in range(3 if i < 2 else 2)
  ]
  b = batching.Batcher.continuing(params, cfg, batch=8, tokens_per_step=2)
  forwards = []
  prefill = b._prefill
  b._prefill = lambda params, tokens, *a: (
    forwards.append(tokens.shape[0]) or prefill(params, tokens, *a)
  )
  done = driver.decode_all(b, reqs)
  assert forwards == [4]
  one = batching.Batcher(params, b.spec, batch=2, max_steps=T)  # each request alone in turn
  for req, got in zip(reqs, done):
    (ref,) = driver.decode_all(one, [req])
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.order, ref.order)
    np.testing.assert_allclose(got.raw_logprobs, ref.raw_logprobs, atol=1e-5)


def test_steps_within_commit_at_most_the_asked_tokens_per_step():
  """The schedule's float32 rounding can put k + 1 tokens in a step of ceil(n / k) steps (a
  batch built for k per forward refused such a request): steps_within adds steps until none
  does, and no fewer steps would do."""
  grew = 0
  for t, known, k, block in itertools.product((16, 64), range(0, 14, 3), (1, 2, 3, 5), (None, 4)):
    s = schedules.steps_within(t, known, k, block_len=block)
    assert np.diff(schedules.block_counts(t, known, s, "linear", block)).max() <= k
    fewest = max(-(-(t - known) // k), -(-(t - known) // block) if block else 1)
    if s > fewest:
      grew += 1
      too_few = schedules.block_counts(t, known, s - 1, "linear", block)
      assert np.diff(too_few).max() > k
  assert grew > 0  # the rounding case occurs on this grid


def test_rows_mixed_in_one_batch_draw_from_their_own_filtered_distributions():
  """Counts test: rows of three draw settings decode in the same batch (the continuous batcher
  the server and GRPO run), each from its own filtered distribution; every row's first token
  after the same prompt, chi-square against the distribution written out in numpy."""
  cfg, params = tiny_model(vocab=16)
  prompt = [3, 1, 4]
  settings = [(1.0, 1.0, 2), (1.0, 0.6, 0), (0.8, 1.0, 0)]  # (temperature, top_p, top_k)
  per_setting = 400
  requests = [
    batching.Request((0, 1, 2), tuple(prompt), 1, end=4, seed=i, temperature=tt, top_p=p, top_k=k)
    for i in range(per_setting)
    for tt, p, k in settings
  ]
  batcher = batching.Batcher.continuing(params, cfg, batch=len(requests), tokens_per_step=1)
  done = driver.decode_all(batcher, requests)
  logits = parallel.sample(
    params, cfg, batch_size=1, steps=1, order="l2r", known_positions=(0, 1, 2),
    known_tokens=prompt, end=4, return_logits=True,
  ).logits[0, 3].astype(np.float64)  # fmt: skip
  for j, (tt, p, k) in enumerate(settings):
    drawn = np.asarray([f.tokens[3] for f in done[j :: len(settings)]])
    expected = filtered_probs(logits, tt, p, k)
    assert set(np.unique(drawn)) <= set(np.flatnonzero(expected)), (tt, p, k)
    support = np.flatnonzero(expected)
    counts = np.asarray([np.sum(drawn == v) for v in support])
    assert stats.chisquare(counts, expected[support] * per_setting).pvalue > 1e-3, (tt, p, k)
  assert 1 < len(np.flatnonzero(filtered_probs(logits, 1.0, 0.6, 0))) < cfg.vocab_size


@pytest.mark.slow  # three batchers of their own (about 20 s here)
def test_the_state_holds_two_rows_while_only_rows_0_and_1_are_busy():
  """A lone request runs at two rows, not at the batch's; the state grows to the batch when a
  third row is taken and back when only rows 0-1 are left; every request decodes as alone, and
  a row's log-probs are bitwise those of the same request in a full batch (not at one row:
  XLA:CPU's single-row kernels round otherwise)."""
  cfg, params = cached_model("ao")
  b = batching.Batcher.continuing(params, cfg, batch=4, tokens_per_step=1)
  size = lambda: b.state.rows.active_B.shape[0]
  long, short = (batching.prompt_request([3, 1, 4], T, 1, seed=s) for s in (0, 1))
  short = dataclasses.replace(short, end=8, steps=5)
  row = b.add(long)
  b.step()
  assert row == 0 and size() == 2
  b.add_many([short, short])
  sizes, done = [size()], []
  while any(q is not None for q in b.requests):
    done += b.step()
    sizes.append(size())
  assert sizes[0] == 4 and sizes[-2:] == [2, 2] and len(done) == 3
  for f in done:
    np.testing.assert_array_equal(f.tokens, alone(params, cfg, f.request, "l2r").tokens[0])
  full = batching.Batcher.continuing(params, cfg, batch=4, tokens_per_step=1)
  together = driver.decode_all(full, [long, *[dataclasses.replace(long, seed=9)] * 3])[0]
  np.testing.assert_array_equal(together.raw_logprobs, done[-1].raw_logprobs)


def test_a_call_runs_on_until_stop_after_rows_finished_and_rows_decode_as_they_would_have():
  """step(stop_after=k) ends once k of its rows finished (0: once all did), not at the first:
  fewer calls, the same tokens."""
  cfg, params = cached_model("ao")
  reqs = [
    dataclasses.replace(batching.prompt_request([3, 1, 4], T, 1, seed=i), end=5 + i, steps=2 + i)
    for i in range(4)
  ]
  tokens = {}
  for k, want in ((1, [[0], [1], [2], [3]]), (2, [[0, 1], [2, 3]]), (0, [[0, 1, 2, 3]])):
    b = batching.Batcher.continuing(params, cfg, batch=4, tokens_per_step=1)
    b.add_many(reqs)
    calls = []
    while any(q is not None for q in b.requests):
      done = b.step(T, stop_after=k)
      calls.append(sorted(reqs.index(f.request) for f in done))
      tokens.update({(k, reqs.index(f.request)): f.tokens for f in done})
    assert calls == want, k
  for i in range(4):
    np.testing.assert_array_equal(tokens[(2, i)], tokens[(1, i)])
    np.testing.assert_array_equal(tokens[(0, i)], tokens[(1, i)])


def test_compact_moves_busy_rows_into_a_smaller_state_and_they_decode_as_they_would_have():
  """Busy rows past a smaller size that holds them all move into its free rows; the state
  shrinks to it, and each row's tokens and log-probs are those it draws alone."""
  cfg, params = cached_model("ao")
  rng = np.random.default_rng(7)
  reqs = [
    batching.prompt_request(rng.integers(0, cfg.vocab_size, 5), T, 1, seed=i) for i in range(16)
  ]
  b = batching.Batcher.continuing(
    params, cfg, batch=16, tokens_per_step=1, sizes=grpo.state_sizes(16)
  )
  assert b.sizes == (2, 4, 8, 16) and grpo.state_sizes(128) == (64, 32, 16, 8, 4, 2)
  b.add_many(reqs)
  b.step(3, stop_after=0)
  b.cancel(0)
  assert b.compact() == {}  # 15 busy rows: nothing fits a smaller size
  kept = [1, 2, 4, 6, 9, 11, 13, 15]
  for row in range(16):
    if row not in kept:
      b.cancel(row)
  assert b.compact() == {9: 0, 11: 3, 13: 5, 15: 7} and b.held == 8  # 8 rows fit 8
  want = [9, 1, 2, 11, 4, 13, 6, 15]
  assert b.requests == [reqs[r] for r in want] + [None] * 8
  done: list = []
  while len(done) < 8:  # a call also ends where the step's shape changes
    done += b.step(T)
  alone = driver.decode_all(batching.Batcher(params, b.spec, batch=2, max_steps=T), reqs)
  for got in done:
    want = alone[reqs.index(got.request)]
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.raw_logprobs, want.raw_logprobs, atol=1e-5)
