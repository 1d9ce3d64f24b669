"""Sudoku (config data.dataset='sudoku'): solved grids and puzzles generated in-process from a
seed, a checker, the public CSV format, the run's tokenizer and the rows training reads.

A grid is 81 digits, row by row; in a puzzle 0 marks an empty cell. Grid i of a seed's split is
drawn from its own numpy stream (seed, split, i): the first n of a seed are those of any larger
n, and a row is made without the others, so training draws its grids as it reads them. Every
solved grid belongs to one split by a hash of its digits (`split_of`): a held-out puzzle's
solution is never a training grid, whatever the seeds and counts, and as its solution is unique
the puzzle is no training puzzle either (training reads solved grids only).
"""

from collections.abc import Sequence
import hashlib
from typing import Any

import numpy as np

from ao_mdm import specs
from ao_mdm.storage import fs

NAME = "sudoku"  # data.dataset and data.tokenizer of a Sudoku run
CELLS = 81  # its model.block_size: one grid a row
ROWS = 2**31 - 1  # the training rows: a run never reads one twice
SPLITS = ("train", "heldout")
HELDOUT_BUCKETS = 16  # of a grid hash's 256 first-byte values: 1/16 of all grids are held out
GIVENS = (36, 44)  # the scored range of givens per puzzle, both ends included
CSV_HEADER = "quizzes,solutions"
CSV_FORM = (
  f"a '{CSV_HEADER}' header, then one 'PUZZLE,SOLUTION' a line, each 81 characters row by row: "
  "digits 1-9, and 0 or . for an empty cell of the puzzle (the solution has none)"
)

_ROW = [i // 9 for i in range(CELLS)]
_COL = [i % 9 for i in range(CELLS)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(CELLS)]
_POPCOUNT = [bin(m).count("1") for m in range(1 << 10)]
_ALL = 0x3FE  # bits 1..9: every digit
# The 27 units (rows, columns, boxes), each its 9 cells.
UNITS_U9 = np.asarray(
  [[c for c in range(CELLS) if key[c] == k] for key in (_ROW, _COL, _BOX) for k in range(9)]
)
UNIT_NAMES = tuple(f"{kind} {k + 1}" for kind in ("row", "column", "box") for k in range(9))


def _used(grid: list[int]) -> tuple[list[int], list[int], list[int]]:
  """Each row's, column's and box's digits as bits 1..9."""
  rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
  for c, d in enumerate(grid):
    if d:
      rows[_ROW[c]] |= 1 << d
      cols[_COL[c]] |= 1 << d
      boxes[_BOX[c]] |= 1 << d
  return rows, cols, boxes


def _fill(priority: list[list[int]]) -> list[int]:
  """A solved grid: cells filled in reading order by backtracking, each trying its digits in
  `priority[cell]`'s order (a random one: about 130 placements a grid)."""
  grid, rows, cols, boxes = [0] * CELLS, [0] * 9, [0] * 9, [0] * 9
  options: list[list[int] | None] = [None] * CELLS
  cell = 0
  while cell < CELLS:
    r, c, b = _ROW[cell], _COL[cell], _BOX[cell]
    if options[cell] is None:
      free = _ALL & ~(rows[r] | cols[c] | boxes[b])
      options[cell] = [d for d in priority[cell] if free >> d & 1]
    if grid[cell]:  # back here: take the digit out, try the next
      bit = 1 << grid[cell]
      rows[r], cols[c], boxes[b], grid[cell] = rows[r] ^ bit, cols[c] ^ bit, boxes[b] ^ bit, 0
    left = options[cell]
    assert left is not None
    if left:
      grid[cell] = d = left.pop(0)
      rows[r], cols[c], boxes[b] = rows[r] | 1 << d, cols[c] | 1 << d, boxes[b] | 1 << d
      cell += 1
    else:
      options[cell] = None
      cell -= 1
  return grid


def _count(grid: list[int], used: tuple, empty: list[int], limit: int) -> int:
  """Solutions of `grid` (its `empty` cells to fill), up to `limit`, by backtracking on the cell
  with the fewest candidates; `grid` and `used` are as given on return."""
  if not empty:
    return 1
  rows, cols, boxes = used
  best, best_free, best_n = 0, 0, 10
  for k, cell in enumerate(empty):
    free = _ALL & ~(rows[_ROW[cell]] | cols[_COL[cell]] | boxes[_BOX[cell]])
    if _POPCOUNT[free] < best_n:
      best, best_free, best_n = k, free, _POPCOUNT[free]
      if best_n <= 1:
        break
  cell, rest, found = empty[best], empty[:best] + empty[best + 1 :], 0
  r, c, b = _ROW[cell], _COL[cell], _BOX[cell]
  for d in range(1, 10):
    if best_free >> d & 1:
      bit = 1 << d
      rows[r], cols[c], boxes[b], grid[cell] = rows[r] | bit, cols[c] | bit, boxes[b] | bit, d
      found += _count(grid, used, rest, limit - found)
      rows[r], cols[c], boxes[b], grid[cell] = rows[r] ^ bit, cols[c] ^ bit, boxes[b] ^ bit, 0
      if found >= limit:
        break
  return found


def count_solutions(puzzle_81: Any, limit: int = 2) -> int:
  """How many solutions a puzzle (0 for an empty cell) has, counted up to `limit`; 0 when its
  givens clash."""
  puzzle = _as_rows(puzzle_81, "puzzle").reshape(CELLS)
  if puzzle.min() < 0 or puzzle.max() > 9:
    raise ValueError(f"a puzzle holds 0-9 in each cell; got {puzzle.min()}..{puzzle.max()}")
  for unit in puzzle[UNITS_U9]:
    if len(set(unit[unit > 0].tolist())) < np.count_nonzero(unit):
      return 0
  grid = puzzle.tolist()
  return _count(grid, _used(grid), [c for c in range(CELLS) if not grid[c]], limit)


def _stream(seed: int, split: str, index: int) -> np.random.Generator:
  if split not in SPLITS:
    raise ValueError(f"unknown Sudoku split {split!r}; accepted: {', '.join(SPLITS)}")
  return np.random.default_rng([seed, SPLITS.index(split), index])


def split_of(solution_81: np.ndarray) -> str:
  """The split a solved grid belongs to: held out when the first byte of its digits' sha256 is
  below HELDOUT_BUCKETS (1/16 of all grids), else train."""
  digest = hashlib.sha256(np.asarray(solution_81, np.uint8).tobytes()).digest()
  return SPLITS[1] if digest[0] < HELDOUT_BUCKETS else SPLITS[0]


def _solved(rng: np.random.Generator, split: str) -> np.ndarray:
  """A random solved grid of `split`: grids are drawn until one hashes into it."""
  while True:
    priority = (rng.random((CELLS, 9)).argsort(axis=1) + 1).tolist()
    solution = np.asarray(_fill(priority), np.int8)
    if split_of(solution) == split:
      return solution


def solutions(indices: Sequence[int], seed: int, split: str = "train") -> np.ndarray:
  """int8 [len(indices), 81] solved grids: grid i of the seed's split for each i."""
  out = np.empty((len(indices), CELLS), np.int8)
  for row, i in enumerate(indices):
    out[row] = _solved(_stream(seed, split, int(i)), split)
  return out


def dig(solution_81: np.ndarray, givens: int, rng: np.random.Generator) -> np.ndarray:
  """int8 [81] puzzle of a solved grid with a unique solution: cells emptied in a random order,
  each only if no other digit then fits there, until `givens` remain (below about 30 it may stop
  above, where no cell can go: count the puzzle's givens)."""
  grid = [int(x) for x in solution_81]
  for cell in rng.permutation(CELLS).tolist():
    if CELLS - grid.count(0) <= givens:
      break
    digit, grid[cell] = grid[cell], 0
    if _fits_another(grid, cell, digit):
      grid[cell] = digit  # emptied, the puzzle would have another solution: the cell stays
  return np.asarray(grid, np.int8)


def _fits_another(grid: list[int], cell: int, digit: int) -> bool:
  """Whether the puzzle `grid` (empty at `cell`) has a solution with another digit there."""
  used, empty = _used(grid), [c for c in range(CELLS) if not grid[c] and c != cell]
  rows, cols, boxes = used
  r, c, b = _ROW[cell], _COL[cell], _BOX[cell]
  others = _ALL & ~(rows[r] | cols[c] | boxes[b]) & ~(1 << digit)
  for d in range(1, 10):
    if others >> d & 1:
      bit = 1 << d
      rows[r], cols[c], boxes[b], grid[cell] = rows[r] | bit, cols[c] | bit, boxes[b] | bit, d
      found = _count(grid, used, empty, 1)
      rows[r], cols[c], boxes[b], grid[cell] = rows[r] ^ bit, cols[c] ^ bit, boxes[b] ^ bit, 0
      if found:
        return True
  return False


def puzzles(
  indices: Sequence[int], seed: int, split: str = "heldout", givens: tuple = GIVENS
) -> tuple[np.ndarray, np.ndarray]:
  """(int8 [N, 81] puzzles, int8 [N, 81] their unique solutions): puzzle i of the seed's split
  for each i, with a number of givens drawn uniformly in [givens[0], givens[1]]."""
  low, high = givens
  if not 17 <= low <= high <= CELLS:
    raise ValueError(f"givens={tuple(givens)} must satisfy 17 <= low <= high <= 81")
  quiz, solved = np.empty((2, len(indices), CELLS), np.int8)
  for row, i in enumerate(indices):
    rng = _stream(seed, split, int(i))
    solved[row] = _solved(rng, split)
    quiz[row] = dig(solved[row], int(rng.integers(low, high + 1)), rng)
  return quiz, solved


# The checker.


def _faults(grids_N81: np.ndarray, puzzles_N81: np.ndarray) -> dict[str, np.ndarray]:
  """Every rule's breaches: `digit` [N, 81] (not 1-9), `given` [N, 81] (a given changed) and
  `unit` [N, 27] (a digit repeated in a row, column or box)."""
  sorted_NU9 = np.sort(grids_N81[:, UNITS_U9], axis=2)
  return {
    "digit": (grids_N81 < 1) | (grids_N81 > 9),
    "given": (puzzles_N81 != 0) & (grids_N81 != puzzles_N81),
    "unit": (sorted_NU9[:, :, 1:] == sorted_NU9[:, :, :-1]).any(axis=2),
  }


def _as_rows(grids: Any, what: str) -> np.ndarray:
  x = np.asarray(grids)
  if x.ndim not in (1, 2) or x.shape[-1] != CELLS or not np.issubdtype(x.dtype, np.integer):
    raise ValueError(f"{what} must be integers of shape [81] or [N, 81]; got {x.dtype} {x.shape}")
  return x.reshape(-1, CELLS).astype(np.int16)


def solves(grids: Any, puzzles: Any = None) -> Any:
  """Whether each grid satisfies the rules (digits 1-9, none repeated in a row, column or box)
  and keeps its puzzle's givens (puzzles: 0 for an empty cell; None: no givens). Any valid
  completion counts, not only the generator's. A bool, or bool [N] for [N, 81] grids."""
  grids_N81 = _as_rows(grids, "grids")
  puzzles_N81 = np.zeros_like(grids_N81) if puzzles is None else _as_rows(puzzles, "puzzles")
  ok_N = ~np.any([f.any(axis=1) for f in _faults(grids_N81, puzzles_N81).values()], axis=0)
  return bool(ok_N[0]) if np.ndim(grids) == 1 else ok_N


def problem(grid_81: Any, puzzle_81: Any = None) -> str:
  """Why a grid does not solve a puzzle (its first fault), or '' if it does."""
  grid_N81 = _as_rows(grid_81, "grid")
  puzzle_N81 = np.zeros_like(grid_N81) if puzzle_81 is None else _as_rows(puzzle_81, "puzzle")
  faults = _faults(grid_N81, puzzle_N81)
  if faults["digit"].any():
    c = int(np.argmax(faults["digit"][0]))
    return f"cell {c + 1} holds {int(grid_N81[0, c])}, not a digit 1-9"
  if faults["given"].any():
    c = int(np.argmax(faults["given"][0]))
    return f"cell {c + 1} holds {int(grid_N81[0, c])} where the puzzle gives {puzzle_N81[0, c]}"
  if faults["unit"].any():
    u = int(np.argmax(faults["unit"][0]))
    return f"{UNIT_NAMES[u]} repeats a digit: {''.join(map(str, grid_N81[0, UNITS_U9[u]]))}"
  return ""


# The public CSV form (e.g. Kaggle's "1 million Sudoku games"): quizzes,solutions.


def read_csv(path: str) -> tuple[np.ndarray, np.ndarray]:
  """(int8 [N, 81] puzzles, int8 [N, 81] solutions) of a CSV in the public form (CSV_FORM);
  every solution is checked against the rules and its puzzle's givens."""
  data = fs.read_bytes(path)
  try:
    lines = data.decode("utf-8-sig").splitlines()
  except UnicodeDecodeError as e:
    where = data[: e.start].count(b"\n") + 1
    raise ValueError(f"{path}, line {where}: not UTF-8 text; expected {CSV_FORM}") from None
  if not lines or lines[0].strip() != CSV_HEADER:
    first = repr(lines[0][:40]) if lines else "nothing"
    raise ValueError(f"{path}, line 1: found {first}; expected {CSV_FORM}")
  table = str.maketrans(".", "0")
  numbers, fields = [], []
  for number, line in enumerate(lines[1:], 2):
    if not line.strip():
      continue
    parts = line.strip().split(",")
    why = "" if len(parts) == 2 else f"{len(parts)} comma-separated fields, not 2"
    for what, part in zip(("puzzle", "solution"), parts if not why else []):
      if len(part) != CELLS or not set(part) <= set("0123456789."):
        why = why or f"the {what} is {part[:90]!r} ({len(part)} characters)"
    if why:
      raise ValueError(f"{path}, line {number}: {why}; expected {CSV_FORM}")
    numbers.append(number)
    fields.append([p.translate(table) for p in parts])
  if not fields:
    raise ValueError(f"{path} holds no puzzle after its header; expected {CSV_FORM}")
  digits = np.frombuffer("".join(q + s for q, s in fields).encode(), np.uint8) - ord("0")
  quiz_N81, solved_N81 = digits.astype(np.int8).reshape(-1, 2, CELLS).transpose(1, 0, 2)
  ok_N = solves(solved_N81, quiz_N81)
  if not ok_N.all():
    k = int(np.argmin(ok_N))
    why = problem(solved_N81[k], quiz_N81[k])
    raise ValueError(
      f"{path}, line {numbers[k]}: the solution is wrong ({why}); expected {CSV_FORM}"
    )
  return quiz_N81, solved_N81


def write_csv(path: str, puzzles_N81: np.ndarray, solutions_N81: np.ndarray) -> None:
  """The puzzles and their solutions as a CSV in the public form, 0 for an empty cell."""
  rows = [
    "".join(map(str, q)) + "," + "".join(map(str, s))
    for q, s in zip(np.asarray(puzzles_N81).tolist(), np.asarray(solutions_N81).tolist())
  ]
  fs.write_text(path, "\n".join([CSV_HEADER, *rows]) + "\n")


# What a run trains on and decodes with.


class SudokuTokenizer:
  """A grid's tokens are its digits: id d is digit d (1-9); id 0, the EOS, is in no grid."""

  name = NAME
  sha256 = hashlib.sha256(b"sudoku: 0 eos, 1-9 digits").hexdigest()
  eos_id = 0
  vocab_size = 10

  def encode(self, text: str) -> list[int]:
    """The digits of `text` as ids; any other character is refused."""
    bad = next((i for i, ch in enumerate(text) if ch not in "123456789"), None)
    if bad is not None:
      raise ValueError(
        f"the sudoku tokenizer reads digits 1-9 only; character {bad} of the text is "
        f"{text[bad]!r} (an empty cell is a [MASK] of one token)"
      )
    return [int(ch) for ch in text]

  def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
    """encode of each text."""
    del num_threads
    return [self.encode(t) for t in texts]

  def decode(self, ids: Sequence[int] | Any) -> str:
    """The digits of the ids; the EOS (0) writes nothing."""
    return "".join(str(int(i)) for i in ids if 0 < int(i) < 10)

  def token_bytes(self, token_id: int) -> bytes:
    return self.decode([token_id]).encode()


def check_run(config: specs.Spec) -> None:
  """Refuses a Sudoku run (data.dataset or data.tokenizer 'sudoku') that cannot hold its grids:
  both must be 'sudoku', model.block_size 81 and data.pairs empty."""
  got = (config.data.dataset, config.data.tokenizer, config.model.block_size, config.data.pairs)
  if got != (NAME, NAME, CELLS, ""):
    raise ValueError(
      f"a Sudoku run sets data.dataset and data.tokenizer to {NAME!r}, model.block_size to "
      f"{CELLS} and no data.pairs; got data.dataset={got[0]!r}, data.tokenizer={got[1]!r}, "
      f"model.block_size={got[2]}, data.pairs={got[3]!r}"
    )


class Grids:
  """The training rows of a run (a pipeline.RowSource): row i is solved grid i of the seed's
  split, drawn when read (about 5,600 grids/s on one core), so a run holds no grid in memory
  and, with ROWS rows, never reads one twice."""

  block_size = CELLS

  def __init__(self, count: int, seed: int, split: str = "train"):
    self.count, self.seed, self.split = count, seed, split

  @property
  def name(self) -> str:
    return f"{self.count:,} Sudoku {self.split} grids (seed {self.seed})"

  def __len__(self) -> int:
    return self.count

  def rows(self, indices: Sequence[int]) -> np.ndarray:
    """int32 [len(indices), 81] token ids: the digits of grids `indices`."""
    return solutions(indices, self.seed, self.split).astype(np.int32)
