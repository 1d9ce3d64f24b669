"""The paper's order and architecture findings at CPU scale (docs/reproducing.md): `configs/repro.py:NAME`.

NAME: ar (L2R only), random (pure any-order, random_ratio=1.0), mixed (mixed(0.9), the paper's
best), sigma (sigma-GPT with mixed(0.9)). Same model size, data and token budget for all four.
"""
import ml_collections

from ao_mdm.config import base_config

RUNS = ("ar", "random", "mixed", "sigma")


def get_config(name: str = "mixed") -> ml_collections.ConfigDict:
  if name not in RUNS:
    raise ValueError(f"unknown repro run {name!r}; accepted: {', '.join(RUNS)}")
  c = base_config()
  c.order.update(kind="l2r" if name == "ar" else "mixed",
                 random_ratio=1.0 if name == "random" else 0.9)
  c.model.variant = "sigma" if name == "sigma" else "ao"
  c.train.update(num_steps=400, eval_every=50, log_every=50)
  return c
