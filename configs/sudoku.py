"""Sudoku from scratch (ao_mdm/data/sudoku.py): `ao-mdm train --config=configs/sudoku.py:NAME`.

NAME: ao (AO-GPT in random orders, order.kind='random': it can then fill the cells in any order)
or ar (the same network left to right only, order.kind='l2r': the autoregressive baseline). Both
train on solved grids of 81 digits, one a row, drawn from the run's seed as they are read; held-out
grids (1/16 of all grids, by a hash) are the validation. A perfect model's loss in any order is
ln(6.67e21 grids) / 81 = 0.617 nats per cell; the unigram's is ln 9 = 2.197.
"""

import ml_collections

from ao_mdm.config import base_config

RUNS = ("ao", "ar")


def get_config(name: str = "ao") -> ml_collections.ConfigDict:
  if name not in RUNS:
    raise ValueError(f"unknown sudoku run {name!r}; accepted: {', '.join(RUNS)}")
  c = base_config()
  c.data.update(dataset="sudoku", tokenizer="sudoku")
  c.model.update(
    vocab_size=16, block_size=81, n_layer=4, n_embd=128, n_head=4, cond_dim=64, unroll_layers=True
  )
  c.order.kind = "random" if name == "ao" else "l2r"
  c.train.update(
    batch_size=64,
    num_steps=3000,
    learning_rate=3e-3,
    warmup_steps=100,
    min_lr=3e-4,
    weight_decay=0.0,
    ema_decay=0.99,
    log_every=100,
    eval_every=500,
    checkpoint_every=500,
    eval_batches=4,
  )
  return c
