"""The `make demo` model: mixed(0.9) AO-GPT, T=64, V=2048, about 6 minutes on 2 cores.

The exploration's setting (docs/reproducing.md) cut to the demo's budget: 1,600 steps, the
first 1,000 a curriculum from L2R orders to mixed(0.9) (order.ramp_steps), without which the
model does not learn to use its context at this scale. configs/tiny.py stays the smallest config.
"""

import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.update(block_size=64, unroll_layers=True)
  c.order.ramp_steps = 1000
  c.train.update(
    batch_size=32,
    num_steps=1600,
    learning_rate=5e-3,
    warmup_steps=100,
    min_lr=5e-4,
    weight_decay=0.0,
    ema_decay=0.99,
    log_every=100,
    eval_every=400,
    checkpoint_every=400,
  )
  return c
