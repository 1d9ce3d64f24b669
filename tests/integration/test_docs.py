"""Every `ao-mdm` command of README.md and docs/*.md that reads runs/demo runs as written,
against a small trained run in its place (a command meant to fail would carry `# fails`)."""

import concurrent.futures
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from ao_mdm import specs
from ao_mdm.config import base_config
from ao_mdm.train import loop
from helpers import ROOT, printed_time

_COMMAND = re.compile(r"ao-mdm [a-z-]+(?: [a-z]+)? [^`\n#]*runs/demo[^`\n#]*")


def demo_commands() -> list:
  """(file, command) of each documented command line that uses runs/demo."""
  found = []
  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    for line in path.read_text().splitlines():
      if "# fails" in line:
        continue
      found += [(path.name, m.group(0).strip()) for m in _COMMAND.finditer(line)]
  return found


def test_the_documented_commands_are_found():
  commands = [c for _, c in demo_commands()]
  assert len(commands) >= 8
  assert (
    "ao-mdm sample --checkpoint=runs/demo --mode=confidence --steps=16 --score=entropy" in commands
  )


# Appended to a documented `train` (fine-tuning, GRPO): the stand-in's model shape, two steps.
SHORT_RUN = [
  "--config.model.vocab_size=512",
  "--config.model.n_layer=2",
  "--config.model.n_embd=32",
  "--config.model.n_head=2",
  "--config.model.cond_dim=32",
  "--config.train.num_steps=2",
]
# Appended to `train-draft`: a few steps (its default 600 took 83 s of this test's 270).
DRAFT_SHORT = ["--steps=20"]
# Appended to a documented `bench` command: its work cut to a case or two (the command and its
# code paths run as written; the measurement is docs/performance.md's).
BENCH_SHORT = {
  "posttrain": [
    *SHORT_RUN,
    "--config.bench.sft_steps=2",
    "--config.bench.grpo_steps=2",
    "--config.bench.eval_pairs=8",
    "--config.bench.samples=2",
    "--config.bench.tasks=('reversal:4000',)",  # one task: the other runs the same code
  ],
  # the stand-in's vocab of 512 makes more tokens a word
  "serve": [
    "--config.bench.shared_prefix.words=8",
    "--config.bench.requests=16",
    "--config.bench.max_batch=4",  # fewer row counts for each of its servers to compile
  ],
  "sample": [
    "--config.bench.drafts=(2,)",
    "--config.bench.speculative_batches=(1,)",
    "--config.bench.seeds=1",
    "--config.bench.repeats=1",
  ],
}


@pytest.fixture(scope="module")
def demo_run(data_dir, tmp_path_factory):
  """A tiny stand-in for runs/demo: its T (64) and corpus, two steps of training."""
  c = base_config()
  c.model.update(vocab_size=512, block_size=64, n_layer=2, n_embd=32, n_head=2, cond_dim=32)
  c.train.update(batch_size=8, num_steps=2, warmup_steps=1, eval_batches=1, eval_every=0)
  c.data.tfds_dir = data_dir
  workdir = str(tmp_path_factory.mktemp("demo") / "run")
  loop.train_and_evaluate(specs.parse(c), workdir)
  return workdir


@pytest.mark.slow  # every command, each a process that loads JAX and the run (minutes)
def test_every_documented_demo_command_runs(demo_run):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}

  def run(item):
    name, command = item
    args = [a.replace("runs/demo", demo_run) for a in shlex.split(command)[1:]]
    if args[0] == "train":
      args += SHORT_RUN
    if args[0] == "train-draft":
      args += DRAFT_SHORT
    if args[0] == "bench":
      args += BENCH_SHORT[args[1]]
    if args[0] == "serve":  # it runs until stopped: up (on any free port), then SIGTERM
      args = [a for a in args if not a.startswith("--port=")] + ["--port=0"]
      proc = subprocess.Popen(
        [sys.executable, "-m", "ao_mdm.cli.main", *args], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      )  # fmt: skip
      assert proc.stdout is not None and proc.stdout.readline().startswith("loaded ")
      assert proc.stdout.readline().startswith("serving "), proc.stderr
      proc.send_signal(signal.SIGTERM)
      stdout, stderr = proc.communicate(timeout=120)
      return name, command, subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    out = subprocess.run(
      [sys.executable, "-m", "ao_mdm.cli.main", *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
    )
    return name, command, out

  def timed(item):  # each command's seconds, seen with -s
    with printed_time(item[1]):
      return run(item)

  commands = demo_commands()
  # Commands whose outputs others read run first, in the docs' order: a draft head
  # (runs/demo_draft), the torch exports and their import (runs/demo.safetensors, runs/demo_back).
  first = [
    c
    for c in commands
    if re.search(r" (train|train-draft|export-torch|import-torch) |runs/demo_(sft|grpo)", c[1])
  ]
  # Two chains that read nothing of each other's: the draft head and reversal's runs, the rest.
  apart = [c for c in first if re.search(r" train-draft |runs/demo_rev_", c[1])]
  chains = [apart, [c for c in first if c not in apart]]
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = [r for chain in pool.map(lambda cs: [timed(c) for c in cs], chains) for r in chain]
    results += list(pool.map(timed, [c for c in commands if c not in first]))
  failures = [
    f"{name}: {command}\n  rc={out.returncode} {out.stderr[-500:]}"
    for name, command, out in results
    if out.returncode
  ]
  assert not failures, "\n".join(failures)
