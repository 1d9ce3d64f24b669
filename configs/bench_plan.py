"""`ao-mdm bench plan --config=configs/bench_plan.py --checkpoint=RUN [--puzzles=FILE.csv]`:
Sudoku solve rates of a run trained with configs/sudoku.py:ao under every decoding policy, and
left to right on the baseline (configs/sudoku.py:ar) when bench.baseline names its run."""

import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.bench = ml_collections.ConfigDict()
  c.bench.puzzles = 1000  # generated held-out puzzles (without --puzzles)
  c.bench.givens = (36, 44)  # their range of givens
  c.bench.seed = 0  # of the puzzles and of the draws
  c.bench.policies = ("l2r", "random", "confidence", "margin")  # bench_plan.POLICIES
  c.bench.temperature = 1.0  # of the sampled rows
  c.bench.ranked = (4, 8)  # likelihood-ranked sampling: margin draws per puzzle (empty: none)
  c.bench.batch = 64  # puzzles decoded together
  c.bench.baseline = ""  # the left-to-right baseline's run (empty: none)
  c.bench.plot = ""  # an SVG of the runs' training loss (empty: none)
  return c
