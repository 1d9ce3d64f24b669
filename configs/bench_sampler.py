"""`ao-mdm bench sample`: cached sampler vs a full forward vs a no-cache sampler, random weights."""

import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.update(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, block_size=1024)
  c.bench = ml_collections.ConfigDict()
  c.bench.batch_size = 4
  c.bench.steps = (16, 64, 256, 1024)
  c.bench.schedule = "linear"
  c.bench.repeats = 3  # steady-state time is the median of this many runs
  # The no-cache sampler costs one full forward per step; above this many steps it runs this
  # many steps of the real loop and scales the time by S / no_cache_max_steps.
  c.bench.no_cache_max_steps = 64
  # `bench sample --mode=speculative --checkpoint=DIR`: draft lengths k and batch sizes, against
  # sequential decoding in the same order.
  c.bench.drafts = (2, 4, 8)
  c.bench.speculative_batches = (1, 4)
  c.bench.seeds = 8  # batches per figure, each timed (the median) and counted (the mean)
  return c
