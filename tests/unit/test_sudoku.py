"""Sudoku (data/sudoku.py): the generator's grids and puzzles are valid and seeded, held-out
puzzles share no grid with training, the checker refuses every kind of bad grid, the CSV form
round-trips and names a bad line, and the tokenizer, spec checks and row source fit a run."""

import numpy as np
import pytest

from ao_mdm import specs
from ao_mdm.config import base_config
from ao_mdm.data import pipeline, sudoku
from ao_mdm.data import tokenizer as tok_lib


@pytest.fixture(scope="module")
def heldout():
  return sudoku.puzzles(range(60), seed=0)


def test_solved_grids_obey_the_rules_and_are_seeded():
  grids = sudoku.solutions(range(300), seed=0)
  assert grids.shape == (300, 81) and sudoku.solves(grids).all()
  assert len({g.tobytes() for g in grids}) == 300
  assert (sudoku.solutions([5, 7], seed=0) == grids[[5, 7]]).all()  # a row without the others
  assert not (sudoku.solutions(range(300), seed=1) == grids).all(axis=1).any()
  for g in grids[:20]:  # each row, column and box holds every digit once
    assert sorted(g[sudoku.UNITS_U9].ravel().tolist()) == sorted(list(range(1, 10)) * 27)


def test_puzzles_keep_their_givens_and_have_one_solution(heldout):
  quiz, solved = heldout
  givens = np.count_nonzero(quiz, axis=1)
  low, high = sudoku.GIVENS
  assert givens.min() >= low and givens.max() <= high and len(set(givens.tolist())) > 4
  assert ((quiz == 0) | (quiz == solved)).all()
  assert sudoku.solves(solved, quiz).all()
  assert [sudoku.count_solutions(q, limit=3) for q in quiz] == [1] * len(quiz)
  again, _ = sudoku.puzzles(range(60), seed=0)
  assert (again == quiz).all()
  hard, _ = sudoku.puzzles(range(3), seed=0, givens=(30, 30))
  assert np.count_nonzero(hard, axis=1).tolist() == [30, 30, 30]
  with pytest.raises(ValueError, match=r"givens=\(10, 20\) must satisfy 17 <= low"):
    sudoku.puzzles(range(1), seed=0, givens=(10, 20))


def test_heldout_puzzles_share_no_grid_with_training(heldout):
  quiz, solved = heldout
  train = sudoku.solutions(range(3000), seed=0)
  train_quiz, _ = sudoku.puzzles(range(200), seed=0, split="train")
  seen = {g.tobytes() for g in np.concatenate([train, train_quiz])}
  assert not any(g.tobytes() in seen for g in np.concatenate([quiz, solved]))
  # The split is a property of the grid: any seed's training grids are never held out.
  assert {sudoku.split_of(g) for g in solved} == {"heldout"}
  assert {sudoku.split_of(g) for g in sudoku.solutions(range(100), seed=7)} == {"train"}
  with pytest.raises(ValueError, match="unknown Sudoku split 'test'; accepted: train, heldout"):
    sudoku.solutions(range(1), seed=0, split="test")


def test_the_checker_refuses_bad_grids_and_accepts_any_valid_completion(heldout):
  quiz, solved = heldout[0][0], heldout[1][0]
  assert sudoku.solves(solved, quiz) and sudoku.problem(solved, quiz) == ""

  def refused(grid, why):
    assert not sudoku.solves(grid, quiz)
    assert why in sudoku.problem(grid, quiz)

  empty = int(np.flatnonzero(quiz == 0)[0])
  for bad in (0, 10, -1):
    grid = solved.copy()
    grid[empty] = bad
    refused(grid, f"cell {empty + 1} holds {bad}, not a digit 1-9")
  # Two cells swapped: each breaks one kind of unit only.
  for unit, (a, b) in (("column 1", (0, 1)), ("row 1", (0, 9))):  # in one box: row 1, column 1
    grid = solved.copy()
    grid[[a, b]] = grid[[b, a]]
    assert sudoku.problem(grid).startswith(f"{unit} repeats a digit: ")
    assert not sudoku.solves(grid)
  grid = solved.reshape(9, 9)[:, [3, 1, 2, 0, 4, 5, 6, 7, 8]].reshape(81)  # columns 1 and 4
  assert sudoku.problem(grid).startswith("box 1 repeats a digit: ") and not sudoku.solves(grid)
  # Digits relabelled: still a valid grid, but not the puzzle's givens.
  relabelled = np.where(solved == 1, 2, np.where(solved == 2, 1, solved)).astype(np.int8)
  assert sudoku.solves(relabelled)
  given = int(np.flatnonzero((quiz == 1) | (quiz == 2))[0])
  refused(relabelled, f"cell {given + 1} holds {relabelled[given]} where the puzzle gives")
  # With no 1 or 2 given, the same relabelled grid is another valid completion: accepted.
  open_quiz = np.where((solved == 1) | (solved == 2), 0, quiz).astype(np.int8)
  assert sudoku.solves(relabelled, open_quiz) and sudoku.count_solutions(open_quiz) == 2
  assert sudoku.solves(np.stack([solved, relabelled]), np.stack([quiz, quiz])).tolist() == [
    True,
    False,
  ]
  for shape in ((80,), (2, 82)):
    with pytest.raises(ValueError, match=r"grids must be integers of shape \[81\] or \[N, 81\]"):
      sudoku.solves(np.ones(shape, np.int8))
  with pytest.raises(ValueError, match="grids must be integers"):
    sudoku.solves(np.ones(81, np.float32))


def test_clashing_givens_have_no_solution(heldout):
  quiz = heldout[0][0].copy()
  a, b = np.flatnonzero(quiz[:9] == 0)[:1].tolist() + [int(np.flatnonzero(quiz[:9])[0])]
  quiz[a] = quiz[b]  # the same digit twice in row 1
  assert sudoku.count_solutions(quiz) == 0
  assert sudoku.count_solutions(np.zeros(81, np.int8)) == 2


@pytest.mark.parametrize("empty", ["0", "."])
def test_csv_round_trip(tmp_path, heldout, empty):
  quiz, solved = heldout
  path = str(tmp_path / "puzzles.csv")
  sudoku.write_csv(path, quiz, solved)
  text = open(path).read()
  assert text.startswith("quizzes,solutions\n") and len(text.splitlines()) == 61
  if empty == ".":  # the other common form, with Windows line ends and a blank last line
    head, *rows = text.splitlines()
    rows = [q.replace("0", ".") + "," + s for q, s in (r.split(",") for r in rows)]
    open(path, "w").write("\r\n".join([head, *rows, ""]))
  got_quiz, got_solved = sudoku.read_csv(path)
  assert (got_quiz == quiz).all() and (got_solved == solved).all()
  assert got_quiz.dtype == np.int8


def test_a_bad_csv_names_its_file_line_and_the_accepted_form(tmp_path, heldout):
  quiz, solved = (["".join(map(str, g)) for g in x[:3].tolist()] for x in heldout)
  good = [f"{q},{s}" for q, s in zip(quiz, solved)]
  wrong = solved[1][:10] + str(int(solved[1][10]) % 9 + 1) + solved[1][11:]
  cases = {
    "header": (["puzzle,solution", *good], 1, "found 'puzzle,solution'"),
    "short": (["quizzes,solutions", good[0], f"{quiz[1][:80]},{solved[1]}"], 3, "80 characters"),
    "letters": (["quizzes,solutions", f"{quiz[0][:80]}x,{solved[0]}"], 2, "the puzzle is"),
    "fields": (["quizzes,solutions", good[0], good[1] + ",1"], 3, "3 comma-separated fields"),
    "unsolved": (["quizzes,solutions", f"{quiz[0]},{quiz[0]}"], 2, "not a digit 1-9"),
    "wrong": (["quizzes,solutions", *good[:1], f"{quiz[1]},{wrong}"], 3, "the solution is wrong"),
    "empty": (["quizzes,solutions", ""], None, "holds no puzzle after its header"),
  }
  for name, (lines, number, why) in cases.items():
    path = tmp_path / f"{name}.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
      sudoku.read_csv(str(path))
    message = str(e.value)
    where = f"{path}, line {number}: " if number else f"{path} "
    assert message.startswith(where) and why in message, (name, message)
    assert message.endswith(f"expected {sudoku.CSV_FORM}"), name
  path = tmp_path / "latin1.csv"
  path.write_bytes(b"quizzes,solutions\n\xe9\n")
  with pytest.raises(ValueError, match=r"latin1.csv, line 2: not UTF-8 text; expected a "):
    sudoku.read_csv(str(path))


def test_the_tokenizer_reads_digits_only():
  data = specs.DataSpec(dataset="sudoku", tokenizer="sudoku")
  tok = tok_lib.get_tokenizer(data, 16, None)
  assert isinstance(tok, tok_lib.Tokenizer) and (tok.vocab_size, tok.eos_id) == (10, 0)
  assert tok.encode("519") == [5, 1, 9] and tok.decode([5, 1, 9, 0]) == "519"
  assert tok.encode_batch(["12", "3"]) == [[1, 2], [3]] and tok.token_bytes(7) == b"7"
  with pytest.raises(ValueError, match="digits 1-9 only; character 2 of the text is '0'"):
    tok.encode("120")
  with pytest.raises(ValueError, match="exceeds the model vocab_size 8"):
    tok_lib.check_vocab(tok, 8)


def test_a_sudoku_run_sets_dataset_tokenizer_and_block_size_together():
  def config(**changes):
    c = base_config()
    c.data.update(dataset="sudoku", tokenizer="sudoku")
    c.model.block_size = 81
    for key, value in changes.items():
      section, name = key.split("__")
      c[section][name] = value
    return specs.parse(c)

  sudoku.check_run(config())
  for changes, got in (
    ({"data__tokenizer": "gpt2"}, "data.tokenizer='gpt2'"),
    ({"data__dataset": "sotu"}, "data.dataset='sotu'"),
    ({"model__block_size": 128}, "model.block_size=128"),
    ({"data__pairs": "arithmetic:10"}, "data.pairs='arithmetic:10'"),
  ):
    with pytest.raises(ValueError, match="a Sudoku run sets data.dataset and data.tokenizer to"):
      sudoku.check_run(config(**changes))
    with pytest.raises(ValueError, match=got):
      sudoku.check_run(config(**changes))


def test_training_batches_are_whole_seeded_grids():
  assert len(sudoku.Grids(sudoku.ROWS, seed=0)) == 2**31 - 1
  grids = sudoku.Grids(1000, seed=4)
  assert len(grids) == 1000 and grids.block_size == 81 and "1,000 Sudoku train grids" in grids.name
  rows = grids.rows([3, 999, 3])
  assert rows.dtype == np.int32 and (rows == sudoku.solutions([3, 999, 3], seed=4)).all()
  it = pipeline.train_iterator(
    grids, global_batch_size=16, seed=4, process_index=0, process_count=1
  )
  batches = np.concatenate([next(it) for _ in range(4)])
  assert batches.shape == (64, 81) and sudoku.solves(batches).all()
  assert len({b.tobytes() for b in batches}) == 64  # one epoch's shuffle repeats no row


def test_a_grid_with_mask_cells_is_an_infill_of_all_81_positions():
  """A puzzle written as text, [MASK] for each empty cell with --infill_span=1, fills the grid
  exactly: the infill ends at T (it was refused as a prompt that leaves nothing to generate)."""
  from ao_mdm.decode import text

  quiz, _ = sudoku.puzzles([0], 0)
  grid = "".join(str(d) if d else text.MASK for d in quiz[0])
  positions, ids, end = text.layout_known(sudoku.SudokuTokenizer().encode, 81, infill=grid, span=1)
  assert end == 81 and positions == np.flatnonzero(quiz[0]).tolist()
  assert ids == quiz[0][quiz[0] > 0].tolist()
  with pytest.raises(ValueError, match="the prompt takes 81 positions but T=81"):
    text.layout_known(sudoku.SudokuTokenizer().encode, 81, prompt="1" * 81)
