"""The cached parallel sampler against a naive sampler that reruns the training forward."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import common, options, parallel, policies, protocol, schedules, text
from helpers import default_stage_keeps, naive_greedy

T = 32


def tiny_model(variant="ao", vocab=64):
  cfg = specs.default().model.replace(
    variant=variant, block_size=T, vocab_size=vocab, n_layer=2, n_embd=32, n_head=4
  )
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  # Sharper logits than the init gives, so that argmax decisions are far from ties.
  params = jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, params)
  return cfg, params


MODELS = {}


def cached_model(variant):
  if variant not in MODELS:
    MODELS[variant] = tiny_model(variant)
  return MODELS[variant]


CASES = {  # name: (order mode, known positions)
  "unconditional": ("random", []),
  "l2r": ("l2r", []),
  "prefix": ("random", list(range(7))),
  "scattered": ("random", [0, 3, 4, 11, 20, 31]),
}


# Every case, S in {T, T/4, T/16} and both schedules for AO-GPT; sigma-GPT at S = T/4.
EQUALITY = [
  ("ao", case, div, sched) for case in CASES for div in (1, 4, 16) for sched in options.SCHEDULES
] + [("sigma", case, 4, sched) for case in CASES for sched in options.SCHEDULES]


@pytest.mark.parametrize(
  "variant,case,steps_div,schedule",
  default_stage_keeps(EQUALITY, [("ao", "prefix", 16, "linear")]),
)
def test_cached_equals_naive(variant, case, steps_div, schedule):
  cfg, params = cached_model(variant)
  mode, positions = CASES[case]
  rng = np.random.default_rng(0)
  ids = rng.integers(0, cfg.vocab_size, len(positions))
  steps = (T - len(positions)) // steps_div
  out = parallel.sample(
    params,
    cfg,
    batch_size=3,
    steps=steps,
    schedule=schedule,
    temperature=0,
    seed=1,
    known_positions=positions,
    known_tokens=ids,
    order=mode,
    return_logits=True,
  )
  counts = schedules.schedule_counts(T, len(positions), steps, schedule)
  known, _ = common.known_arrays(T, 3, positions, ids)
  ref_tokens, ref_logits = naive_greedy(cfg, params, known, out.order, counts)
  np.testing.assert_array_equal(out.tokens, ref_tokens)
  unknown = np.setdiff1d(np.arange(T), positions)
  np.testing.assert_allclose(out.logits[:, unknown], ref_logits[:, unknown], atol=2e-4, rtol=1e-4)
  # The no-cache sampler (encoder-only cost model) computes the same thing.
  plain = parallel.sample(
    params,
    cfg,
    batch_size=3,
    steps=steps,
    schedule=schedule,
    temperature=0,
    seed=1,
    known_positions=positions,
    known_tokens=ids,
    order=mode,
    use_cache=False,
  )
  np.testing.assert_array_equal(plain.tokens, out.tokens)


@pytest.mark.parametrize(
  "decoder,mode", [("parallel", "random"), ("parallel", "l2r"), ("speculative", "random")]
)
def test_decoding_stops_at_end_and_equals_naive(decoder, mode):
  """With `end`, the positions from it on are last in the order and never drawn; the others are
  what the naive sampler draws in that order (an infill that ends at its text)."""
  from ao_mdm.decode import speculative

  cfg, params = cached_model("ao")
  positions, end = [0, 3, 4, 11, 19], 20
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, len(positions))
  known = dict(known_positions=positions, known_tokens=ids)
  if decoder == "parallel":
    out = parallel.sample(
      params, cfg, batch_size=3, steps=5, temperature=0, seed=1, order=mode, end=end, **known
    )
    counts = schedules.schedule_counts(end, len(positions), 5, "linear")
  else:
    out = speculative.sample(
      params, cfg, batch_size=3, draft=3, temperature=0, seed=1, order=mode, end=end, **known
    )
    counts = np.arange(len(positions), end + 1)  # sequential: one token per step
  assert np.all(out.order[:, end:] == np.arange(end, T)) and np.all(out.tokens[:, end:] == 0)
  start, _ = common.known_arrays(T, 3, positions, ids)
  want, _ = naive_greedy(cfg, params, start, out.order, counts)
  np.testing.assert_array_equal(out.tokens, want)
  with pytest.raises(ValueError, match="end=11 leaves known positions after it"):
    parallel.sample(params, cfg, batch_size=1, steps=2, end=11, **known)
  with pytest.raises(ValueError, match="leaves nothing to generate"):
    parallel.sample(
      params, cfg, batch_size=1, steps=2, known_positions=[0, 1], known_tokens=[1, 2], end=2
    )


@pytest.mark.slow  # T sequential steps (about 15 s); greedy speculative tests also check L2R
def test_l2r_full_steps_is_autoregressive_decoding():
  cfg, params = cached_model("ao")
  out = parallel.sample(
    params,
    cfg,
    batch_size=2,
    steps=T - 1,
    temperature=0,
    order="l2r",
    known_positions=[0],
    known_tokens=[5],
  )
  np.testing.assert_array_equal(out.order, np.broadcast_to(np.arange(T), (2, T)))
  forward = jax.jit(
    lambda tok: model_lib.make_model(cfg).apply(
      {"params": params}, tok, jnp.broadcast_to(jnp.arange(T), (2, T))
    )
  )
  tokens = np.zeros((2, T), np.int32)
  tokens[:, 0] = 5
  for p in range(1, T):  # ordinary greedy AR decoding with the identity order
    tokens[:, p] = np.asarray(forward(jnp.asarray(tokens))[:, p]).argmax(-1)
  np.testing.assert_array_equal(out.tokens, tokens)


# By hand from the authors' formula (model_AOGPT_generate.py generate / cond_generate):
# n_i = max(P + int((T - P) * (1 - time_i)), n_{i-1} + 1), time = linspace(1, 0, S + 1), cosine
# time -> cos((1 - time) * pi * 0.5), all in float32. T = 16, S = 3:
#   time = [1, 0.6666666, 0.33333334, 0] (1 - 1/3 = 0.66666665673... is a float32 tie, rounded to
#   even: 0.66666663), so 1 - time_i = 0.33333337, 0.6666666, 1.
#   linear P = 0: 16 * 0.33333337 = 5.333334 -> 5; 16 * 0.6666666 = 10.666666 -> 10.
#   linear P = 4: 12 * 0.33333337 = 4.0000005 -> 4 + 4 = 8; 12 * 0.6666666 = 7.9999995 -> 4 + 7
#     = 11 (exact arithmetic: 12).
#   cosine: cos(0.52359885) = 0.8660254, 1 - c = 0.13397461; cos(1.0471975) = 0.50000006,
#     1 - c = 0.49999994. P = 0: 2.1435938 -> 2, 7.999999 -> 7 (exact: 8); P = 4: 1.6076953
#     -> 4 + 1 = 5, 5.999999 -> 4 + 5 = 9 (exact: 10).
# T = 16, S = 8, cosine, P = 0: 16 (1 - cos(k pi / 16)) = 0.31, 1.22, 2.70, 4.69, 7.11, 9.88,
#   12.88, 16: truncated 0, 1, 2, 4, 7, 9, 12, 16, and the one-token minimum lifts the first three
#   to 1, 2, 3. P = 10, S = 6, cosine: every step is lifted to one token.
BY_HAND = [  # (T, P, S, schedule, counts)
  (16, 0, 3, "linear", [0, 5, 10, 16]),
  (16, 4, 3, "linear", [4, 8, 11, 16]),
  (16, 0, 3, "cosine", [0, 2, 7, 16]),
  (16, 4, 3, "cosine", [4, 5, 9, 16]),
  (16, 0, 8, "cosine", [0, 1, 2, 3, 4, 7, 9, 12, 16]),
  (16, 0, 8, "linear", [0, 2, 4, 6, 8, 10, 12, 14, 16]),
  (16, 10, 6, "cosine", [10, 11, 12, 13, 14, 15, 16]),
  (16, 0, 1, "cosine", [0, 16]),
  (16, 4, 1, "linear", [4, 16]),
]


@pytest.mark.parametrize("t,known,steps,schedule,counts", BY_HAND)
def test_schedule_counts_by_hand(t, known, steps, schedule, counts):
  np.testing.assert_array_equal(schedules.schedule_counts(t, known, steps, schedule), counts)


def authors_counts(t, known, steps, schedule):
  """The authors' counts, transcribed op by op in numpy float32 scalars."""
  f32 = np.float32
  delta = f32(f32(0) - f32(1)) / f32(steps)  # torch.linspace(1, 0, S + 1): (end - start) / S
  time = []
  for j in range(steps + 1):
    if j < (steps + 1) // 2:  # start + delta * j, fused (float64 holds the product exactly)
      time.append(f32(float(delta) * j + 1.0))
    else:
      time.append(f32(0) - delta * f32(steps - j))
    if schedule == "cosine":
      time[-1] = f32(math.cos(float(((f32(1) - time[-1]) * f32(math.pi)) * f32(0.5))))
  counts = [known]
  for i in range(1, steps + 1):
    counts.append(max(known + int(f32(t - known) * (f32(1) - time[i])), counts[-1] + 1))
  return counts


@pytest.mark.parametrize("schedule", options.SCHEDULES)
@pytest.mark.parametrize("known", [0, 1, 7])
def test_schedule_counts_equal_the_authors_formula_for_every_step_count(schedule, known):
  t = 48
  for steps in range(1, t - known + 1):
    np.testing.assert_array_equal(
      schedules.schedule_counts(t, known, steps, schedule),
      authors_counts(t, known, steps, schedule),
      err_msg=str(steps),
    )


@pytest.mark.parametrize(
  "known,schedule",
  default_stage_keeps([(k, s) for k in (0, 5) for s in options.SCHEDULES], [(5, "cosine")]),
)
def test_schedule_counts_and_fill(known, schedule):
  cfg, params = cached_model("ao")
  for steps in (1, 3, 9, T - known):
    counts = schedules.schedule_counts(T, known, steps, schedule)
    assert counts[0] == known and counts[-1] == T and len(counts) == steps + 1
    assert np.all(np.diff(counts) >= 1)
  np.testing.assert_array_equal(
    schedules.schedule_counts(T, known, T - known, schedule), np.arange(known, T + 1)
  )
  positions = list(range(0, 2 * known, 2))
  out = parallel.sample(
    params,
    cfg,
    batch_size=4,
    steps=5,
    schedule=schedule,
    seed=3,
    known_positions=positions,
    known_tokens=[7] * known,
  )
  assert np.all(out.tokens[:, positions] == 7)
  np.testing.assert_array_equal(np.sort(out.order, 1), np.broadcast_to(np.arange(T), (4, T)))
  assert np.all(np.isin(out.order[:, :known], positions))  # known positions come first


@pytest.mark.slow  # four samplers compiled (about 17 s)
def test_default_order_is_l2r_with_known_tokens_and_random_without():
  """The authors' choices: cond_generate appends the missing positions in ascending order (its
  randperm line commented out), generate draws a random permutation."""
  cfg, params = cached_model("ao")
  known = [3, 9, 10]
  out = parallel.sample(
    params, cfg, batch_size=2, steps=4, known_positions=known, known_tokens=[1, 2, 3]
  )
  rest = np.setdiff1d(np.arange(T), known)
  np.testing.assert_array_equal(out.order, np.broadcast_to(np.r_[known, rest], (2, T)))
  free = parallel.sample(params, cfg, batch_size=2, steps=4).order
  assert not np.any(np.all(free == np.arange(T), axis=1)) and not np.array_equal(free[0], free[1])
  scrambled = parallel.sample(
    params,
    cfg,
    batch_size=2,
    steps=4,
    known_positions=known,
    known_tokens=[1, 2, 3],
    order="random",
  ).order
  np.testing.assert_array_equal(scrambled[:, :3], np.broadcast_to(known, (2, 3)))
  assert not np.array_equal(scrambled[0, 3:], rest)
  par = policies.get("parallel")
  assert par.order(None, 0) == "random" and par.order(None, 5) == "l2r"
  assert par.order("random", 5) == "random" and policies.get("speculative").order(None, 5) == "l2r"


def test_every_unknown_position_filled_once():
  cfg, params = tiny_model(vocab=64)
  # A model whose every logit row is the same would hide a missed write; check the log instead.
  out = parallel.sample(
    params,
    cfg,
    batch_size=2,
    steps=5,
    schedule="cosine",
    temperature=0,
    known_positions=[1, 2],
    known_tokens=[3, 4],
    return_logits=True,
  )
  unknown = np.setdiff1d(np.arange(T), [1, 2])
  assert np.all(np.abs(out.logits[:, unknown]).sum(-1) > 0)  # every unknown position was scored
  assert np.all(out.logits[:, [1, 2]] == 0)  # known ones never were
  np.testing.assert_array_equal(out.tokens[:, unknown], out.logits[:, unknown].argmax(-1))


# Hand-computed: probabilities 0.4, 0.3, 0.15, 0.1, 0.05 sit at ids 1, 3, 4, 0, 2; their inclusive
# cumulative sums are 0.4, 0.7, 0.85, 0.95, 1.0.
TOP_P_CASES = [  # (p, ids kept by the authors' rule, ids kept by the nucleus rule)
  (0.3, {1}, {1}),  # the most likely token is always kept
  (0.5, {1}, {1, 3}),  # authors: 0.7 exceeds 0.5, so the crossing token goes too
  (0.75, {1, 3}, {1, 3, 4}),
  (0.9, {1, 3, 4}, {0, 1, 3, 4}),
  (0.97, {0, 1, 3, 4}, {0, 1, 2, 3, 4}),
  (1.0, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}),  # p = 1 filters nothing
]


@pytest.mark.parametrize("p, authors, nucleus", TOP_P_CASES)
def test_top_p_rules_on_a_hand_computed_example(p, authors, nucleus):
  logits = jnp.log(jnp.asarray([[0.1, 0.4, 0.05, 0.3, 0.15]]))
  for rule, expected in (("authors", authors), ("nucleus", nucleus)):
    kept = np.asarray(common.filter_logits(logits, jnp.float32(p), jnp.int32(0), rule))[0]
    assert set(np.flatnonzero(np.isfinite(kept))) == expected, rule
    draw = common.Draw(jnp.float32(1), jnp.float32(p), jnp.int32(0), common.DrawRule(rule))
    drawn = np.asarray(draw.tokens(jax.random.key(0), jnp.repeat(logits, 4000, 0)))
    assert set(np.unique(drawn)) == expected, rule
  draw = common.Draw(jnp.float32(1), jnp.float32(1), jnp.int32(2), common.DrawRule())
  drawn = np.asarray(draw.tokens(jax.random.key(1), jnp.repeat(logits, 4000, 0)))
  assert set(np.unique(drawn)) == {1, 3}  # top-k


def test_padded_vocab_ids_are_never_sampled():
  """ids >= vocab_limit (GPT-2's padding rows 50257..50303 in the paper) are never drawn."""
  cfg, params = tiny_model(vocab=64)
  kwargs = dict(batch_size=64, steps=4, temperature=3.0, seed=0)
  free = parallel.sample(params, cfg, **kwargs).tokens
  assert free.max() >= 40  # without the limit these ids do come up
  for temperature in (3.0, 0.0):
    out = parallel.sample(params, cfg, **{**kwargs, "temperature": temperature}, vocab_limit=40)
    assert out.tokens.max() < 40
  with pytest.raises(ValueError, match="vocab_limit=65 must be in"):
    parallel.sample(params, cfg, **kwargs, vocab_limit=65)


def test_temperature_one_draws_from_model_distribution():
  """Chi-square: the sampler's first-step tokens follow softmax of the model's logits."""
  cfg, params = tiny_model(vocab=8)
  out = parallel.sample(
    params,
    cfg,
    batch_size=4000,
    steps=T,
    order="l2r",
    temperature=1.0,
    top_p=1.0,
    seed=5,
    return_logits=True,
  )
  logits = out.logits[0, 0].astype(np.float64)  # position 0 is predicted from [None] alone
  probs = np.exp(logits - logits.max())
  probs /= probs.sum()
  counts = np.bincount(out.tokens[:, 0], minlength=8)
  assert stats.chisquare(counts, probs * counts.sum()).pvalue > 1e-3


def test_new_seed_does_not_recompile():
  cfg, params = cached_model("ao")
  kwargs = dict(batch_size=2, steps=8, known_positions=[0, 1], known_tokens=[1, 2])
  parallel.sample(params, cfg, seed=0, **kwargs)
  counts = schedules.schedule_counts(T, 2, 8, "linear")
  spec = parallel.DecoderSpec(model=cfg, plan=parallel.Plan.make(counts), order="l2r")
  decoder = protocol.decoder(spec, spec.row_plan(counts.tolist(), 8))
  before = decoder._cache_size()
  parallel.sample(params, cfg, seed=1, **kwargs)
  parallel.sample(
    params,
    cfg,
    seed=2,
    known_positions=[0, 1],
    known_tokens=[9, 9],
    batch_size=2,
    steps=8,
    temperature=0.7,
  )
  assert decoder._cache_size() == before == 1


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (dict(steps=0), "steps=0 must be >= 1"),
    (dict(steps=T + 1), r"steps=33 must be in \[1, 32\]"),
    (dict(steps=4, top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(steps=4, top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(steps=4, temperature=-1.0), "temperature=-1.0 must be >= 0"),
    (dict(steps=4, known_positions=list(range(T)), known_tokens=[0] * T), "prompt is too long"),
    (dict(steps=4, known_positions=[1, 1], known_tokens=[0, 0]), r"\[1\] are given more than once"),
    (dict(steps=4, known_positions=[40], known_tokens=[0]), r"\[40\] are outside \[0, 32\)"),
    (dict(steps=4, order="zigzag"), "order='zigzag'"),
    (dict(steps=4, schedule="exp"), "schedule='exp'"),
  ],
)
def test_bad_sampling_args(kwargs, message):
  cfg, params = cached_model("ao")
  with pytest.raises(ValueError, match=message):
    parallel.sample(params, cfg, batch_size=1, **kwargs)


def test_mark_generated_brackets_each_generated_run():
  decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)
  known = [True, True, False, False, True, False]
  assert text.mark_generated(decode, [0, 1, 2, 3, 4, 5], known, 99, 26) == "ab[[cd]]e[[f]]"
  # EOS inside a generated run splits documents there; ids past the tokenizer's vocab are dropped.
  assert (
    text.mark_generated(decode, [0, 99, 30, 2], [True, False, False, False], 99, 26) == "a[[\n\nc]]"
  )


def test_first_argmax_matches_jnp_argmax_with_ties():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 4, (64, 37)).astype(np.float32)  # many ties
  x[3] = -np.inf
  x[5, 10:] = np.inf
  np.testing.assert_array_equal(common.first_argmax(jnp.asarray(x)), np.argmax(x, axis=-1))
