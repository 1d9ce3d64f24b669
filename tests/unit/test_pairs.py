"""Fine-tuning on prompt/response pairs: prompt-first orders against a naive construction, the
loss on response slots only and exact against one forward per token, the pairs' reading and
encoding, completions of many prompts at once against each decoded alone."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallel import T, cached_model

from ao_mdm import model as model_lib
from ao_mdm import orders, specs
from ao_mdm.data import pairs
from ao_mdm.decode import parallel
from ao_mdm.eval import responses
from ao_mdm.train import step as train_step
from helpers import default_stage_keeps, random_params

LENGTHS = [(0, 5), (3, 4), (4, 16), (7, 12), (15, 16)]  # (prompt length, length) of each row


def lengths():
  p, n = np.asarray(LENGTHS).T
  return jnp.asarray(p), jnp.asarray(n)


@pytest.mark.parametrize("prompt", specs.PROMPT_ORDERS)
@pytest.mark.parametrize("kind", specs.RESPONSE_ORDERS)
def test_prompt_first_orders_match_a_naive_construction(prompt, kind):
  cfg = specs.OrderSpec(kind=kind, prompt=prompt, random_ratio=0.5)
  p_B, n_B = lengths()
  order = np.asarray(orders.prompt_first(jax.random.key(3), p_B, n_B, T, cfg))
  counted = np.asarray(orders.response_slots(p_B, n_B, T))
  for row, (p, n) in enumerate(LENGTHS):
    o = order[row]
    assert sorted(o.tolist()) == list(range(T))
    # Naively: the prompt's positions, then the response's, then the padding's, each as a set.
    assert set(o[:p]) == set(range(p)) and set(o[p:n]) == set(range(p, n))
    assert o[n:].tolist() == list(range(n, T))
    if prompt == "l2r":
      assert o[:p].tolist() == list(range(p))
    if kind == "l2r":
      assert o[p:n].tolist() == list(range(p, n))
    assert counted[row].tolist() == [p <= s < n for s in range(T)]
    for s in range(p, n):  # a counted slot sees every prompt position
      assert set(range(p)) <= set(o[:s].tolist())


def test_random_prompt_and_response_orders_vary():
  cfg = specs.OrderSpec(kind="random", prompt="random")
  p_B, n_B = jnp.full(64, 6), jnp.full(64, 14)
  order = np.asarray(orders.prompt_first(jax.random.key(0), p_B, n_B, T, cfg))
  assert len({tuple(o[:6]) for o in order}) > 20 and len({tuple(o[6:14]) for o in order}) > 20


def pair_config(kind="random", prompt="l2r"):
  c = specs.default()
  return c.replace(
    model=c.model.replace(vocab_size=64, block_size=T, n_layer=2, n_embd=32, n_head=4, cond_dim=16),
    order=c.order.replace(kind=kind, prompt=prompt, random_ratio=0.9, ramp_steps=0),
    data=c.data.replace(pairs="arithmetic:10"),
  )


def pair_rows(seed=0):
  rng = np.random.default_rng(seed)
  rows = np.zeros((len(LENGTHS), T + pairs.EXTRA), np.int32)
  for i, (p, n) in enumerate(LENGTHS):
    rows[i, :n] = rng.integers(1, 64, n)
    rows[i, T:] = p, n
  return rows


@pytest.mark.parametrize(
  "kind,prompt",
  default_stage_keeps(
    [("l2r", "l2r"), ("random", "random"), ("mixed", "l2r")], [("random", "random")]
  ),
)
def test_the_loss_counts_response_slots_only_and_is_exact(kind, prompt):
  """The summed NLL equals, slot by slot, a forward whose order stops at that slot (one per
  token), over the response slots only; padding never changes it, a prompt token does."""
  config = pair_config(kind, prompt)
  params = random_params(config, 1)
  rows, key = pair_rows(), jax.random.key(5)
  loss_fn = jax.jit(train_step.make_micro_loss(config))
  loss, shares = loss_fn(params, jnp.asarray(rows), key, 0)
  p_B, n_B = lengths()
  order = np.asarray(orders.prompt_first(key, p_B, n_B, T, config.order, 0))
  model = model_lib.make_model(config.model)
  forward = jax.jit(lambda tok, o: model.apply({"params": params}, tok, o))
  tokens = rows[:, :T]
  naive = 0.0
  for row, (p, n) in enumerate(LENGTHS):
    for s in range(p, n):
      logits = np.asarray(forward(tokens[row : row + 1], order[row : row + 1, : s + 1]))[0, s]
      logp = logits - np.logaddexp.reduce(logits.astype(np.float64))
      naive -= logp[tokens[row, order[row, s]]]
  np.testing.assert_allclose(float(loss), naive, rtol=1e-5)
  assert float(shares["count"]) == sum(n - p for p, n in LENGTHS)
  padded = rows.copy()
  for row, (_, n) in enumerate(LENGTHS):
    padded[row, n:T] = 63
  assert float(loss_fn(params, jnp.asarray(padded), key, 0)[0]) == pytest.approx(float(loss))
  prompt_changed = rows.copy()
  prompt_changed[2, 0] = 1 + prompt_changed[2, 0] % 62
  assert float(loss_fn(params, jnp.asarray(prompt_changed), key, 0)[0]) != pytest.approx(
    float(loss), rel=1e-7
  )


def test_pairs_are_read_from_json_lines_and_chats(tmp_path):
  path = tmp_path / "pairs.jsonl"
  lines = [
    {"prompt": "2+2=", "response": "4"},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"prompt": "a", "response": "b"},
  ]
  path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
  assert pairs.read_pairs(str(path)) == [
    ("2+2=", "4"),
    ("user: hi\nassistant: ", "hello"),
    ("a", "b"),
  ]
  assert pairs.load(str(path), "train") == [("2+2=", "4"), ("user: hi\nassistant: ", "hello")]
  assert pairs.load(str(path), "validation") == [("a", "b")]
  path.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"prompt": "x", "answer": "y"}) + "\n")
  with pytest.raises(ValueError, match=r"line 2: expected string fields"):
    pairs.read_pairs(str(path))
  path.write_text(json.dumps(lines[0]) + "\n{oops\n")
  with pytest.raises(ValueError, match=r"line 2: "):
    pairs.read_pairs(str(path))
  last_user = {"messages": [{"role": "user", "content": "hi"}]}
  path.write_text(json.dumps(lines[0]) + "\n" + json.dumps(last_user) + "\n")
  with pytest.raises(ValueError, match="line 2: the last message must be the assistant's"):
    pairs.read_pairs(str(path))
  no_role = {"messages": [{"content": "hi"}, {"role": "assistant", "content": "hello"}]}
  path.write_text(json.dumps(lines[0]) + "\n" + json.dumps(no_role) + "\n")
  with pytest.raises(
    ValueError, match=r'line 2: messages\[0\] has no role: each turn needs a "role"'
  ):
    pairs.read_pairs(str(path))
  path.write_bytes(json.dumps(lines[0]).encode() + b'\n{"prompt": "caf\xe9", "response": "x"}\n')
  with pytest.raises(ValueError, match=rf"{path}, line 2: not UTF-8 text \(byte 0xe9\)"):
    pairs.read_pairs(str(path))
  with pytest.raises(ValueError, match=r"expected arithmetic:N"):
    pairs.load("arithmetic:x", "train")


def test_arithmetic_is_seeded_and_its_splits_differ():
  train = pairs.load("arithmetic:50", "train")
  assert train == pairs.load("arithmetic:50", "train") and len(train) == 50
  assert all(int(r) == sum(map(int, p[:-1].split("+"))) for p, r in train)
  validation = pairs.load("arithmetic:50", "validation")
  assert len(set(validation)) == len(validation) == pairs.ARITHMETIC_VALIDATION
  assert not set(validation) & set(train)
  with pytest.raises(ValueError, match="1 <= N <= 5000"):
    pairs.load("arithmetic:5001", "train")


class CharTokenizer:
  """One id per character (1 + its code % 60), EOS 0: enough to check the encoding."""

  eos_id, vocab_size = 0, 64

  def encode(self, text):
    return [1 + ord(c) % 60 for c in text]

  def encode_batch(self, texts):
    return [self.encode(t) for t in texts]

  def decode(self, ids):
    return "".join(chr(i) for i in ids)


def test_encoding_pads_and_drops_what_does_not_fit():
  rows, dropped = pairs.encode([("ab", "cde"), ("x" * 10, "y" * 6), ("", "z")], CharTokenizer(), 16)
  assert dropped == 1 and rows.shape == (2, 16 + pairs.EXTRA)
  tokens, p, n = pairs.split_rows(rows)
  assert p.tolist() == [2, 0] and n.tolist() == [6, 2]
  assert tokens[0, :6].tolist() == CharTokenizer().encode("abcde") + [0]
  assert not tokens[0, 6:].any()


@pytest.mark.slow  # a compile per prompt alone; test_batching's join-and-leave runs by default
def test_completions_of_many_prompts_equal_each_decoded_alone():
  """Prompts of different lengths share one continuous batch of 2 rows; each row's greedy tokens
  and log-probs equal parallel.sample of that prompt alone, L2R one token per step."""
  cfg, params = cached_model("ao")
  rng = np.random.default_rng(4)
  prompts = [rng.integers(1, cfg.vocab_size, k).tolist() for k in (3, 0, 9)]
  got = responses.complete(params, cfg, prompts, eos_id=10**6, batch=2, seed=0)
  for ids, f in zip(prompts, got):
    alone = parallel.sample(
      params,
      cfg,
      batch_size=1,
      steps=T - len(ids),
      temperature=0.0,
      known_positions=range(len(ids)),
      known_tokens=ids,
      order="l2r",
    )
    np.testing.assert_array_equal(f.tokens, alone.tokens[0])
    np.testing.assert_allclose(f.raw_logprobs, alone.raw_logprobs[0], atol=1e-5)


@pytest.mark.slow  # four continuous batches
def test_exact_match_counts_greedy_completions_and_every_sampled_draw():
  """Greedy: the share of pairs whose completion is the response. At a temperature each pair is
  drawn `samples` times in turn, each with its own seed, and every draw counts."""
  cfg, params = cached_model("ao")
  tok = CharTokenizer()
  prompts = ["ab", "cde", "f"]

  def completions(prompts, temperature):  # completed in one batch: each as alone (test_batching)
    done = responses.complete(
      params, cfg, [tok.encode(p) for p in prompts], eos_id=0, vocab_limit=64,
      temperature=temperature,
    )  # fmt: skip
    return [tok.decode(responses.response_ids(f.tokens, len(p), 0)) for p, f in zip(prompts, done)]

  greedy = completions(prompts, 0.0)
  items = [(p, g + "x" * (i == 1)) for i, (p, g) in enumerate(zip(prompts, greedy))]
  assert responses.exact_match(params, cfg, tok, items) == (pytest.approx(2 / 3), greedy)
  draws = completions([p for p in prompts for _ in range(2)], 1.0)
  assert len(set(draws)) > 3
  items = [(p, draws[2 * i]) for i, p in enumerate(prompts)]
  got, texts = responses.exact_match(params, cfg, tok, items, temperature=1.0, samples=2)
  assert texts == draws
  assert got == sum(d.strip() == items[k // 2][1].strip() for k, d in enumerate(draws)) / 6


def test_a_response_ends_before_its_first_eos():
  tokens = np.asarray([5, 6, 7, 1, 8, 1])
  assert responses.response_ids(tokens, 2, eos_id=1) == [7]
  assert responses.response_ids(tokens, 2, eos_id=9) == [7, 1, 8, 1]


def test_narrowed_rows_give_the_same_loss():
  """Rows cut to the longest pair (rounded up to 8) lose only padding: the same loss."""
  config = pair_config("l2r", "l2r")
  params = random_params(config, 2)
  rows = pair_rows()[[0, 1]]  # lengths 5 and 4
  (narrow,) = pairs.narrowed(rows)
  assert narrow.shape == (2, 8 + pairs.EXTRA)
  np.testing.assert_array_equal(pairs.split_rows(narrow)[0], rows[:, :8])
  loss_fn = train_step.make_micro_loss(config)
  full, cut = (
    float(loss_fn(params, jnp.asarray(r), jax.random.key(0), 0)[0]) for r in (rows, narrow)
  )
  assert cut == pytest.approx(full, rel=1e-6)
