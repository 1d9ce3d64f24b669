"""Prepared data (ao_mdm/data/prepared.py): byte-identical shards from 1 worker, 2 workers and
2 processes, the stream against a naive packing, kills, corruption, mismatches, and the
authors' evaluation packing."""

import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ao_mdm import specs
from ao_mdm.data import datasets, pipeline, prepare, prepared

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD_DOCS = 64


def _config(text_file, tfds_dir, prepared_dir):
  return specs.default().data.replace(
    dataset="text_file",
    text_file=str(text_file),
    tfds_dir=str(tfds_dir),
    prepared_dir=str(prepared_dir),
  )


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
  """320 documents of varying length cut from the embedded corpus (5 shards of 64)."""
  from ao_mdm.data import corpus

  words = " ".join(corpus.sotu_documents("validation")[:4]).split(" ")
  rng = np.random.default_rng(0)
  docs, start = [], 0
  for _ in range(320):
    n = int(rng.integers(5, 120))
    docs.append(" ".join(words[start : start + n]))
    start = (start + n) % (len(words) - 200)
  path = tmp_path_factory.mktemp("corpus") / "docs.txt"
  path.write_text("\n".join(docs) + "\n", encoding="utf-8")
  return path


def _files(split):
  """{file name: bytes} of a preparation's shards, counts and manifest."""
  names = [s["file"] for s in split.manifest["shards"]] + ["token_counts.npy", "manifest.json"]
  return {n: open(os.path.join(split.directory, n), "rb").read() for n in names}


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
    _config(corpus_file, tmp_path / "tfds", tmp_path / "a"),
    sp_tokenizer,
    "train",
    workers=1,
    shard_docs=SHARD_DOCS,
  )
  assert len(one.manifest["shards"]) == 5 and one.documents == 304
  two = prepare.prepare(
    _config(corpus_file, tmp_path / "tfds", tmp_path / "b"),
    sp_tokenizer,
    "train",
    workers=2,
    shard_docs=SHARD_DOCS,
  )
  config = _config(corpus_file, tmp_path / "tfds", tmp_path / "c")
  procs = [_child(config, sp_tokenizer, SHARD_DOCS, i, 2) for i in range(2)]
  for p in procs:
    assert p.wait(timeout=120) == 0, p.stdout.read()
  logs = []
  # Whichever process finished last wrote the manifest; if both finished together, this
  # completes it without tokenizing anything again.
  hosts = prepare.prepare(config, sp_tokenizer, "train", shard_docs=SHARD_DOCS, log=logs.append)
  assert not any(line.startswith("prepared") for line in logs)
  assert _files(one) == _files(two) == _files(hosts)


def test_stream_blocks_and_counts_equal_a_naive_packing(corpus_file, sp_tokenizer, tmp_path):
  config = _config(corpus_file, tmp_path / "tfds", tmp_path / "p")
  split = prepare.prepare(config, sp_tokenizer, "train", shard_docs=SHARD_DOCS)
  docs = list(datasets.load_documents(config, "train", config.tfds_dir))
  ids = [sp_tokenizer.encode(d) for d in docs]
  naive = np.concatenate([np.asarray(x + [sp_tokenizer.eos_id]) for x in ids])
  assert split.tokens == split.manifest["tokens"] == len(naive)
  np.testing.assert_array_equal(split.read(0, split.tokens), naive)
  np.testing.assert_array_equal(
    split.token_counts(), np.bincount(naive, minlength=sp_tokenizer.vocab_size)
  )
  first_shard = split.manifest["shards"][0]["tokens"]
  for t in (32, 100, first_shard + 7):  # blocks cross shard boundaries
    blocks = split.blocks(t)
    packed = pipeline.pack_documents(ids, sp_tokenizer.eos_id, t)
    np.testing.assert_array_equal(blocks.array(), packed)
    np.testing.assert_array_equal(blocks[len(blocks) - 1], packed[-1])
    assert blocks[0].dtype == np.int32
  with pytest.raises(IndexError):
    split.blocks(32)[len(split.blocks(32))]


def test_killed_prepare_is_not_accepted_and_a_rerun_completes(tmp_path, sp_tokenizer):
  from ao_mdm.data import corpus

  words = corpus.sotu_documents("validation")[0].split(" ")
  path = tmp_path / "many.txt"
  path.write_text("\n".join(" ".join(words[i : i + 40]) for i in range(3000)) + "\n")
  config = _config(path, tmp_path / "tfds", tmp_path / "p")
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
    _config(path, tmp_path / "tfds", tmp_path / "q"), sp_tokenizer, "train", shard_docs=8
  )
  assert _files(split) == _files(reference)


def test_corrupt_shard_and_mismatched_manifest(corpus_file, sp_tokenizer, tmp_path):
  config = _config(corpus_file, tmp_path / "tfds", tmp_path / "p")
  split = prepare.prepare(config, sp_tokenizer, "train", shard_docs=SHARD_DOCS)
  original = _files(split)
  shard = os.path.join(split.directory, "shard-00002.bin")
  with open(shard, "r+b") as f:  # same size, one token changed
    f.seek(100)
    byte = f.read(1)
    f.seek(100)
    f.write(bytes([byte[0] ^ 1]))
  with pytest.raises(prepared.CorruptShard, match=r"shard-00002.bin has sha256 .*corrupted"):
    prepared.open_split(config, sp_tokenizer, "train")
  with open(shard, "r+b") as f:
    f.truncate(50)
  with pytest.raises(prepared.CorruptShard, match=r"shard-00002.bin is 50 bytes, its manifest"):
    prepared.open_split(config, sp_tokenizer, "train")
  logs = []  # `prepare` redoes the bad shard, and only it
  repaired = prepare.prepare(config, sp_tokenizer, "train", shard_docs=SHARD_DOCS, log=logs.append)
  assert logs[1].startswith("prepared 1 of 5 shards") and _files(repaired) == original
  manifest_path = os.path.join(split.directory, "manifest.json")
  manifest = json.load(open(manifest_path))
  manifest["tokenizer_sha256"] = "0" * 64
  json.dump(manifest, open(manifest_path, "w"))
  for call in (prepared.open_split, prepare.prepare):
    with pytest.raises(
      ValueError,
      match=r"prepared with tokenizer_sha256='0000.*but this config "
      rf"gives tokenizer_sha256='{sp_tokenizer.sha256}'",
    ):
      call(config, sp_tokenizer, "train")


def test_a_record_gone_before_the_manifest_is_named(
  corpus_file, sp_tokenizer, tmp_path, monkeypatch
):
  """A shard's record removed after prepare found it complete (another process redoing that
  shard) is a FileNotFoundError naming the record, not a TypeError from reading None."""
  config = _config(corpus_file, tmp_path / "tfds", tmp_path / "p")
  read_json = prepared.read_json

  def read_then_removed(path):  # record 2, once read complete, is taken away
    found = read_json(path)
    if found is not None and path.endswith(prepared.record_name(2)):
      os.remove(path)
    return found

  monkeypatch.setattr(prepared, "read_json", read_then_removed)
  with pytest.raises(FileNotFoundError, match=prepared.record_name(2)):
    prepare.prepare(config, sp_tokenizer, "train", shard_docs=SHARD_DOCS)
  assert not os.path.exists(
    os.path.join(prepared.split_dir(config, sp_tokenizer, "train"), "manifest.json")
  )


def test_cli_refuses_corrupt_and_foreign_preparations(corpus_file, sp_tokenizer, tmp_path):
  """`ao-mdm train` on a corrupt or mismatched preparation: one error line, nothing trained."""
  config = _config(corpus_file, tmp_path / "tfds", tmp_path / "p")
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


def test_paper_blocks_hand_computed():
  """The authors' group_texts under map(batched=True, num_proc=8), worked by hand."""
  eos = 9
  # 20 documents of 2 tokens + EOS: 8 shards of 3,3,3,3,2,2,2,2 documents.
  stream = np.tile([1, 2, eos], 20)
  # One batch per shard: 9 tokens -> 2 blocks of 4 (1 token dropped), 6 tokens -> 1 block.
  blocks = prepared.paper_blocks(stream, eos, 4)
  assert len(blocks) == 4 * 2 + 4 * 1 and len(stream) // 4 == 15
  np.testing.assert_array_equal(blocks[:3], [[1, 2, eos, 1], [2, eos, 1, 2], [1, 2, eos, 1]])
  # Batches of 2 documents: a 3-document shard is batches of 6 and 3 tokens -> 1 + 0 blocks.
  assert len(prepared.paper_blocks(stream, eos, 4, batch_docs=2)) == 8
  # Fewer documents than processes: one shard each. 5 documents of 7 tokens + EOS, T = 3.
  five = np.tile([5, 5, 5, 5, 5, 5, 5, eos], 5)
  assert len(prepared.paper_blocks(five, eos, 3)) == 5 * 2 and len(five) // 3 == 13
  assert prepared.paper_blocks(five, eos, 9).shape == (0, 9)


@pytest.mark.parametrize("shared", [True, False])
def test_ensure_across_processes(corpus_file, sp_tokenizer, tmp_path, shared, monkeypatch):
  """Two processes (threads here, with a real barrier) on a shared or an unshared file system."""
  import concurrent.futures
  import threading

  monkeypatch.setattr(prepare, "SHARD_DOCS", SHARD_DOCS)
  barrier = threading.Barrier(2, timeout=60)
  roots = [tmp_path / "p"] * 2 if shared else [tmp_path / "p0", tmp_path / "p1"]

  def run(index):
    config = _config(corpus_file, tmp_path / "tfds", roots[index])
    return prepare.ensure(
      config,
      sp_tokenizer,
      "train",
      workers=1,
      process_index=index,
      process_count=2,
      barrier=lambda _: barrier.wait(),
      log=lambda _: None,
    )

  datasets.load_documents(
    _config(corpus_file, tmp_path / "tfds", ""), "train", str(tmp_path / "tfds")
  )  # build the source once, before both start
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    splits = list(pool.map(run, range(2)))
  reference = prepare.prepare(
    _config(corpus_file, tmp_path / "tfds", tmp_path / "ref"),
    sp_tokenizer,
    "train",
    shard_docs=SHARD_DOCS,
  )
  assert _files(splits[0]) == _files(splits[1]) == _files(reference)


def test_ensure_takes_one_path_when_only_some_processes_find_the_preparation(
  corpus_file, sp_tokenizer, tmp_path, monkeypatch
):
  """Process 1 finds a preparation that process 0 does not see yet (one finished first): both
  must still meet at the same barriers, which `all_true` arranges."""
  import concurrent.futures
  import threading

  monkeypatch.setattr(prepare, "SHARD_DOCS", SHARD_DOCS)
  barrier = threading.Barrier(2, timeout=20)
  votes = []
  roots = [tmp_path / "p0", tmp_path / "p1"]
  prepare.prepare(
    _config(corpus_file, tmp_path / "tfds", roots[1]),
    sp_tokenizer,
    "train",
    shard_docs=SHARD_DOCS,
    log=lambda _: None,
  )

  def all_true(found):
    votes.append(found)
    barrier.wait()
    return all(votes)

  def run(index):
    config = _config(corpus_file, tmp_path / "tfds", roots[index])
    return prepare.ensure(
      config,
      sp_tokenizer,
      "train",
      workers=1,
      process_index=index,
      process_count=2,
      barrier=lambda _: barrier.wait(),
      all_true=all_true,
      log=lambda _: None,
    )

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    splits = list(pool.map(run, range(2)))
  assert sorted(votes) == [False, True] and _files(splits[0]) == _files(splits[1])


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
