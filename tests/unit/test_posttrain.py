"""Fine-tuning and GRPO through the train loop: from an export, with its tokenizer, resumed
exactly from a checkpoint, the GRPO reference kept in the work dir for restarts."""

import json

from flax import traverse_util
import numpy as np
import pytest

from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints, layout
from ao_mdm.config import base_config
from ao_mdm.train import loop


def pair_config(tfds_dir, steps, grpo=False):
  c = base_config()
  c.model.update(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=32, cond_dim=32)
  c.data.update(pairs="arithmetic:64", tfds_dir=tfds_dir)
  c.order.update(kind="mixed", random_ratio=0.5)
  c.train.update(
    batch_size=8,
    num_steps=steps,
    warmup_steps=1,
    eval_batches=1,
    eval_every=0,
    checkpoint_every=1,
    log_every=1,
    lr_decay_steps=10,  # the schedule of a run cut short (num_steps=1) is the same
  )
  if grpo:
    c.grpo.update(reward="ao_mdm.train.grpo:exact_match", group=4, updates=2, kl=0.1)
    c.train.update(learning_rate=1e-3, min_lr=1e-3, warmup_steps=0)
  return specs.parse(c)


def params_at(run):
  return checkpoints.load_params(run, "params", log=lambda _: None)[1]


def assert_same(a, b):
  a, b = traverse_util.flatten_dict(a), traverse_util.flatten_dict(b)
  assert a.keys() == b.keys()
  for path in a:
    np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


def train_then_resume(config, steps, tmp_path, name, init_from):
  """The run of `steps` steps at once, and the same run stopped after one step and resumed."""
  straight, resumed = str(tmp_path / f"{name}_straight"), str(tmp_path / f"{name}_resumed")
  quiet = lambda _: None
  loop.train_and_evaluate(config, straight, init_from=init_from, log=quiet)
  one = config.replace(train=config.train.replace(num_steps=1))
  loop.train_and_evaluate(one, resumed, init_from=init_from, log=quiet)
  loop.train_and_evaluate(config, resumed, log=quiet)
  return straight, resumed


@pytest.mark.slow  # three short runs (about 50 s here)
def test_finetuning_starts_from_an_export_and_resumes_exactly(sp_export, sotu_config, tmp_path):
  config = pair_config(sotu_config.tfds_dir, 2)
  straight, resumed = train_then_resume(config, 2, tmp_path, "sft", sp_export)
  assert_same(params_at(straight), params_at(resumed))
  assert (tmp_path / "sft_resumed" / layout.TOKENIZER / "sp_sotu_512.model").is_file()
  records = [json.loads(x) for x in (tmp_path / "sft_straight" / layout.METRICS).open()]
  assert {r["step"] for r in records if "loss" in r} == {1, 2}
  with pytest.raises(ValueError, match="give --init_from"):
    loop.train_and_evaluate(config, str(tmp_path / "no_init"), log=lambda _: None)


@pytest.mark.slow  # four short runs with rollouts (about a minute here)
def test_grpo_keeps_its_reference_and_resumes_exactly(sp_export, sotu_config, tmp_path):
  config = pair_config(sotu_config.tfds_dir, 2, grpo=True)
  straight, resumed = train_then_resume(config, 2, tmp_path, "grpo", sp_export)
  assert_same(params_at(straight), params_at(resumed))
  assert_same(
    checkpoints.load_params(f"{resumed}/{layout.REFERENCE}", log=lambda _: None)[1],
    checkpoints.load_params(sp_export, log=lambda _: None)[1],
  )
  records = [json.loads(x) for x in (tmp_path / "grpo_straight" / layout.METRICS).open()]
  logged = [r for r in records if "reward" in r]
  assert [r["step"] for r in logged] == [1, 2]
  for r in logged:
    assert 0 <= r["reward"] <= 1 and r["kl"] >= 0 and r["rollout_s"] > 0 and r["scoring_s"] > 0
