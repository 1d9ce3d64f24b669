"""`ao-mdm bench plan` on a tiny Sudoku model and puzzles of a few empty cells: its solve rates
are those of the grids each policy decodes, its forwards one per empty cell, and its ranking
picks the draw of the highest exact log-probability (a naive forward per cell)."""

import json

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.data import sudoku
from ao_mdm.decode import batching, common, driver
from ao_mdm.perf import bench_plan
from helpers import ROOT


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """An export of a tiny random configs/sudoku.py:ao model (its logits x3: decisive draws)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("sudoku_config", ROOT / "configs" / "sudoku.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("ao")
  c.model.update(n_layer=1, n_embd=32, n_head=2)
  config = specs.parse(c)
  params = nn.unbox(model_lib.init_params(config.model, jax.random.key(4)))
  params = jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, params)
  out = str(tmp_path_factory.mktemp("plan") / "export")
  return checkpoints.write_params_export(out, config.to_dict(), params), config, params


def puzzles(n: int, empty: int) -> tuple:
  """n held-out solutions with `empty` cells dug out at random, and the solutions."""
  _, solved = sudoku.puzzles(range(n), 7, "heldout")
  quiz = solved.copy()
  rng = np.random.default_rng(0)
  for row in quiz:
    row[rng.choice(81, empty, replace=False)] = 0
  return quiz, solved


@pytest.mark.slow  # two policies decoded and ranked over 27 grids (14 s)
def test_the_figures_are_those_of_the_decoded_grids(run, tmp_path, capsys):
  path, config, params = run
  quiz, solved = puzzles(27, 1)  # one cell each: a random model solves some
  csv = str(tmp_path / "puzzles.csv")
  sudoku.write_csv(csv, quiz, solved)
  bench = ml_collections.ConfigDict(
    dict(puzzles=0, givens=(36, 44), seed=3, policies=("l2r", "margin"), temperature=1.0,
         ranked=(2,), batch=8, baseline="", plot=str(tmp_path / "curves.svg"))
  )  # fmt: skip
  result = bench_plan.bench_plan(bench, path, csv, log=print)
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert json.loads(last)["solve_rate"] == result["solve_rate"]
  for label in ("l2r", "margin"):
    policy, options = bench_plan.POLICIES[label]
    batcher = batching.Batcher.continuing(
      params, config.model, batch=8, policy=policy, tokens_per_step=1, vocab_limit=10, **options
    )
    for temperature, kind in ((0.0, "greedy"), (1.0, "sampled")):
      done = driver.decode_all(batcher, bench_plan.requests(quiz, 3, temperature))
      grids = np.stack([f.tokens for f in done])
      got = result["policies"][f"{label} {kind}"]
      assert got["rate"] == pytest.approx(sudoku.solves(grids, quiz).mean())
      assert got["cells"] == pytest.approx((grids == solved)[quiz == 0].mean())
      assert got["forwards"] == 1
  grids = bench_plan.reading_order(params, config.model, quiz, 10)[0]
  np.testing.assert_array_equal(grids[quiz > 0], quiz[quiz > 0])  # the givens stay
  got = result["policies"]["reading order greedy"]
  assert got["rate"] == pytest.approx(sudoku.solves(grids, quiz).mean()) and got["forwards"] == 81
  rates = list(result["solve_rate"].values())
  assert 0 < max(rates) and min(rates) < 1, rates  # a test that can tell the policies apart


def test_exact_logprobs_are_a_naive_forward_per_empty_cell(run):
  """common.drawn_logprob, what the ranking keeps: the givens first, then the empty cells."""
  _, config, params = run
  quiz, solved = puzzles(3, 5)
  got = common.drawn_logprob(params, config.model, solved, quiz != 0, quiz == 0)
  model = model_lib.make_model(config.model)
  for i in range(3):
    given, empty = np.flatnonzero(quiz[i]), np.flatnonzero(quiz[i] == 0)
    order = np.concatenate([given, empty]).astype(np.int32)
    logits = model.apply({"params": params}, solved[i : i + 1].astype(np.int32), order[None])
    x = np.asarray(logits[0], np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = sum(logp[len(given) + j, solved[i, p]] for j, p in enumerate(empty))
    assert got[i] == pytest.approx(want, abs=1e-4)
