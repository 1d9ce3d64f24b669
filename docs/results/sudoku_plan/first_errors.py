"""Where margin greedy first goes wrong on Sudoku (docs/results/sudoku_plan/README.md):
`python docs/results/sudoku_plan/first_errors.py RUN PUZZLES.csv N` decodes the first N puzzles
and, for each unsolved one, takes the first cell (in commit order) given a wrong digit: how many
right cells came before it, how many digits the rules left that cell, whether the wrong digit
repeats a peer's; and the share of the N puzzles that naked singles alone (a cell whose peers
rule out 8 digits), or with hidden singles (a digit with one place left in a unit), solve."""

import sys

import numpy as np

from ao_mdm.checkpoint import checkpoints
from ao_mdm.data import sudoku
from ao_mdm.decode import batching, driver
from ao_mdm.perf import bench_plan


def peers(cell: int) -> list[int]:
  """The 20 cells sharing a row, column or box with `cell` (from sudoku.UNITS_U9)."""
  return sorted({int(c) for unit in sudoku.UNITS_U9 if cell in unit for c in unit} - {cell})


def by_singles(quiz_81: np.ndarray, hidden: bool) -> bool:
  """Whether filling naked singles (and hidden singles if `hidden`) alone solves the puzzle."""
  grid = quiz_81.copy()
  while (grid == 0).any():
    left = {
      c: set(range(1, 10)) - {int(grid[p]) for p in peers(c)} for c in np.flatnonzero(grid == 0)
    }
    moves = [(c, next(iter(d))) for c, d in left.items() if len(d) == 1]
    if hidden and not moves:
      for unit, d in ((u, d) for u in sudoku.UNITS_U9 for d in range(1, 10)):
        places = [c for c in unit if c in left and d in left[c]]
        if len(places) == 1 and d not in grid[unit]:
          moves = [(places[0], d)]
          break
    if not moves:
      return False
    grid[moves[0][0]] = moves[0][1]
  return True


def main(run: str, csv: str, n: int) -> None:
  quiz, solution = (x[:n] for x in sudoku.read_csv(csv))
  config, params, _ = checkpoints.load_run(run, "ema", log=lambda _: None)
  batcher = batching.Batcher.continuing(
    params, config.model, batch=64, policy="margin", tokens_per_step=1, vocab_limit=10
  )
  done = driver.decode_all(batcher, bench_plan.requests(quiz, 0, 0.0))
  before, left, repeats = [], [], []
  for f, q, s in zip(done, quiz, solution):
    grid, drawn = q.copy(), f.tokens[: sudoku.CELLS]
    for cell in sorted(np.flatnonzero(q == 0), key=lambda c: f.steps[c]):
      if drawn[cell] != s[cell]:
        seen = {int(grid[p]) for p in peers(cell)}
        before.append(int((grid != q).sum()))
        left.append(len(set(range(1, 10)) - seen))
        repeats.append(int(drawn[cell]) in seen)
        break
      grid[cell] = drawn[cell]
  print(f"{run}: {n - len(before)} of {n} solved")
  print(f"right cells before the first wrong one: quartiles {np.percentile(before, [25, 50, 75])}")
  print(f"digits the rules left that cell (0-9): {np.bincount(left, minlength=10).tolist()}")
  print(f"the wrong digit repeats a peer's: {np.mean(repeats):.0%}")
  for hidden in (False, True):
    share = np.mean([by_singles(q, hidden) for q in quiz])
    print(f"solved by naked singles{' and hidden singles' if hidden else ''} alone: {share:.1%}")


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
