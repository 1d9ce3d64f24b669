"""`ao-mdm bench posttrain --config=configs/bench_posttrain.py --checkpoint=runs/demo`: on each
of two generated tasks with a binary reward (exact_match), fine-tuning then GRPO (configs/grpo.py's
settings) from the demo model, and GRPO's reward curve."""

import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.update(block_size=64, unroll_layers=True)  # the demo's model
  c.data.pairs = "arithmetic:4000"
  c.order.kind = "l2r"
  c.grpo.update(reward="ao_mdm.train.grpo:exact_match", group=8, updates=2, kl=0.04)
  c.train.update(
    batch_size=128,
    learning_rate=3e-4,
    warmup_steps=0,
    min_lr=3e-4,
    weight_decay=0.0,
    ema_decay=0.9,
    eval_batches=2,
  )
  c.bench = ml_collections.ConfigDict()
  c.bench.eval_pairs = 256  # validation pairs of the exact-match figures
  c.bench.samples = 8  # draws per pair of the sampled exact match, at grpo.temperature
  c.bench.sft_steps = 1000  # fine-tuning steps (configs/finetune.py's)
  c.bench.sft_order = "mixed"  # the answers' order in fine-tuning: mixed(0.5)
  c.bench.sft_learning_rate = 3e-3
  c.bench.sft_batch_size = 32
  c.bench.grpo_steps = 300
  c.bench.tasks = ("arithmetic:4000", "reversal:4000")  # data.pairs of each task, in turn
  c.bench.window = 50  # GRPO steps per point of the reward curve
  c.bench.plot = ""  # an SVG of the tasks' reward curves; empty: none
  return c
