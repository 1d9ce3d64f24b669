"""`ao-mdm sample --until_eos`: variable-length records, and its settings refused in one line."""

import json

import pytest

from helpers import ao_mdm


@pytest.mark.slow  # six sample processes (about 20 s)
def test_cli_until_eos_writes_variable_length_records(eos_export, tmp_path):
  path = str(tmp_path / "samples.jsonl")
  out = ao_mdm(
    "sample",
    f"--checkpoint={eos_export[0]}",
    "--until_eos",
    "--block_len=8",
    "--steps=16",
    "--num_samples=3",
    "--batch_size=2",
    "--prompt=We the people",
    f"--out={path}",
  )
  assert out.returncode == 0, out.stderr
  records = [json.loads(line) for line in open(path)]
  assert len(records) == 3 and "blocks of 8" in out.stdout and "tokens" in out.stdout
  for r in records:
    assert r["until_eos"] and r["block_len"] == 8 and r["steps"] == 16
    assert len(r["tokens"]) == r["length"] <= eos_export[1].model.block_size
  for args, message in [
    (["--mode=confidence"], "--until_eos applies to --mode=parallel or --mode=speculative"),
    (["--mode=speculative", "--order=random"], "needs --order=l2r"),
    (["--infill=a [MASK] b"], "not --infill"),
    (["--block_len=0"], "block_len=0 must be >= 1"),
    (["--mode=speculative", "--block_len=4"], "--block_len applies to --mode=parallel"),
  ]:
    bad = ao_mdm("sample", f"--checkpoint={eos_export[0]}", "--until_eos", *args)
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error: ")]
    assert bad.returncode == 2 and len(errors) == 1 and message in errors[0], bad.stderr
