"""Fine-tuning the `make demo` model on the generated arithmetic task (docs/posttraining.md):
`ao-mdm train --config=configs/finetune.py --init_from=runs/demo --workdir=runs/demo_sft`.

The demo's model (configs/demo.py) on 4,000 sums "a+b=" -> "a+b", the loss on the answer's
tokens only; answers are ordered at random after their prompt half of the time (mixed(0.5)), so
the model learns to write the answer's digits in any order.
"""

import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.update(block_size=64, unroll_layers=True)  # the demo's model
  c.data.pairs = "arithmetic:4000"
  c.order.update(kind="mixed", random_ratio=0.5, prompt="l2r")
  c.train.update(
    batch_size=32,
    num_steps=1000,
    learning_rate=3e-3,
    warmup_steps=50,
    min_lr=3e-4,
    weight_decay=0.0,
    ema_decay=0.99,
    log_every=100,
    eval_every=500,
    checkpoint_every=500,
  )
  return c
