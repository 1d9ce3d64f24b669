"""GRPO on the generated arithmetic task, from the fine-tuned demo model (docs/posttraining.md):
`ao-mdm train --config=configs/grpo.py --init_from=runs/demo_sft --workdir=runs/demo_grpo`.

Each step draws 8 answers to each of 4 sums (left to right, one token per forward, so an answer's
probability is the model's own, exact), rewards an exact answer with 1, and makes two updates of
the clipped ratio objective with a KL penalty to the fine-tuned params.
"""

import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.update(block_size=64, unroll_layers=True)  # the demo's model
  c.data.pairs = "arithmetic:4000"
  c.order.kind = "l2r"  # of the validation's response NLL
  c.grpo.update(
    reward="ao_mdm.train.grpo:exact_match",
    group=8,
    updates=2,
    clip=0.2,
    kl=0.04,
    temperature=1.0,
    tokens_per_step=1,
    order="l2r",
  )
  c.train.update(
    batch_size=32,
    num_steps=100,
    learning_rate=2e-5,
    warmup_steps=0,
    min_lr=2e-5,
    weight_decay=0.0,
    ema_decay=0.9,
    log_every=10,
    eval_every=0,
    checkpoint_every=50,
    eval_batches=2,
  )
  return c
