"""GRPO's exact log-probabilities: what the loss computes for a drawn answer equals what the
decoder drew it with and a naive forward per token, for sequential, parallel and speculative
draws; the clipped objective and the advantages against plain numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallel import T, cached_model

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.data import pairs
from ao_mdm.decode import batching, driver, parallel
from ao_mdm.eval import responses
from ao_mdm.train import grpo
from ao_mdm.train import step as train_step
from helpers import default_stage_keeps
import reward_fns

PROMPTS = [3, 0, 6, 1]  # prompt lengths


def drawn(order, k, temperature=1.0):
  """Answers to four prompts drawn by the engine, k tokens per step, in one continuous batch."""
  cfg, params = cached_model("ao")
  rng = np.random.default_rng(1)
  spec = parallel.DecoderSpec(model=cfg, plan=parallel.Plan.widths(k, k - 1), order=order)
  batcher = batching.Batcher(params, spec, batch=2, max_steps=T)
  requests = [
    batching.Request(
      positions=tuple(range(p)),
      token_ids=tuple(rng.integers(0, cfg.vocab_size, p).tolist()),
      steps=-(-(T - p) // k),
      seed=i,
      temperature=temperature,
    )
    for i, p in enumerate(PROMPTS)
  ]
  done = driver.decode_all(batcher, requests)
  tokens = np.stack([f.tokens for f in done])
  order_BT = np.stack([f.order for f in done])
  steps = np.stack([f.steps for f in done])
  return cfg, params, done, tokens, order_BT, steps


@functools.cache
def _forward(cfg):
  model = model_lib.make_model(cfg)
  return jax.jit(lambda params, x, o: model.apply({"params": params}, x, o))


def naive_logprob(cfg, params, tokens, order, first, s):
  """log p(token at order[s]) from a training forward whose order is order[:first] then
  order[s]: the target sees the tokens of the steps before its own only. (The other positions
  follow it, so every call has one shape; a causal model's slot `first` never sees them.)"""
  head = np.concatenate([order[:first], order[s : s + 1]])
  o = np.concatenate([head, order[~np.isin(order, head)]])[None]
  logits = np.asarray(_forward(cfg)(params, tokens[None], o), np.float64)[0, first]
  return logits[tokens[order[s]]] - np.logaddexp.reduce(logits)


@pytest.mark.parametrize(
  "order,k",
  default_stage_keeps([("l2r", 1), ("l2r", 3), ("random", 1), ("random", 4)], [("random", 4)]),
)
def test_answer_logprobs_equal_the_decoders_and_a_naive_forward_per_token(order, k):
  cfg, params, done, tokens, order_BT, steps = drawn(order, k)
  first = responses.first_slots(steps, order_BT)
  model = model_lib.make_model(cfg)
  got = np.asarray(
    responses.answer_logprobs(
      model, params, jnp.asarray(tokens), jnp.asarray(order_BT), None if k == 1 else first
    )
  )
  for b, (f, p) in enumerate(zip(done, PROMPTS)):
    slots = np.arange(p, T)
    # the decoder's own log-probs, per position (temperature 1, no filtering: the policy's)
    np.testing.assert_allclose(got[b, slots], f.raw_logprobs[order_BT[b, slots]], atol=1e-5)
    np.testing.assert_allclose(got[b, slots], f.logprobs[order_BT[b, slots]], atol=1e-5)
    if k > 1:  # a parallel step's tokens share their first slot
      assert (first[b, slots] < slots).any() and (first[b, slots] >= p).all()
    for s in slots[:: max(1, (T - p) // 3)] if b < 2 else ():  # naive: two rows, a few slots
      want = naive_logprob(cfg, params, tokens[b], order_BT[b], first[b, s], s)
      assert got[b, s] == pytest.approx(want, abs=1e-5)


class Ids:
  """A tokenizer stand-in: ids as text, EOS id 1."""

  eos_id, vocab_size = 1, 1 << 20

  def decode(self, ids):
    return " ".join(map(str, ids))


@pytest.mark.parametrize(
  "policy,order,k,block",
  default_stage_keeps(
    [
      ("parallel", "l2r", 3, 0),
      ("parallel", "random", 2, 4),
      ("parallel", "random", 2, 0),
      ("speculative", "l2r", 3, 0),
      ("speculative", "random", 2, 0),
      ("margin", "l2r", 2, 0),
      ("confidence", "l2r", 1, 0),
    ],
    [("parallel", "l2r", 3, 0)],
  ),
)
def test_the_loss_scores_rollouts_by_the_probability_they_were_drawn_with(policy, order, k, block):
  """GRPO's own rollouts (Rollouts.draw, per policy) and its own scoring (the train step's
  answers_logprobs): equal on every counted slot, and to a naive forward on a few; speculative
  draws are sequential (each slot its own step), and in L2R count the answer up to its EOS;
  block-wise draws fill each block of `block` positions before the next."""
  cfg, params = cached_model("ao")
  base = specs.default()
  config = base.replace(
    model=cfg,
    data=base.data.replace(pairs="arithmetic:8"),
    grpo=base.grpo.replace(
      reward="ao_mdm.train.grpo:exact_match",
      group=2,
      policy=policy,
      tokens_per_step=k,
      order=order,
      block_len=block,
    ),
  )
  rollouts = grpo.Rollouts(
    config, Ids(), params, jax.sharding.SingleDeviceSharding(jax.devices()[0])
  )
  tokens_PT = np.random.default_rng(2).integers(2, cfg.vocab_size, (len(PROMPTS), T))
  prompt_P = np.asarray(PROMPTS)
  a = rollouts.draw(params, tokens_PT.astype(np.int32), prompt_P, 5 + 2 * np.arange(len(PROMPTS)))
  batch = {"tokens": a.tokens, "order": a.order, "first": a.first.astype(np.int32)}
  got = np.asarray(jax.jit(train_step.answers_logprobs(config))(params, batch))
  np.testing.assert_allclose(got[a.counted], a.logprobs[a.counted], atol=1e-5)
  for b, p in enumerate(np.repeat(prompt_P, 2)):
    np.testing.assert_array_equal(a.tokens[b, :p], tokens_PT[b // 2, :p])
    assert not a.counted[b, :p].any() and a.counted[b, p]
    if policy == "speculative":
      assert (a.first[b] == np.arange(T)).all()
    if block:  # each block's positions are drawn before any later block's
      drawn = a.order[b, a.counted[b]]
      np.testing.assert_array_equal((drawn - p) // block, np.sort((drawn - p) // block))
    if policy == "speculative" and order == "l2r":
      n = int(a.counted[b].sum())
      assert a.counted[b, p : p + n].all() and 1 not in a.tokens[b, p : p + n - 1]
      assert p + n == T or a.tokens[b, p + n - 1] == 1
    for s in np.flatnonzero(a.counted[b])[::3] if b in (0, 5) else ():
      want = naive_logprob(cfg, params, a.tokens[b], a.order[b], a.first[b, s], s)
      assert got[b, s] == pytest.approx(want, abs=1e-5)


def test_sequential_steps_are_their_own_first_slot():
  _, _, _, _, order_BT, steps = drawn("l2r", 1)
  first = responses.first_slots(steps, order_BT)
  assert (first == np.arange(T)).all()


def test_the_clipped_objective_and_kl_against_numpy():
  rng = np.random.default_rng(0)
  b = 6
  batch = {
    "counted": (rng.random((b, T)) < 0.6).astype(np.float32),
    "old": rng.normal(-2, 0.3, (b, T)).astype(np.float32),
    "ref": rng.normal(-2, 0.3, (b, T)).astype(np.float32),
    "advantage": rng.normal(0, 1, (b, 1)).astype(np.float32),
  }
  logp = rng.normal(-2, 0.3, (b, T)).astype(np.float32)
  loss, extra = train_step.token_loss(jax.tree.map(jnp.asarray, batch), jnp.asarray(logp), 0.2, 0.1)
  want, kl_sum, clipped = [], 0.0, 0
  for i in range(b):
    terms = []
    for s in np.flatnonzero(batch["counted"][i]):
      r = np.exp(np.float64(logp[i, s]) - batch["old"][i, s])
      a = batch["advantage"][i, 0]
      d = batch["ref"][i, s] - np.float64(logp[i, s])
      kl = np.exp(d) - d - 1
      terms.append(-min(r * a, min(max(r, 0.8), 1.2) * a) + 0.1 * kl)
      kl_sum += kl
      clipped += abs(r - 1) > 0.2
    want.append(np.mean(terms))
  np.testing.assert_allclose(np.asarray(loss), want, rtol=1e-5)
  assert float(extra["kl_sum"]) == pytest.approx(kl_sum, rel=1e-5)
  assert float(extra["clipped_sum"]) == clipped > 0


def test_advantages_are_normalised_within_each_group():
  rewards = np.asarray([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]], np.float32)
  adv = grpo.advantages(rewards)
  np.testing.assert_allclose(adv.mean(1), 0, atol=1e-6)
  assert (adv[1] == 0).all() and adv[0, 0] > 0 > adv[0, 1]
  np.testing.assert_allclose(adv[0], [1, -1, -1, 1], rtol=1e-3)


def test_digit_match_gives_partial_credit_by_place():
  assert grpo.digit_match("", "102", "102") == 1.0
  assert grpo.digit_match("", "112", "102") == pytest.approx(0.5 * 2 / 3)
  assert grpo.digit_match("", "2", "102") == pytest.approx(0.5 * 1 / 3)
  assert grpo.digit_match("", "x2", "102") == 0.0


def test_a_reward_is_named_as_module_function():
  assert grpo.load_reward("ao_mdm.train.grpo:exact_match")("1+1=", " 2 ", "2") == 1.0
  for bad in ("ao_mdm.train.grpo", "ao_mdm.train.grpo:nothing", "no_such_module:f"):
    with pytest.raises(ValueError, match="grpo.reward="):
      grpo.load_reward(bad)


def test_grpo_policies_are_the_registry_s_batched_ones():
  from ao_mdm.decode import policies

  batched = {p.name for p in policies.POLICIES.values() if p.batched}
  assert set(specs.GRPO_POLICIES) == batched
  with pytest.raises(ValueError, match="grpo.order=random: policy=margin chooses its own order"):
    specs.default().grpo.replace(policy="margin", order="random")


def test_grpo_needs_pairs_and_whole_groups():
  c = specs.default()
  with pytest.raises(ValueError, match="grpo.block_len=4 needs policy=parallel, not speculative"):
    c.grpo.replace(policy="speculative", block_len=4)
  with pytest.raises(ValueError, match="grpo.block_len=-1 must be >= 0"):
    c.grpo.replace(block_len=-1)
  with pytest.raises(ValueError, match="needs data.pairs"):
    c.replace(grpo=c.grpo.replace(reward="ao_mdm.train.grpo:exact_match"))
  with pytest.raises(ValueError, match="divisible by grpo.group=8"):
    c.replace(
      data=c.data.replace(pairs="arithmetic:10"),
      train=c.train.replace(batch_size=12),
      grpo=c.grpo.replace(reward="ao_mdm.train.grpo:exact_match"),
    )


def test_a_reward_must_be_a_finite_number_and_failures_name_their_source():
  import reward_fns

  name = "reward_fns:f"
  assert grpo.scored(lambda p, a, r: True, name, "1+1=", "2", "2") == 1.0
  assert grpo.scored(lambda p, a, r: np.float32(0.5), name, "1+1=", "2", "2") == 0.5
  assert grpo.scored(lambda p, a, r: np.int64(1), name, "1+1=", "2", "2") == 1.0
  assert grpo.scored(lambda p, a, r: np.bool_(False), name, "1+1=", "2", "2") == 0.0
  source = r"grpo.reward='reward_fns:f' on prompt '1\+1=', answer '3'"
  cases = {
    reward_fns.not_a_number: "returned nan; a reward must be a finite number",
    reward_fns.infinite: "returned inf; a reward must be a finite number",
    reward_fns.explodes: "raised RuntimeError: reward exploded on purpose",
    reward_fns.says_high: "returned str 'high', not a number",
    (lambda p, a, r: None): "returned NoneType None, not a number",
    (lambda p, a, r: [1.0]): r"returned list \[1.0\], not a number",
  }
  for fn, why in cases.items():
    with pytest.raises(ValueError, match=f"^{source} {why}"):
      grpo.scored(fn, name, "1+1=", "3", "2")


def _redrawn_round_by_round(rollouts, params, rows_PX, seeds_P, step, first):
  """The redraws done naively: all groups, then every flat slot's 2 candidates at once, one
  round per attempt (Rollouts._drawn does them as groups finish, in one continuous batch);
  with, per flat slot and attempt, how many of its 2 candidates had signal."""
  g, c = rollouts.config.grpo, rollouts.config

  def rewarded(rows):
    tokens_PT, prompt_P, length_P = pairs.split_rows(rows)
    answers = rollouts.draw(params, tokens_PT, prompt_P, seeds[: len(rows)])
    text = lambda ids: " ".join(map(str, ids))
    rewards = [
      reward_fns.odd_prompts_flat(
        text(tokens_PT[b // g.group, :p]),
        text(responses.response_ids(answers.tokens[b], p, 1)),
        text(tokens_PT[b // g.group, p : length_P[b // g.group] - 1]),
      )
      for b, p in enumerate(np.repeat(prompt_P, g.group))
    ]
    return answers, np.asarray(rewards, np.float32).reshape(-1, g.group)

  seeds = seeds_P
  answers, rewards_PG = rewarded(rows_PX)
  own_PG, useful_counts = rewards_PG, []
  for attempt in range(grpo.RESAMPLE_ROUNDS):
    flat = np.flatnonzero(rewards_PG.std(-1) == 0)
    if not len(flat):
      break
    rngs = [np.random.default_rng([c.seed, step, first + int(i), attempt]) for i in flat]
    picks = np.concatenate([r.integers(0, len(rollouts._train_rows), 2) for r in rngs])
    seeds = np.concatenate([r.integers(0, 2**31 - g.group, 2) for r in rngs])
    more, more_PG = rewarded(rollouts._train_rows.rows(picks.tolist()))
    for n, i in enumerate(flat):
      useful = [2 * n + j for j in range(2) if more_PG[2 * n + j].std() > 0]
      useful_counts.append((attempt, len(useful)))
      if useful:
        out, src = np.arange(g.group) + i * g.group, np.arange(g.group) + useful[0] * g.group
        answers = grpo.Answers(*(_put(x, out, y[src]) for x, y in zip(answers, more)))
        rewards_PG = _put(rewards_PG, [i], more_PG[useful[:1]])
  return answers, rewards_PG, own_PG, useful_counts


def _put(x, where, values):
  x = x.copy()
  x[where] = values
  return x


def test_groups_without_signal_are_redrawn_as_they_finish_as_round_by_round():
  """Slots whose answers all got one reward take the first of 2 other prompts' groups with
  signal, up to RESAMPLE_ROUNDS redraws. Drawn as groups finish, in the rows others free, the
  answers and rewards are the naive rounds' (tokens bitwise); a split among processes (each
  its `first`) draws alike. (Step 16: a case with every branch.)"""
  cfg, params = cached_model("ao")
  base = specs.default()
  config = base.replace(
    model=cfg,
    seed=3,
    data=base.data.replace(pairs="arithmetic:8"),
    train=base.train.replace(batch_size=8),
    grpo=base.grpo.replace(reward="reward_fns:odd_prompts_flat", group=2),
  )
  rollouts = grpo.Rollouts(
    config, Ids(), params, jax.sharding.SingleDeviceSharding(jax.devices()[0])
  )
  rng = np.random.default_rng(9)

  def rows(n, odd):  # the first prompt id odd (no signal) in rows i % odd == 0
    tokens = rng.integers(2, cfg.vocab_size, (n, T))
    tokens[:, 0] = tokens[:, 0] // 2 * 2 + (np.arange(n) % odd == 0)
    prompt = rng.integers(1, 8, n)
    return np.concatenate([tokens, prompt[:, None], prompt[:, None] + 6], 1).astype(np.int32)

  rollouts._train_rows = pairs.Rows(rows(40, 4), "train")
  mine_PX, seeds_P = rows(8, 2), 11 + 5 * np.arange(8)
  answers, rewards_PG, own_PG, _ = rollouts._drawn(params, mine_PX, seeds_P, step=16, first=0)
  want = _redrawn_round_by_round(rollouts, params, mine_PX, seeds_P, 16, 0)
  for got, expected in zip(answers[:-1], want[0][:-1]):
    np.testing.assert_array_equal(got, expected)
  np.testing.assert_allclose(answers.logprobs, want[0].logprobs, atol=1e-5)  # as test_batching
  np.testing.assert_array_equal(rewards_PG, want[1])
  np.testing.assert_array_equal(own_PG, want[2])
  flat = own_PG.std(-1) == 0
  replaced = (answers.tokens[::2, 0] != mine_PX[:, 0]) | (answers.tokens[1::2, 0] != mine_PX[:, 0])
  # The case has slots with signal, and slots redrawn whose candidates both / one / neither
  # have it, at each attempt.
  assert (~flat).any() and {(0, 2), (0, 1), (0, 0), (1, 1), (1, 0)} <= set(want[3]), str(want[3])
  assert not replaced[~flat].any() and (rewards_PG[replaced].std(-1) > 0).all()
  halves = [
    rollouts._drawn(params, mine_PX[h : h + 4], seeds_P[h : h + 4], step=16, first=h)
    for h in (0, 4)
  ]
  np.testing.assert_array_equal(np.concatenate([h[0].tokens for h in halves]), answers.tokens)
  np.testing.assert_array_equal(np.concatenate([h[1] for h in halves]), rewards_PG)
