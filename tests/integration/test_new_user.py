"""What a new user met (issue 33), each failing before its fix: records of a run started over,
a foreign step in a work dir, the saved step logged at an interrupt, SIGTERM during sample and
export, `~` in a path flag, and what `prepare` calls verified."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.config import base_config
from ao_mdm.data import prepare, prepared
from ao_mdm.storage import fs
from ao_mdm.train import loop
from helpers import ROOT, ao_mdm, tiny_config

# Trainings, samples and exports in processes of their own (about two minutes in all): in the slow
# stage.
# They time bounded detections or signal processes after delays: the slow stage runs them one
# at a time (`alone`), never beside another test.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

SMALL = [
  "--config.model.vocab_size=512",
  "--config.model.block_size=32",
  "--config.model.n_layer=1",
  "--config.model.n_embd=32",
  "--config.model.n_head=2",
  "--config.train.batch_size=4",
  "--config.train.eval_batches=1",
  "--config.train.eval_every=0",
  "--config.train.log_every=1",
]


def start(*args, env=None):
  return subprocess.Popen(
    [sys.executable, "-m", "ao_mdm.cli.main", *args],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
  )


def small_config(tfds_dir, steps):
  c = tiny_config(tfds_dir)
  c.train.update(num_steps=steps, log_every=1, checkpoint_every=2)
  return c


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
  """A small run with checkpoints at steps 2 and 4, and its export."""
  root = tmp_path_factory.mktemp("new_user")
  workdir = str(root / "run")
  loop.train_and_evaluate(specs.parse(small_config(data_dir, 4)), workdir)
  return {"root": root, "run": workdir, "export": checkpoints.export(workdir, str(root / "x"))}


def test_starting_over_sets_the_old_records_aside(data_dir, run, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(run["run"], workdir)
  for d, _, names in os.walk(os.path.join(workdir, "checkpoints")):  # every one unreadable
    for name in names:
      if f"{os.sep}d" in d:  # array data
        os.truncate(os.path.join(d, name), 10)
  loop.train_and_evaluate(specs.parse(small_config(data_dir, 2)), workdir, start_over=True)
  steps = [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert steps and max(steps) == 2 and steps == sorted(steps)  # the new run's records only
  aside = os.listdir(os.path.join(workdir, "checkpoints_set_aside"))
  assert any(n.startswith("metrics.jsonl.start-over") for n in aside)
  assert any(n.startswith("tensorboard.start-over") for n in aside)
  assert len(os.listdir(os.path.join(workdir, "tensorboard"))) == 1  # this run's events


def test_a_foreign_step_in_a_work_dir_is_skipped_and_the_loaded_step_named(run, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(run["run"], workdir)
  shutil.copytree(os.path.join(run["export"], "0"), os.path.join(workdir, "checkpoints", "40"))
  out = ao_mdm("sample", f"--checkpoint={workdir}", "--num_samples=1", "--steps=4")
  assert out.returncode == 0, out.stderr
  assert "skipped checkpoint step 40" in out.stdout and "not a training checkpoint" in out.stdout
  assert f"loaded {workdir}, step 4: its EMA params" in out.stdout


def test_an_interrupted_run_logs_the_step_it_saved(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  proc = start(
    "train",
    f"--config={ROOT}/configs/tiny.py",
    f"--workdir={workdir}",
    f"--config.data.tfds_dir={data_dir}",
    "--config.train.num_steps=100000",
    "--config.train.checkpoint_every=100000",
    *SMALL,
  )
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 240
  while time.time() < deadline and not (
    os.path.exists(metrics) and '"loss"' in open(metrics).read()
  ):
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130 and "Traceback" not in err, err
  saved = int(out.split("saved a checkpoint at step ")[1].split()[0])
  losses = [r["step"] for r in map(json.loads, open(metrics)) if "loss" in r]
  assert losses[-1] == saved and losses == list(range(1, saved + 1))


def test_sigterm_during_sample_keeps_the_finished_samples(run, tmp_path):
  out_file = tmp_path / "s.jsonl"
  proc = start(
    "sample",
    f"--checkpoint={run['run']}",
    "--num_samples=100000",
    "--batch_size=1",
    "--steps=2",
    f"--out={out_file}",
  )
  partial = tmp_path / "s.jsonl.partial"
  deadline = time.time() + 240
  while time.time() < deadline and not (partial.exists() and partial.stat().st_size):
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 143 and "Traceback" not in err, err
  lines = out_file.read_text().splitlines()
  assert lines and all(json.loads(line)["text"] is not None for line in lines)
  assert f"kept the {len(lines)} finished samples in {out_file}" in err
  assert not partial.exists() and "terminated (SIGTERM)" in err


def test_a_signal_right_after_a_sample_is_written_counts_it(run, tmp_path, monkeypatch):
  """The signal's cleanup runs between any two statements: here after the second sample's
  write, before the loop counts it; the line must name what the file holds."""
  from ao_mdm.cli.commands import sample as sample_command
  from ao_mdm.decode import generate
  from ao_mdm.runtime import interrupts

  out, said, cleanups = str(tmp_path / "s.jsonl"), [], []
  real_append, real_on_interrupt = fs.append, interrupts.on_interrupt

  @contextlib.contextmanager
  def on_interrupt(cleanup):  # what the signal handler would run
    cleanups.append(cleanup)
    with real_on_interrupt(cleanup):
      yield

  def append_then_signal(path, data):
    real_append(path, data)
    if fs.read_bytes(path).count(b"\n") == 2:
      said.append(cleanups[-1]())
      raise SystemExit(143)

  monkeypatch.setattr(sample_command.interrupts, "on_interrupt", on_interrupt)
  monkeypatch.setattr(sample_command.fs, "append", append_then_signal)
  config, params, tokenizer = checkpoints.load_run(run["export"])
  records = generate.sample_texts(
    params, config.model, tokenizer, num_samples=5, batch_size=1, seed=0, steps=2
  )
  with pytest.raises(SystemExit):
    sample_command.write_samples(
      records,
      out,
      5,
      {"tokenizer": config.data.tokenizer},
      show=lambda i, r: None,
      say=lambda line: None,
    )
  assert said == [f"kept the 2 finished samples in {out}"]
  assert len(fs.read_text(out).splitlines()) == 2


def test_sigterm_during_export_leaves_nothing_and_leftovers_of_the_dead_are_removed(run, tmp_path):
  out_dir = tmp_path / "export"
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  leftover = tmp_path / f"export.tmp-{socket.gethostname()}-{dead.pid}.0123abcd"  # a kill -9's
  (leftover / "0").mkdir(parents=True)
  proc = start("export", f"--checkpoint={run['run']}", f"--out={out_dir}")
  deadline = time.time() + 120
  while time.time() < deadline and not any(
    n.startswith("export.tmp") and n != leftover.name for n in os.listdir(tmp_path)
  ):
    time.sleep(0.01)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=60)
  assert "Traceback" not in err, err
  names = sorted(os.listdir(tmp_path))
  if proc.returncode == 143:
    assert names == [], names  # neither this export's temporary directory nor the dead one's
  else:  # the export finished before the signal
    assert proc.returncode == 0 and names == ["export"], names


def test_a_tilde_in_a_path_flag_is_the_home_directory(run, tmp_path):
  home = tmp_path / "home"
  home.mkdir()
  out = ao_mdm(
    "sample",
    f"--checkpoint={run['run']}",
    "--num_samples=1",
    "--steps=2",
    "--out=~/s.jsonl",
    env={"HOME": str(home)},
    cwd=str(tmp_path),
  )
  assert out.returncode == 0, out.stderr
  assert (home / "s.jsonl").exists() and not (tmp_path / "~").exists()
  assert f"wrote 1 samples to {home / 's.jsonl'}" in out.stdout


def test_prepare_says_verified_only_after_hashing(sp_tokenizer, tmp_path):
  from ao_mdm.data import corpus, datasets

  text = tmp_path / "docs.txt"
  text.write_text("\n".join(d.replace("\n", " ") for d in corpus.sotu_documents("train")[:30]))
  config = base_config()
  config.model.vocab_size = sp_tokenizer.vocab_size
  config.data.update(
    dataset="text_file",
    text_file=str(text),
    tfds_dir=str(tmp_path / "tfds"),
    prepared_dir=str(tmp_path / "p"),
  )
  workdir = tmp_path / "run"  # the run's tokenizer: the session's model, under its name here
  (workdir / "tokenizer").mkdir(parents=True)
  shutil.copy(
    sp_tokenizer.model_path,
    workdir
    / "tokenizer"
    / (f"sp_{datasets.dataset_tag(config.data)}_{sp_tokenizer.vocab_size}.model"),
  )
  config = specs.parse(config)
  command = lambda verify: list(
    prepare.prepare_splits(config, ["train"], 1, str(workdir), None, None, verify)
  )
  first = command(False)
  assert "every shard hashed: verified" in first[0]
  split = prepared.open_split(config.data, sp_tokenizer, "train")
  shard = os.path.join(split.directory, "shard-00000.bin")
  original, st = open(shard, "rb").read(), os.stat(shard)
  with open(shard, "r+b") as f:  # one byte flipped, the mtime put back
    f.seek(10)
    f.write(bytes([original[10] ^ 1]))
  os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
  said = command(False)
  assert "already prepared; sizes and versions match the manifest" in said[0]
  assert "verified" not in said[0].split("(--verify")[0]
  said = command(True)
  assert "(corrupted)" in said[0] and said[0].endswith("preparing it again")
  assert len(said) == 2 and "every shard hashed: verified" in said[1]
  assert open(shard, "rb").read() == original  # the flipped shard was found and redone
  # A changed sha256 in the manifest is not trusted to the cache of an earlier check.
  manifest = fs.read_json(os.path.join(split.directory, prepared.MANIFEST))
  manifest["shards"][0]["sha256"] = "0" * 64
  fs.write_json(os.path.join(split.directory, prepared.MANIFEST), manifest)
  with pytest.raises(prepared.CorruptShard, match="shard-00000.bin has sha256"):
    prepared.open_split(config.data, sp_tokenizer, "train")


def test_a_damaged_step_is_one_plain_line(run, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(run["run"], workdir)
  for d, _, names in os.walk(os.path.join(workdir, "checkpoints", "4", "ema")):
    for name in names:
      if f"{os.sep}d" in d:
        os.truncate(os.path.join(d, name), 10)
  out = ao_mdm("sample", f"--checkpoint={workdir}", "--num_samples=1", "--steps=2")
  assert out.returncode == 0, out.stderr
  skipped = [line for line in out.stdout.splitlines() if line.startswith("skipped")]
  assert len(skipped) == 1 and skipped[0].startswith(
    f"skipped checkpoint step 4 in {workdir}/checkpoints: it cannot be restored (its data "
    "cannot be read: truncated or corrupt"
  )
  assert "Exception ignored" not in out.stderr and "Event loop is closed" not in out.stderr
  assert len(out.stderr.splitlines()) <= 2, out.stderr
  shutil.rmtree(os.path.join(workdir, "checkpoints", "4", "ema"))
  out = ao_mdm("export", f"--checkpoint={workdir}", f"--out={tmp_path / 'x'}")
  assert out.returncode == 0 and "(its ema item is missing)" in out.stdout, out.stdout


def test_the_command_list_is_aligned():
  out = ao_mdm("help")
  rows = [line for line in out.stdout.splitlines() if line.startswith("  ")]
  starts = {len(line) - len(line[2:].split(" ", 1)[1].lstrip()) for line in rows}
  assert len(rows) >= 12 and len(starts) == 1, out.stdout
