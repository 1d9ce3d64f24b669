"""Prepared data (ao_mdm/data/prepared.py): the stream against a naive packing, corruption,
mismatches, `ensure` across processes (threads here), and the authors' evaluation packing.
Processes, kills and the command: tests/integration/test_prepared_cli.py."""

import json
import os

import numpy as np
import pytest

from ao_mdm.data import datasets, pipeline, prepare, prepared
from helpers import SHARD_DOCS, split_files, text_file_config


def test_stream_blocks_and_counts_equal_a_naive_packing(corpus_file, sp_tokenizer, tmp_path):
  config = text_file_config(corpus_file, tmp_path / "tfds", tmp_path / "p")
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


def test_corrupt_shard_and_mismatched_manifest(corpus_file, sp_tokenizer, tmp_path):
  config = text_file_config(corpus_file, tmp_path / "tfds", tmp_path / "p")
  split = prepare.prepare(config, sp_tokenizer, "train", shard_docs=SHARD_DOCS)
  original = split_files(split)
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
  assert logs[1].startswith("prepared 1 of 5 shards") and split_files(repaired) == original
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
  config = text_file_config(corpus_file, tmp_path / "tfds", tmp_path / "p")
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
    config = text_file_config(corpus_file, tmp_path / "tfds", roots[index])
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
    text_file_config(corpus_file, tmp_path / "tfds", ""), "train", str(tmp_path / "tfds")
  )  # build the source once, before both start
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    splits = list(pool.map(run, range(2)))
  reference = prepare.prepare(
    text_file_config(corpus_file, tmp_path / "tfds", tmp_path / "ref"),
    sp_tokenizer,
    "train",
    shard_docs=SHARD_DOCS,
  )
  assert split_files(splits[0]) == split_files(splits[1]) == split_files(reference)


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
    text_file_config(corpus_file, tmp_path / "tfds", roots[1]),
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
    config = text_file_config(corpus_file, tmp_path / "tfds", roots[index])
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
  assert sorted(votes) == [False, True] and split_files(splits[0]) == split_files(splits[1])
