"""Sudoku from scratch (ao_mdm/data/sudoku.py, docs/results/sudoku.md):
`ao-mdm train --config=configs/sudoku.py:NAME --workdir=DIR`.

NAME: ao (AO-GPT: random orders after a ramp from L2R, order.kind='mixed' with random_ratio 1 and
ramp_steps, as configs/repro.py:random; it can then fill the cells in any order) or ar (the same
network left to right only, order.kind='l2r': the autoregressive baseline). Both train on solved
grids of 81 digits, one a row, drawn from the run's seed as they are read; the validation is on
held-out grids. L=4, D=128, 1.03M parameters, batch 64: about 0.75 s a step on one core of this
machine, so 3,400 steps (218k grids) take about 45 minutes. Pure random orders (order.kind=
'random') left the unigram plateau only slowly: 2.09 nats after 800 steps, against 1.30 with the
ramp and 0.67 for ar (a perfect model: 0.617 in any order).
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
  if name == "ao":
    c.order.update(kind="mixed", random_ratio=1.0, ramp_steps=1700)
  else:
    c.order.kind = "l2r"
  c.train.update(
    batch_size=64,
    num_steps=3400,
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
