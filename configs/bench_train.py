"""`ao-mdm bench train`: steady-state train-step speed and MFU against this host's matmul peak."""

import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.update(
    n_layer=4, n_embd=256, n_head=4, vocab_size=8192, block_size=256, unroll_layers=True
  )
  c.order.update(kind="mixed", random_ratio=0.9)
  c.train.batch_size = 8
  c.bench = ml_collections.ConfigDict()
  c.bench.repeats = 10  # timed train steps (after 2 warm-up steps); the median is reported
  c.bench.matmul_size = 2048  # the peak is the best of a few N x N x N matmuls in model.dtype
  return c
