"""Tests for ao_mdm.data: TFDS builders, registry, detokenizers and the grain pipeline."""

import os

import numpy as np
import pytest

from ao_mdm import specs
from ao_mdm.data import corpus, datasets, pipeline, prepare
from ao_mdm.perf import bench_data

T = 64


def _text_config(path, tfds_dir):
  return specs.default().data.replace(
    dataset="text_file", text_file=str(path), tfds_dir=str(tfds_dir)
  )


@pytest.fixture(scope="module")
def text_config(tmp_path_factory, data_dir):
  """A local text file: the validation speeches, cut into 300 documents of a few sentences."""
  words = " ".join(corpus.sotu_documents("validation")[:4]).split(" ")
  docs = [" ".join(words[i : i + 150]) for i in range(0, 300 * 150, 150)]
  path = tmp_path_factory.mktemp("text") / "docs.txt"
  path.write_text("\n".join(docs) + "\n", encoding="utf-8")
  return _text_config(path, data_dir)


def _iterator(config, tok, data_dir, **kwargs):
  del data_dir  # config.tfds_dir
  kwargs = {"global_batch_size": 4, "seed": 0, "process_index": 0, "process_count": 1, **kwargs}
  return pipeline.train_iterator(prepare.ensure(config, tok, "train").blocks(T), **kwargs)


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_batches_have_shape_and_dtype(text_config, sp_tokenizer, data_dir):
  it = _iterator(text_config, sp_tokenizer, data_dir, global_batch_size=8, process_count=2)
  for batch in _take(it, 5):
    assert batch.shape == (4, T) and batch.dtype == np.int32
    assert batch.min() >= 0 and batch.max() < sp_tokenizer.vocab_size


def test_eval_blocks_are_documents_in_order(sotu_config, sp_tokenizer):
  split = prepare.ensure(sotu_config, sp_tokenizer, "validation")
  blocks = pipeline.eval_blocks(split, 128)
  assert blocks.ndim == 2 and blocks.shape[1] == 128 and blocks.dtype == np.int32
  stream = blocks.reshape(-1)
  ends = np.flatnonzero(stream == sp_tokenizer.eos_id)
  starts = np.concatenate([[0], ends[:-1] + 1])
  decoded = [sp_tokenizer.decode(stream[s:e]) for s, e in zip(starts, ends)]
  docs = corpus.sotu_documents("validation")
  assert decoded == docs[: len(decoded)] and len(decoded) >= len(docs) - 1
  total = sum(len(sp_tokenizer.encode(d)) + 1 for d in docs)
  assert len(blocks) == total // 128
  few = pipeline.eval_blocks(split, 128, max_blocks=3)
  np.testing.assert_array_equal(few, blocks[:3])


def test_eval_blocks_too_few_tokens(tmp_path, sp_tokenizer, data_dir):
  path = tmp_path / "small.txt"
  path.write_text("one\ntwo\nthree\n", encoding="utf-8")
  split = prepare.ensure(_text_config(path, data_dir), sp_tokenizer, "train")
  for packing in pipeline.PACKINGS:
    with pytest.raises(ValueError, match=r"has \d+ tokens .*block_size=4096"):
      pipeline.eval_blocks(split, 4096, packing=packing)


def test_same_seed_same_batches(text_config, sp_tokenizer, data_dir):
  a = _take(_iterator(text_config, sp_tokenizer, data_dir, seed=3), 4)
  b = _take(_iterator(text_config, sp_tokenizer, data_dir, seed=3), 4)
  c = _take(_iterator(text_config, sp_tokenizer, data_dir, seed=4), 4)
  np.testing.assert_array_equal(np.stack(a), np.stack(b))
  assert not np.array_equal(np.stack(a), np.stack(c))


def test_process_shards_are_disjoint_and_cover_an_epoch(text_config, sp_tokenizer, data_dir):
  blocks = prepare.ensure(text_config, sp_tokenizer, "train").blocks(T).array()
  n = len(blocks)
  assert 100 < n < 2000 and n % 2  # an odd count: one block is left out of each epoch
  shards = []
  for p in range(2):
    it = _iterator(
      text_config, sp_tokenizer, data_dir, global_batch_size=2, process_index=p, process_count=2
    )
    shards.append([row.tobytes() for (row,) in _take(it, n // 2)])
  everything = {row.tobytes() for row in blocks}
  assert len(everything) == n  # no two blocks alike, so the sets below count blocks
  assert not set(shards[0]) & set(shards[1])
  assert len(set(shards[0]) | set(shards[1])) == 2 * (n // 2) and set(shards[0]) <= everything
  # The next epoch is shuffled differently.
  it = _iterator(text_config, sp_tokenizer, data_dir, global_batch_size=1)
  epochs = np.stack(_take(it, 2 * n))[:, 0]
  assert not np.array_equal(epochs[:n], epochs[n:])
  assert sorted(map(bytes, epochs[:n])) == sorted(map(bytes, blocks))  # one process: all


def test_restored_iterator_continues(text_config, sp_tokenizer, data_dir):
  it = _iterator(text_config, sp_tokenizer, data_dir, seed=7)
  _take(it, 5)
  state = it.get_state()
  expected = _take(it, 2)
  restored = _iterator(text_config, sp_tokenizer, data_dir, seed=7)
  restored.set_state(state)
  np.testing.assert_array_equal(np.stack(_take(restored, 2)), np.stack(expected))


def test_orbax_saves_the_iterator(text_config, sp_tokenizer, data_dir, tmp_path):
  import grain
  import orbax.checkpoint as ocp

  it = _iterator(text_config, sp_tokenizer, data_dir)
  _take(it, 3)
  with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mngr:
    mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    expected = next(it)
    restored = _iterator(text_config, sp_tokenizer, data_dir)
    mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
  np.testing.assert_array_equal(next(restored), expected)


def test_bad_batch_and_process_arguments(text_config, sp_tokenizer, data_dir):
  with pytest.raises(ValueError, match="global_batch_size 6 must be a positive multiple"):
    _iterator(text_config, sp_tokenizer, data_dir, global_batch_size=6, process_count=4)
  with pytest.raises(ValueError, match="process_index must be in"):
    _iterator(text_config, sp_tokenizer, data_dir, process_index=2, process_count=2)


def test_missing_and_empty_text_files(tmp_path, data_dir):
  missing = tmp_path / "missing.txt"
  with pytest.raises(FileNotFoundError, match="missing.txt"):
    datasets.load_documents(_text_config(missing, data_dir), "train", data_dir)
  for name, content in [("empty.txt", ""), ("blank.txt", "\n  \n\n")]:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{name}.* is empty"):
      datasets.load_documents(_text_config(path, data_dir), "train", data_dir)
  with pytest.raises(ValueError, match="text_file is empty"):
    datasets.load_documents(_text_config("", data_dir), "train", data_dir)


def test_text_file_builder(tmp_path):
  tfds_dir = tmp_path / "tfds"
  path = tmp_path / "a.txt"
  path.write_text("first doc\n\nsecond doc ü\nthird\n", encoding="utf-8")
  config = _text_config(path, tfds_dir)
  assert list(datasets.load_documents(config, "train", str(tfds_dir))) == [
    "first doc",
    "second doc ü",
  ]
  assert list(datasets.load_documents(config, "validation", str(tfds_dir))) == ["third"]
  docs_dir = tmp_path / "docs"
  docs_dir.mkdir()
  for i in range(3):
    (docs_dir / f"{i}.txt").write_text(f"doc {i}\nline two\n", encoding="utf-8")
  dir_config = _text_config(docs_dir, tfds_dir)
  assert list(datasets.load_documents(dir_config, "train", str(tfds_dir))) == [
    "doc 0\nline two",
    "doc 1\nline two",
  ]
  # Different content, different builder config: both stay prepared side by side.
  names = sorted(os.listdir(tfds_dir / "text_file"))
  assert len(names) == 2 and all(n.startswith("h") for n in names)
  assert datasets.dataset_tag(config) != datasets.dataset_tag(dir_config)


def test_unknown_names(sotu_config, data_dir):
  bad = sotu_config.replace(dataset="nope")
  with pytest.raises(ValueError, match="'nope'; known: .*lm1b.*sotu.*wikitext103"):
    datasets.load_documents(bad, "train", data_dir)
  with pytest.raises(ValueError, match="no split 'test'; splits: train, validation"):
    datasets.load_documents(sotu_config, "test", data_dir)


def test_catalog_dataset_not_prepared(tmp_path):
  config = specs.default().data.replace(dataset="wikitext103", tfds_dir=str(tmp_path))
  with pytest.raises(FileNotFoundError, match="'wikitext103' is not prepared.*tfds build"):
    datasets.load_documents(config, "validation", str(tmp_path))


def test_registry_wiring():
  assert datasets.get_spec("wikitext2").detokenizer == "wikitext"
  assert datasets.get_spec("ptb").text_key == "sentence"
  assert datasets.get_spec("lm1b").detokenizer == "lm1b"
  assert datasets.get_spec("openwebtext").splits["validation"] == "train[-100000:]"


def test_lambada_from_a_local_openai_jsonl(tmp_path):
  """LAMBADA is read as the authors read it: OpenAI's jsonl, field `text`, detokenized."""
  path = tmp_path / "lambada_test.jsonl"
  path.write_text(
    '{"text": "\u201cHi,\u201d she said to her friend"}\n\n{"text": "  the last word  "}\n',
    encoding="utf-8",
  )
  config = specs.default().data.replace(dataset="lambada", text_file=str(path))
  docs = datasets.load_documents(config, "test", str(tmp_path / "tfds"))
  assert list(docs) == ['\n"Hi," she said to her friend', "\nthe last word"]
  path.write_text('{"text": "ok"}\n{"passage": "wrong field"}\n', encoding="utf-8")
  config = config.replace(text_file=str(path))
  with pytest.raises(ValueError, match=r"lambada_test.jsonl: record 2 has no 'text' string"):
    datasets.load_documents(config, "test", str(tmp_path / "tfds"))


def test_token_counts_count_every_token_and_one_eos_per_document(
  text_config, sp_tokenizer, data_dir
):
  counts = prepare.ensure(text_config, sp_tokenizer, "train").token_counts()
  docs = list(datasets.load_documents(text_config, "train", data_dir))
  naive = np.zeros(sp_tokenizer.vocab_size, np.int64)
  for doc in docs:
    for i in sp_tokenizer.encode(doc) + [sp_tokenizer.eos_id]:
      naive[i] += 1
  np.testing.assert_array_equal(counts, naive)
  assert counts[sp_tokenizer.eos_id] >= len(docs)


def test_synthetic_documents_are_seeded_and_sized():
  a = list(bench_data.synthetic_documents(300_000, seed=3))
  assert a == list(bench_data.synthetic_documents(300_000, seed=3))
  assert a != list(bench_data.synthetic_documents(300_000, seed=4))
  assert 300_000 <= sum(map(len, a)) < 300_000 + max(map(len, a))
  assert not any("\n" in d for d in a) and len(set(a)) == len(a)
  sentences = {s for r in corpus.sotu_records() for s in r["text"].split("\n")}
  assert a[0].split(". ")[0] + "." in " ".join(sentences)  # made of the corpus's sentences
