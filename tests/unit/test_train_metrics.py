"""What a training run logs about its speed: tokens and FLOPs of the rows each step really ran
(fine-tuning narrows them to the longest pair), and an MFU that never exceeds 1."""

import json

import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.checkpoint import layout
from ao_mdm.config import base_config
from ao_mdm.train import loop, records


def test_step_work_counts_the_width_each_step_ran():
  """Pair rows of width 8 (+2 length columns) count 8 tokens a row, GRPO's dict its tokens'
  width; FLOPs per token by that width (attention grows with it)."""
  cfg = specs.default().model.replace(block_size=64)
  per_token = lambda w: model_lib.flops_per_token(cfg, 10**6, w)
  work = records.StepWork(per_token, batch_size=4, extra=2)
  work.add(1, np.zeros((4, 10), np.int32))
  work.add(2, {"tokens": np.zeros((4, 24), np.int32), "order": np.zeros((4, 24), np.int32)})
  work.add(3, np.zeros((4, 66), np.int32))  # dispatched while step 2 is logged
  tokens, flops = work.read(2)
  assert tokens == (4 * 8 + 4 * 24) / 2
  assert flops == (4 * 8 * per_token(8) + 4 * 24 * per_token(24)) / 2
  assert per_token(8) < per_token(24) < per_token(64) == model_lib.flops_per_token(cfg, 10**6)
  assert work.read(3) == (4 * 64, 4 * 64 * per_token(64))  # step 3's, in the next window


@pytest.mark.slow  # a training run (about 15 s)
def test_mfu_never_exceeds_1_when_the_peak_was_set_low(sp_export, sotu_config, tmp_path):
  """A peak far below what the steps achieve (as one measured on a busy machine): the logged
  MFU stays <= 1, and the log says which peak it is against from then on."""
  c = base_config()
  c.model.update(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=32, cond_dim=32)
  c.data.update(pairs="arithmetic:64", tfds_dir=sotu_config.tfds_dir)
  c.train.update(
    batch_size=8, num_steps=6, warmup_steps=1, eval_batches=1, eval_every=0,
    checkpoint_every=6, log_every=2, peak_flops_per_device=1e6,
  )  # fmt: skip
  lines = []
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(specs.parse(c), workdir, init_from=sp_export, log=lines.append)
  logged = [json.loads(x) for x in open(f"{workdir}/{layout.METRICS}") if '"mfu"' in x]
  assert logged and all(0 < r["mfu"] <= 1 for r in logged), logged
  assert any("MFU is against" in x and "the rate this step ran at" in x for x in lines), lines
