"""`ao-mdm train --config=configs/sudoku.py:NAME` at a tiny size: a run on generated grids
through the command line, and `prepare` refusing what it has nothing to do for."""

import json

import numpy as np
import pytest

from ao_mdm.checkpoint import checkpoints
from helpers import ROOT, ao_mdm, error_lines

TINY = (
  "--config.model.n_layer=1",
  "--config.model.n_embd=32",
  "--config.model.n_head=2",
  "--config.train.batch_size=8",
  "--config.train.num_steps=4",
  "--config.train.warmup_steps=1",
  "--config.train.log_every=2",
  "--config.train.eval_every=0",
  "--config.train.eval_batches=1",
  "--config.train.checkpoint_every=4",
)


@pytest.mark.slow  # a training run in a process of its own (7-20 s)
@pytest.mark.parametrize(
  "name, kind, flags, std",
  [("ao", "random", (), 0.1), ("ar", "l2r", ("--config.model.position_std=0.3",), 0.3)],
)
def test_a_tiny_sudoku_run_trains_on_grids(tmp_path, name, kind, flags, std):
  workdir = tmp_path / "run"
  config_file = f"--config={ROOT}/configs/sudoku.py:{name}"
  out = ao_mdm("train", config_file, f"--workdir={workdir}", *TINY, *flags)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "step 4:" in out.stdout and "final eval (EMA params)" in out.stdout
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [2, 4]
  l2r = [r["l2r_fraction"] for r in rows if "l2r_fraction" in r]
  assert len(l2r) == 2 and (kind != "l2r" or l2r == [1.0, 1.0])
  config, params = checkpoints.load_params(str(workdir))
  assert (config.data.dataset, config.order.kind, config.model.block_size) == ("sudoku", kind, 81)
  # model.position_std (configs/sudoku.py's 0.1, or the flag's) reached the tables (4 steps
  # move them by about 0.01)
  assert config.model.position_std == std
  for table in ("pos_embed", "target_embed"):
    assert 0.8 * std < np.std(params[table]) < 1.2 * std, table
  assert np.std(params["token_embed"]) < 0.05


def test_prepare_has_nothing_to_do_for_sudoku():
  out = ao_mdm("prepare", f"--config={ROOT}/configs/sudoku.py")
  assert out.returncode != 0
  assert error_lines(out) == [
    "error: data.dataset='sudoku' has nothing to prepare: `ao-mdm train` draws its grids as it "
    "reads them (ao_mdm/data/sudoku.py)"
  ]


def test_train_refuses_a_sudoku_run_that_cannot_hold_its_grids(tmp_path):
  out = ao_mdm(
    "train",
    f"--config={ROOT}/configs/sudoku.py",
    f"--workdir={tmp_path / 'run'}",
    "--config.model.block_size=128",
  )
  assert out.returncode != 0 and not (tmp_path / "run").exists()
  assert error_lines(out) == [
    "error: a Sudoku run sets data.dataset and data.tokenizer to 'sudoku', model.block_size to "
    "81 and no data.pairs; got data.dataset='sudoku', data.tokenizer='sudoku', "
    "model.block_size=128, data.pairs=''"
  ]
