"""The learned draft head: it learns the base's conditionals, and `train-draft` writes a head
that `sample` and `bench` load (refusing a head of another model shape). Exactness with a head
is tested in test_speculative.py; the command, in tests/integration/test_draft_cli.py."""

import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm.checkpoint import checkpoints
from ao_mdm.decode import draft, parallel, speculative
from ao_mdm.train import draft as draft_training
from helpers import random_model


def test_the_head_learns_the_bases_conditionals():
  """On a random base with sharp conditionals, training raises sum_x min(p, q) of every draft
  of the chain, in both orders, far above the untrained head's."""
  cfg, params = random_model(v=64, t=16, scale=8.0, seed=1)
  rng = np.random.default_rng(0)
  batches = lambda: rng.integers(0, 64, (16, 16)).astype(np.int32)
  validation = np.random.default_rng(1).integers(0, 64, (32, 16)).astype(np.int32)
  settings = dict(batch_size=16, chain=2, eval_batches=2, log_every=1000, warmup_steps=10)
  _, before = draft_training.fit(
    cfg,
    params,
    batches,
    validation,
    draft_training.Settings(num_steps=1, learning_rate=0.0, **settings),
    print,
  )
  _, after = draft_training.fit(
    cfg, params, batches, validation, draft_training.Settings(num_steps=150, **settings), print
  )
  print(f"before: {draft_training.describe(before)}; after: {draft_training.describe(after)}")
  for order in ("l2r", "random"):
    assert np.all(np.asarray(after[order]) > np.asarray(before[order]) + 0.15)


def test_a_sigma_gpt_head_decodes_greedy_l2r_exactly():
  """sigma-GPT has no AdaLN: the head reads the target from the slot embedding alone."""
  cfg = random_model(v=64, t=16, scale=4.0, seed=1)[0].replace(variant="sigma")
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(3)))
  head = draft.init_head(cfg, jax.random.key(4))
  assert "adaln" not in head
  want = parallel.sample(params, cfg, batch_size=2, steps=16, temperature=0.0, order="l2r").tokens
  out = speculative.sample(params, cfg, batch_size=2, draft=3, temperature=0.0, draft_head=head)
  np.testing.assert_array_equal(out.tokens, want)


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match=r"chain=16 must be in \[1, 15\]"):
    draft_training.check_settings(draft_training.Settings(chain=16), 16)
  with pytest.raises(ValueError, match="num_steps=0 must be >= 1"):
    draft_training.check_settings(draft_training.Settings(num_steps=0), 16)


@pytest.mark.slow  # a training run and a head, 25 s: the default stage stays under 10 minutes
def test_train_command_writes_a_head_that_loads_and_decodes(tiny_run, tmp_path):
  out = str(tmp_path / "head")
  lines = []
  settings = draft_training.Settings(
    num_steps=3, batch_size=8, chain=2, log_every=1, eval_batches=1
  )
  config, params, tokenizer = checkpoints.load_run(tiny_run)
  head_params, figures, _ = draft_training.train_head(
    config, params, tokenizer, settings, log=lines.append
  )
  assert any(line.startswith("train-draft step 3/3") for line in lines)
  assert sorted(figures) == ["l2r", "random"] and all(len(v) == 2 for v in figures.values())
  assert (
    draft.save(out, config.model, head_params, settings, figures, tiny_run, "ema", params) == out
  )
  assert sorted(os.listdir(out)) == ["0"]  # written whole, under a temporary name first
  head = draft.load(out, config.model, params, log=lines.append)
  init = draft.init_head(config.model, jax.random.key(0))
  assert jax.tree.structure(head) == jax.tree.structure(init)
  out_tokens = speculative.sample(
    params, config.model, batch_size=2, draft=3, draft_head=head, temperature=0.0
  ).tokens
  want = speculative.sample(params, config.model, batch_size=2, draft=3, temperature=0.0).tokens
  np.testing.assert_array_equal(out_tokens, want)  # greedy: the same tokens, any drafter
  # Other params of the same shape: loads, with a note; another shape or a non-head: refused.
  said = []
  draft.load(out, config.model, jax.tree.map(lambda x: x + 1, params), log=said.append)
  assert len(said) == 1 and said[0].startswith(f"note: draft head {out} was trained on other")
  other = config.model.replace(block_size=64)
  with pytest.raises(ValueError, match="trained for another model shape .block_size 32 vs 64"):
    draft.load(out, other, params)
  export = checkpoints.export(tiny_run, str(tmp_path / "export"))
  with pytest.raises(ValueError, match="is not a draft head"):
    draft.load(export, config.model, params)
  with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
    draft.save(out, config.model, head_params, settings, figures, tiny_run, "ema", params)
