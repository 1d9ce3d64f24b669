"""`ao-mdm train-draft`: its help, and its errors and sample's about draft heads, each one line."""

import pytest

from helpers import ao_mdm


@pytest.mark.slow  # eight `ao-mdm` processes, about 30 s
def test_cli_train_draft_errors_and_help(tiny_run, tmp_path):
  out = ao_mdm("train-draft", "--help")
  assert out.returncode == 0 and "--steps: " in out.stdout and "(default: 600)" in out.stdout
  assert "--order: <random|l2r>: The order the head is trained for" in out.stdout
  assert "sample:" not in out.stdout and "eval:" not in out.stdout  # each flag means one thing
  cases = [
    (["train-draft", f"--checkpoint={tiny_run}"], "missing --workdir"),
    (
      ["train-draft", f"--checkpoint={tiny_run}", f"--workdir={tiny_run}"],
      "exists and is not an empty",
    ),
    (
      ["train-draft", f"--checkpoint={tiny_run}", f"--workdir={tmp_path}/h", "--steps=0"],
      "--steps=0 must be >= 1",
    ),
    (
      ["train-draft", f"--checkpoint={tiny_run}", f"--workdir={tmp_path}/h", "--top_p=0.5"],
      "--top_p not accepted by `ao-mdm train-draft`",
    ),
    (
      ["sample", f"--checkpoint={tiny_run}", f"--draft_head={tmp_path}/none"],
      "--draft_head applies to --mode=speculative",
    ),
    (
      ["sample", f"--checkpoint={tiny_run}", "--mode=speculative", f"--draft_head={tmp_path}/none"],
      "give the --workdir of an `ao-mdm train-draft`",
    ),
    (
      ["sample", f"--checkpoint={tiny_run}", "--mode=speculative", f"--draft_head={tiny_run}"],
      "is not a draft head",
    ),
  ]
  for args, message in cases:
    got = ao_mdm(*args)
    assert got.returncode == 2 and message in got.stderr, (args, got.stderr)
    assert got.stderr.count("\n") == 1 and got.stderr.startswith("error: ")
