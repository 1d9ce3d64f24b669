"""Prepared data across processes: byte-identical shards from 1 worker, 2 workers and 2
processes; a killed prepare not accepted and completed by a rerun; `ao-mdm train` and `prepare`
refusing in one line; `prepare --workers` quiet, its workers gone with it when killed."""

import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ao_mdm.data import datasets, prepare, prepared
from helpers import ROOT, SHARD_DOCS, split_files, text_file_config

_CHILD = """
import json, sys
from ao_mdm.data import prepare, tokenizer
from ao_mdm import specs
config = specs.DataSpec(**json.loads(sys.argv[1]))
tok = tokenizer.SentencePieceTokenizer(sys.argv[2])
prepare.prepare(config, tok, "train", workers=1, shard_docs=int(sys.argv[3]),
                 process_index=int(sys.argv[4]), process_count=int(sys.argv[5]))
"""


def _child(config, tok, shard_docs, index=0, count=1):
  return subprocess.Popen(
    [
      sys.executable,
      "-c",
      _CHILD,
      json.dumps(dataclasses.asdict(config)),
      tok.model_path,
      str(shard_docs),
      str(index),
      str(count),
    ],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def test_one_worker_two_workers_two_processes_same_bytes(corpus_file, sp_tokenizer, tmp_path):
  one = prepare.prepare(
    text_file_config(corpus_file, tmp_path / "tfds", tmp_path / "a"),
    sp_tokenizer,
    "train",
    workers=1,
    shard_docs=SHARD_DOCS,
  )
  assert len(one.manifest["shards"]) == 5 and one.documents == 304
  two = prepare.prepare(
    text_file_config(corpus_file, tmp_path / "tfds", tmp_path / "b"),
    sp_tokenizer,
    "train",
    workers=2,
    shard_docs=SHARD_DOCS,
  )
  config = text_file_config(corpus_file, tmp_path / "tfds", tmp_path / "c")
  procs = [_child(config, sp_tokenizer, SHARD_DOCS, i, 2) for i in range(2)]
  for p in procs:
    assert p.wait(timeout=120) == 0, p.stdout.read()
  logs = []
  # Whichever process finished last wrote the manifest; if both finished together, this
  # completes it without tokenizing anything again.
  hosts = prepare.prepare(config, sp_tokenizer, "train", shard_docs=SHARD_DOCS, log=logs.append)
  assert not any(line.startswith("prepared") for line in logs)
  assert split_files(one) == split_files(two) == split_files(hosts)


def test_killed_prepare_is_not_accepted_and_a_rerun_completes(tmp_path, sp_tokenizer):
  from ao_mdm.data import corpus

  words = corpus.sotu_documents("validation")[0].split(" ")
  path = tmp_path / "many.txt"
  path.write_text("\n".join(" ".join(words[i : i + 40]) for i in range(3000)) + "\n")
  config = text_file_config(path, tmp_path / "tfds", tmp_path / "p")
  datasets.load_documents(config, "train", config.tfds_dir)  # build the source first
  directory = prepared.split_dir(config, sp_tokenizer, "train")
  proc = _child(config, sp_tokenizer, 8)
  deadline = time.time() + 120
  while len(glob.glob(os.path.join(directory, "shard-*.json"))) < 3 and time.time() < deadline:
    time.sleep(0.005)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=30)
  finished = len(glob.glob(os.path.join(directory, "shard-*.json")))
  assert 3 <= finished < 357 and not os.path.exists(os.path.join(directory, "manifest.json"))
  with pytest.raises(prepared.NotPrepared, match="is not prepared"):
    prepared.open_split(config, sp_tokenizer, "train")
  logs = []
  split = prepare.prepare(config, sp_tokenizer, "train", shard_docs=8, log=logs.append)
  redone = int(logs[0].split()[1])
  assert logs[0].startswith("prepared") and redone == 357 - finished
  assert not glob.glob(os.path.join(directory, "*.tmp-*"))  # the killed process's temp files
  reference = prepare.prepare(
    text_file_config(path, tmp_path / "tfds", tmp_path / "q"), sp_tokenizer, "train", shard_docs=8
  )
  assert split_files(split) == split_files(reference)


def test_cli_refuses_corrupt_and_foreign_preparations(corpus_file, sp_tokenizer, tmp_path):
  """`ao-mdm train` on a corrupt or mismatched preparation: one error line, nothing trained."""
  config = text_file_config(corpus_file, tmp_path / "tfds", tmp_path / "p")
  workdir = tmp_path / "run"
  (workdir / "tokenizer").mkdir(parents=True)
  tag = datasets.dataset_tag(config)
  shutil.copy(sp_tokenizer.model_path, workdir / "tokenizer" / f"sp_{tag}_512.model")
  split = prepare.prepare(config, sp_tokenizer, "train")
  with open(os.path.join(split.directory, "shard-00000.bin"), "r+b") as f:
    f.write(b"\0\0")
  before = sorted(os.listdir(workdir))
  cmd = [
    sys.executable,
    "-m",
    "ao_mdm.cli.main",
    "train",
    f"--config={ROOT}/configs/tiny.py",
    f"--workdir={workdir}",
    "--config.model.vocab_size=512",
    "--config.data.dataset=text_file",
    f"--config.data.text_file={corpus_file}",
    f"--config.data.tfds_dir={config.tfds_dir}",
    f"--config.data.prepared_dir={config.prepared_dir}",
  ]
  out = subprocess.run(
    cmd,
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr
  assert "shard-00000.bin has sha256" in errors[0] and "ao-mdm prepare" in errors[0]
  assert sorted(os.listdir(workdir)) == before  # no checkpoints/, logs or metrics
  prepare.prepare(config, sp_tokenizer, "train", log=lambda _: None)  # redoes the shard
  manifest_path = os.path.join(split.directory, "manifest.json")
  manifest = json.load(open(manifest_path))
  json.dump({**manifest, "source": "text_file/other/1.0.0"}, open(manifest_path, "w"))
  out = subprocess.run(
    cmd,
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr
  assert (
    f"does not match its source: prepared with source='text_file/other/1.0.0', the "
    f"dataset now gives {manifest['source']!r}" in errors[0]
  )
  assert sorted(os.listdir(workdir)) == before


def test_sentencepiece_prepare_needs_a_workdir():
  out = subprocess.run(
    [sys.executable, "-m", "ao_mdm.cli.main", "prepare", f"--config={ROOT}/configs/tiny.py"],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 2 and out.stderr.splitlines() == [
    "error: data.tokenizer='sentencepiece' is trained for each run: give --workdir=DIR, the "
    "work dir `ao-mdm train` uses (the tokenizer is trained there if missing)"
  ]


@pytest.mark.slow  # two prepare processes with workers (about 10 s)
def test_prepare_with_workers_is_quiet_and_a_kill_leaves_no_worker(tmp_path):
  """`ao-mdm prepare --workers=2`: no TFDS note from the workers; SIGKILL to the command ends its
  workers with it (no broken-pipe tracebacks on the terminal, no process left)."""
  from ao_mdm.data import corpus

  words = " ".join(corpus.sotu_documents("validation")).split(" ")
  path = tmp_path / "many.txt"
  path.write_text("\n".join(" ".join(words[i % 5000 : i % 5000 + 200]) for i in range(24000)))
  args = [
    sys.executable,
    "-m",
    "ao_mdm.cli.main",
    "prepare",
    f"--config={ROOT}/configs/tiny.py",
    "--config.data.dataset=text_file",
    f"--config.data.text_file={path}",
    "--config.data.tokenizer=gpt2",
    "--config.model.vocab_size=50304",
    "--workers=2",
    "--splits=train",
  ]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  stderr = tmp_path / "stderr.txt"
  with open(stderr, "w") as err:
    proc = subprocess.Popen(
      [*args, f"--config.data.tfds_dir={tmp_path / 'a'}"],
      cwd=ROOT,
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=err,
      start_new_session=True,
    )
    deadline = time.time() + 120
    while not glob.glob(str(tmp_path / "a" / "**" / "shard-*.json"), recursive=True):
      assert proc.poll() is None and time.time() < deadline, stderr.read_text()
      time.sleep(0.01)
    proc.kill()
    proc.wait()
    while time.time() < deadline:  # the workers go with it
      try:
        os.killpg(proc.pid, 0)
      except ProcessLookupError:
        break
      time.sleep(0.05)
    else:
      raise AssertionError("workers outlived the killed command")
  said = stderr.read_text()  # the progress bar, nothing else
  assert not any(w in said for w in ("Traceback", "Error", "absl")), said[-3000:]
  done = subprocess.run(
    [*args, f"--config.data.tfds_dir={tmp_path / 'b'}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0 and "absl" not in done.stdout + done.stderr, done.stderr[-3000:]
  assert "documents" in done.stdout and " shards, every shard hashed" in done.stdout
