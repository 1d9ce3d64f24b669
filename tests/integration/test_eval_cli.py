"""`ao-mdm eval` end to end: text files, 8 simulated devices vs one, and mesh/batch errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.config import base_config
from ao_mdm.eval import perplexity, scoring
from ao_mdm.train import loop
from helpers import ROOT

# Every test reads a run the module trains first (about a minute in all): in the slow stage.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(data_dir, tmp_path_factory):
  c = base_config()
  c.model.update(vocab_size=512, block_size=32, n_layer=2, n_embd=32, n_head=2)
  c.train.update(batch_size=8, num_steps=2, warmup_steps=1, eval_batches=1, eval_every=0)
  c.data.tfds_dir = data_dir
  workdir = str(tmp_path_factory.mktemp("eval_run"))
  loop.train_and_evaluate(specs.parse(c), workdir)
  return workdir


def _eval(*args):
  return subprocess.run(
    [sys.executable, "-m", "ao_mdm.cli.main", "eval", *args],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )


def test_text_file_eval_and_too_short_file(checkpoint, tmp_path):
  text = tmp_path / "doc.txt"
  text.write_text(
    "Ünïcode is fine here.\n" + "We hold these truths to be self-evident. " * 20 + "\n"
  )
  out = _eval(
    f"--checkpoint={checkpoint}",
    f"--text_file={text}",
    "--protocol=custom",
    "--orders=2",
    "--ensemble=2",
  )
  assert out.returncode == 0, out.stderr
  result = json.loads(out.stdout.strip().splitlines()[-1])[str(text)]
  assert result["tokens"] >= 32 and result["tokens"] % 32 == 0 and result["l2r_ppl"] > 1
  # The run saved its training token counts: the unigram baseline of the same tokens is printed.
  assert "unigram ppl" in out.stdout and result["unigram_ppl"] > 1
  from ao_mdm.data import datasets, pipeline, tokenizer

  config, _ = checkpoints.load_params(checkpoint)
  tok = tokenizer.load_saved_tokenizer(config.data, 512, checkpoint)
  blocks = pipeline.pack_documents(
    [tok.encode(d) for d in datasets.read_text_documents(str(text))], tok.eos_id, 32
  )
  counts = np.load(os.path.join(checkpoint, perplexity.UNIGRAM_FILE))
  assert counts.sum() > 10_000  # the SOTU train split, not the evaluated file
  assert result["unigram_ppl"] == pytest.approx(np.exp(perplexity.unigram_nll(counts, blocks)))
  short = tmp_path / "short.txt"
  short.write_text("Too short.\n")
  out = _eval(f"--checkpoint={checkpoint}", f"--text_file={short}")
  assert out.returncode != 0
  assert "tokens (EOS included); at least block_size=32 are needed for one block" in out.stderr


@pytest.mark.slow  # 30 s: the default stage stays under 10 minutes
def test_eight_devices_equal_one_and_mesh_errors(checkpoint, tmp_path):
  config, params = checkpoints.load_params(checkpoint)
  blocks = np.random.default_rng(0).integers(0, 512, (6, 32)).astype(np.int32)
  np.save(tmp_path / "blocks.npy", blocks)
  single = perplexity.evaluate_blocks(
    scoring.Scorer(params, config.model), blocks, orders=2, ensemble=(2,), batch_size=4, seed=3
  )
  out = tmp_path / "eight.json"
  run = subprocess.run(
    [
      sys.executable,
      os.path.join(os.path.dirname(__file__), "eight_device_worker.py"),
      checkpoint,
      str(tmp_path / "blocks.npy"),
      str(out),
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  got = json.loads(out.read_text())
  for key in ("l2r_ppl", "any_order_ppl", "any_order_se"):
    np.testing.assert_allclose(got["result"][key], single[key], rtol=1e-5)
  np.testing.assert_allclose(
    got["result"]["ensemble_ppl"]["2"], single["ensemble_ppl"]["2"], rtol=1e-5
  )
  assert "mesh.ici=(3, 1, 1) has 3 devices but 8 are available" in got["errors"]["mesh"]
  assert (
    "train.batch_size=4 must be divisible by the data-parallel size 8" in got["errors"]["batch"]
  )


def test_paper_protocol_splits_and_custom_flags(checkpoint):
  """--protocol=paper (the default) scores any-order on 128 shuffled blocks, L2R on the split."""
  out = _eval(f"--checkpoint={checkpoint}", "--datasets=sotu", "--batch_size=64")
  assert out.returncode == 0, out.stderr
  r = json.loads(out.stdout.strip().splitlines()[-1])["sotu"]
  assert r["sequences"] > 128 and r["any_order_sequences"] == 128 and r["orders"] == 1
  out = _eval(f"--checkpoint={checkpoint}", "--datasets=sotu", "--orders=2")
  assert out.returncode != 0 and "--orders apply with --protocol=custom" in out.stderr


def test_commands_are_quiet_on_a_host_without_accelerators(checkpoint, tmp_path):
  """No Orbax/absl warnings and no libtpu start-up errors: only what the user asked for."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # detection, not forcing
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "ao_mdm.cli.main",
      "sample",
      f"--checkpoint={checkpoint}",
      "--num_samples=1",
      "--steps=4",
      "--seed=3",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env=env,
  )
  assert out.returncode == 0, out.stderr
  assert "--- sample 0" in out.stdout
  noise = [
    line
    for line in out.stderr.splitlines()
    if line[:1] in "WEI" and line[1:5].isdigit() or "libtpu" in line or "TPU" in line
  ]
  assert noise == [], noise[:5]


def test_infill_file_scores_each_span_exactly(checkpoint, tmp_path):
  """`eval --infill_file`: per-record log p(span | prefix, suffix) equal to infill_nll of the
  same params; the order inside the span is a flag; bad records are one error line."""
  from ao_mdm.data import tokenizer
  from ao_mdm.eval import infill

  records = [
    {
      "prefix": "We hold these truths to be",
      "span": " self-evident",
      "suffix": ", that all men are created equal.",
    },
    {"prefix": "", "span": "The state of the Union", "suffix": " is strong."},
    {"prefix": "Thank you.", "span": " God bless America.", "suffix": ""},
  ]
  path = tmp_path / "infill.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  config, params = checkpoints.load_params(checkpoint)
  tok = tokenizer.load_saved_tokenizer(config.data, 512, checkpoint)
  scorer = scoring.Scorer(params, config.model)
  for order in ("l2r", "random"):
    out = _eval(
      f"--checkpoint={checkpoint}",
      f"--infill_file={path}",
      f"--infill_order={order}",
      "--seed=4",
      "--batch_size=2",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    items = [
      (
        tok.encode(r["prefix"]),
        tok.encode(r["span"]),
        tok.encode(r["suffix"]),
        infill.span_order(len(tok.encode(r["span"])), order, 4 + i),
      )
      for i, r in enumerate(records)
    ]
    expected = [-float(n.sum()) for n in infill.infill_nll(scorer, items)]
    np.testing.assert_allclose(result["logprobs"], expected, rtol=1e-5)
    assert result["span_tokens"] == [len(item[1]) for item in items]
    assert "1 of 3 records are longer than T=32 tokens" in out.stdout
  path.write_text(json.dumps({"prefix": "a", "span": "", "suffix": "b"}) + "\n")
  out = _eval(f"--checkpoint={checkpoint}", f"--infill_file={path}")
  assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
    f"error: --infill_file {path} record 1 lacks string fields 'prefix', 'span' (not empty) "
    "and 'suffix'"
  )
  out = _eval(f"--checkpoint={checkpoint}", f"--infill_file={path}", "--datasets=sotu")
  assert out.returncode == 2 and "--datasets do not apply with --infill_file" in out.stderr
