"""`ao-mdm bench data`: prepare and read a synthetic corpus (the embedded corpus's sentences in
a seeded shuffle) of 20M and 200M GPT-2 tokens into blocks of 1,024, as the paper's data."""

import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.update(vocab_size=50304, block_size=1024)
  c.data.update(dataset="text_file", tokenizer="gpt2")
  c.bench = ml_collections.ConfigDict()
  c.bench.sizes = (20_000_000, 200_000_000)  # GPT-2 tokens of each synthetic corpus
  c.bench.batch_size = 64  # the train iterator's batch (sequences of block_size tokens)
  c.bench.iterator_batches = 300  # batches timed after the first
  c.bench.dir = ""  # where corpora and preparations go; "" -> a temporary dir, removed after
  # Also read the preparation from a bucket and time checkpoints there: "" (no), "local" (a
  # fake-gcs-server on 127.0.0.1, the [test] extra) or gs://BUCKET/DIR (removed after).
  c.bench.gcs = ""
  c.bench.checkpoint_params = 100_000_000  # float32 parameters of the timed checkpoint
  return c
