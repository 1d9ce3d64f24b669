"""Variable-length generation (`ao-mdm sample --until_eos`): samples end at their first EOS, equal
to the fixed-length samples of the same seed up to it; rows stop independently, and a batch
whose rows are all done runs no further step."""

import numpy as np
import pytest

from ao_mdm.decode import generate, options, parallel, policies, schedules, speculative
from helpers import EOS, default_stage_keeps, eos_model

T = 32  # helpers.eos_model's length


@pytest.fixture(scope="module")
def model():
  return eos_model()


def first_eos_lengths(tokens_BT, start):
  """The naive reference: tokens up to and including the first EOS at or after `start`."""
  out = []
  for row in tokens_BT:
    hits = [i for i in range(start, len(row)) if row[i] == EOS]
    out.append(hits[0] + 1 if hits else len(row))
  return np.asarray(out)


@pytest.mark.parametrize(
  "order,block_len,prompt",
  default_stage_keeps(
    [("random", 8, ()), ("l2r", 8, (5, 6, 7)), ("random", 5, (5, 6, 7)), ("l2r", None, ())],
    [("random", 8, ())],
  ),
)
def test_parallel_until_eos_is_the_fixed_length_sample_up_to_its_first_eos(
  model, order, block_len, prompt
):
  cfg, params = model
  kw = dict(
    batch_size=6,
    steps=16,
    order=order,
    block_len=block_len,
    seed=3,
    known_positions=list(range(len(prompt))),
    known_tokens=list(prompt),
  )
  fixed = parallel.sample(params, cfg, **kw)
  out = parallel.sample(params, cfg, eos_id=EOS, **kw)
  lengths = out.stats["length"]
  np.testing.assert_array_equal(lengths, first_eos_lengths(fixed.tokens, len(prompt)))
  assert len(set(lengths.tolist())) > 1 and lengths.min() < T  # rows stop independently
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(out.tokens[row, :n], fixed.tokens[row, :n])
  # A row takes part in the steps up to the end of the block that holds its EOS (L2R: up to the
  # step that decoded it); once every row is done, no step runs and nothing more is written.
  counts = schedules.block_counts(T, len(prompt), 16, "linear", block_len)
  block = block_len or T
  for row, n in enumerate(lengths):
    end = n if order == "l2r" else min(T, len(prompt) + -(-(n - len(prompt)) // block) * block)
    assert out.stats["forwards"][row] == np.searchsorted(counts, end)
  last = counts[out.stats["forwards"].max()]
  assert (out.tokens[:, last:] == 0).all() and (fixed.tokens[:, last:] != 0).any()


def test_blocks_keep_their_positions_in_any_order_inside(model):
  cfg, params = model
  out = parallel.sample(
    params,
    cfg,
    batch_size=4,
    steps=12,
    order="random",
    block_len=8,
    seed=1,
    known_positions=[0, 1],
    known_tokens=[5, 6],
  )
  np.testing.assert_array_equal(out.order[:, :2], [[0, 1]] * 4)
  for start in range(2, T, 8):  # the blocks, left to right
    block = out.order[:, start : start + 8]
    assert (np.sort(block, axis=1) == np.arange(start, min(start + 8, T))).all()
  assert len({tuple(r) for r in out.order[:, 2:10]}) > 1  # random inside a block


def test_block_counts_spread_the_steps_by_block_size():
  np.testing.assert_array_equal(
    schedules.block_counts(T, 3, 10, "cosine", None), schedules.schedule_counts(T, 3, 10, "cosine")
  )
  counts = schedules.block_counts(T, 2, 8, "linear", 8)  # blocks of 8, 8, 8, 6 positions
  assert counts[0] == 2 and counts[-1] == T and len(counts) == 9
  assert {2, 10, 18, 26, 32} <= set(counts.tolist())  # every block boundary is a step's end
  np.testing.assert_array_equal(schedules.block_counts(T, 0, T, "linear", 4), np.arange(T + 1))
  with pytest.raises(
    ValueError,
    match=r"steps=3 must be in \[4, 30\]: the 30 unknown positions "
    r"make 4 blocks of block_len=8",
  ):
    schedules.block_counts(T, 2, 3, "linear", 8)
  with pytest.raises(ValueError, match="block_len=0 must be >= 1"):
    schedules.block_counts(T, 2, 8, "linear", 0)


@pytest.mark.parametrize("prompt", default_stage_keeps([((),), ((5, 6, 7),)], [((),)]))
def test_speculative_until_eos_stops_each_row_at_its_first_eos(model, prompt):
  cfg, params = model
  kw = dict(
    batch_size=6,
    draft=3,
    seed=2,
    known_positions=list(range(len(prompt))),
    known_tokens=list(prompt),
  )
  fixed = speculative.sample(params, cfg, **kw)
  out = speculative.sample(params, cfg, eos_id=EOS, **kw)
  lengths = out.stats["length"]
  np.testing.assert_array_equal(lengths, first_eos_lengths(fixed.tokens, len(prompt)))
  assert len(set(lengths.tolist())) > 1 and lengths.min() < T
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(out.tokens[row, :n], fixed.tokens[row, :n])
  assert (out.stats["forwards"] <= fixed.stats["forwards"]).all()
  assert (out.stats["forwards"] < fixed.stats["forwards"]).any()
  assert out.stats["iterations"] == out.stats["forwards"].max() < fixed.stats["iterations"]


def test_greedy_l2r_until_eos_agrees_between_modes():
  """Parallel L2R with one token per step and speculative L2R stop at the same greedy EOS."""
  cfg, params = eos_model(eos_logit=3.0, seed=1)
  kw = dict(batch_size=4, temperature=0.0, eos_id=EOS, known_positions=[0], known_tokens=[9])
  par = parallel.sample(params, cfg, steps=T - 1, order="l2r", block_len=4, **kw)
  spec = speculative.sample(params, cfg, draft=2, **kw)
  np.testing.assert_array_equal(par.stats["length"], spec.stats["length"])
  np.testing.assert_array_equal(par.stats["forwards"], par.stats["length"] - 1)
  for row, n in enumerate(par.stats["length"]):
    np.testing.assert_array_equal(par.tokens[row, :n], spec.tokens[row, :n])


@pytest.mark.parametrize(
  "call,message",
  [
    (
      lambda: policies.check_until_eos("confidence", None),
      "--until_eos applies to --mode=parallel or --mode=speculative, not --mode=confidence",
    ),
    (
      lambda: policies.check_until_eos("speculative", "random"),
      "--until_eos with --mode=speculative needs --order=l2r",
    ),
    (lambda: policies.check_until_eos("parallel", None, "a [MASK] b"), "not --infill"),
    (lambda: options.check_block_len(0), "block_len=0 must be >= 1"),
  ],
)
def test_bad_settings_are_refused(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_samplers_refuse_a_stop_they_cannot_honour(model):
  cfg, params = model
  with pytest.raises(ValueError, match="known tokens to be a prefix"):
    parallel.sample(
      params, cfg, batch_size=1, steps=4, eos_id=EOS, known_positions=[3], known_tokens=[5]
    )
  with pytest.raises(ValueError, match="needs order='l2r'"):
    speculative.sample(params, cfg, batch_size=1, order="random", eos_id=EOS)


@pytest.mark.parametrize("mode", ["parallel", "speculative"])
def test_sample_texts_records_end_at_the_eos(eos_export, mode):
  _, config, params, tokenizer = eos_export
  prompt_ids = tokenizer.encode("We the people")
  records = list(
    generate.sample_texts(
      params,
      config.model,
      tokenizer,
      num_samples=5,
      batch_size=2,
      prompt="We the people",
      mode=mode,
      until_eos=True,
      seed=4,
      steps=16,
    )
  )
  assert len(records) == 5
  for r in records:
    assert r["tokens"][: len(prompt_ids)] == prompt_ids and r["text"].startswith("We the people")
    assert len(r["tokens"]) == r["length"] and r["forwards"] >= 1
    assert EOS not in r["tokens"][len(prompt_ids) : -1]
    assert r["tokens"][-1] == EOS or r["length"] == T
  assert any(r["length"] < T for r in records)
  if mode == "parallel":
    assert all(r["block_len"] == options.DEFAULT_BLOCK_LEN for r in records)
