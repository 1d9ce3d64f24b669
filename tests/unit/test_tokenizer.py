"""Tests for ao_mdm.data.tokenizer."""

import os
import shutil

import pytest

from ao_mdm import specs
from ao_mdm.data import corpus
from ao_mdm.data import tokenizer as tokenizer_lib

VOCAB = 512  # the size conftest.sp_tokenizer is trained to


def _validation_lines(n):
  """The first n sentences of the held-out validation speeches."""
  lines = []
  for doc in corpus.sotu_documents("validation"):
    lines.extend(tokenizer_lib.sentences(doc))
  return lines[:n]


def test_round_trip_on_held_out_lines(sp_tokenizer):
  lines = _validation_lines(200)
  assert len(lines) == 200
  for line in lines:
    assert sp_tokenizer.decode(sp_tokenizer.encode(line)) == line


def test_round_trip_whole_speech_and_odd_text(sp_tokenizer):
  speech = corpus.sotu_documents("validation")[-1]
  assert sp_tokenizer.decode(sp_tokenizer.encode(speech)) == speech
  for text in ["Größe – naïve café, 東京 🚀", "  two  spaces\n\nnew\tlines  ", " lead", ""]:
    ids = sp_tokenizer.encode(text)
    assert all(0 <= i < sp_tokenizer.vocab_size for i in ids)
    assert sp_tokenizer.decode(ids) == text


def test_interface(sp_tokenizer):
  assert sp_tokenizer.vocab_size == VOCAB
  assert 0 <= sp_tokenizer.eos_id < VOCAB
  assert sp_tokenizer.eos_id not in sp_tokenizer.encode("Hello. World.")


def test_vocab_not_multiple_of_128_refused(sotu_config, tmp_path):
  with pytest.raises(ValueError, match="multiple of 128"):
    tokenizer_lib.train_sentencepiece(["a b c"], 500, str(tmp_path / "x.model"))
  with pytest.raises(ValueError, match="multiple of 128.*1000"):
    tokenizer_lib.get_tokenizer(sotu_config, 1000, str(tmp_path))
  assert not os.listdir(tmp_path)


def test_cached_model_reused(sotu_config, data_dir, sp_tokenizer, monkeypatch):
  mtime = os.path.getmtime(sp_tokenizer.model_path)

  def fail(*args, **kwargs):
    raise AssertionError("retrained a cached tokenizer")

  monkeypatch.setattr(tokenizer_lib, "train_sentencepiece", fail)
  again = tokenizer_lib.get_tokenizer(sotu_config, VOCAB, data_dir)
  assert again.model_path == sp_tokenizer.model_path
  assert os.path.basename(again.model_path) == f"sp_sotu_{VOCAB}.model"
  assert os.path.getmtime(again.model_path) == mtime


def test_check_vocab(sp_tokenizer):
  tokenizer_lib.check_vocab(sp_tokenizer, VOCAB)
  with pytest.raises(ValueError, match=f"{VOCAB} exceeds the model vocab_size 384"):
    tokenizer_lib.check_vocab(sp_tokenizer, 384)


def test_unknown_tokenizer(sotu_config, tmp_path):
  config = sotu_config.replace(tokenizer="wordpiece")
  with pytest.raises(ValueError, match="'wordpiece'.*sentencepiece"):
    tokenizer_lib.get_tokenizer(config, VOCAB, str(tmp_path))


def test_cli_trains_deterministically_on_a_text_file(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_text("\n".join(corpus.sotu_documents("validation")) + "\n", encoding="utf-8")
  first = tokenizer_lib.train_tokenizer(str(path), 384, str(tmp_path / "a"))
  second = tokenizer_lib.train_tokenizer(str(path), 384, str(tmp_path / "b"))
  assert os.path.basename(first).startswith("sp_text_file-")
  with open(first, "rb") as f1, open(second, "rb") as f2:
    assert f1.read() == f2.read()
  assert not [n for n in os.listdir(tmp_path / "a") if ".tmp" in n]
  with pytest.raises(ValueError, match="neither a dataset name"):
    tokenizer_lib.train_tokenizer(str(tmp_path / "missing.txt"), 384, str(tmp_path))


def test_saved_tokenizer_is_loaded_without_the_corpus(sp_tokenizer, tmp_path, monkeypatch):
  """sample/eval read the run's own file: a moved corpus changes nothing, nothing is trained."""
  run = tmp_path / "run"
  (run / "tokenizer").mkdir(parents=True)
  shutil.copy(sp_tokenizer.model_path, run / "tokenizer" / f"sp_text_file-h0123_{VOCAB}.model")
  config = specs.default().data.replace(dataset="text_file", text_file=str(tmp_path / "gone"))
  monkeypatch.setattr(tokenizer_lib, "train_sentencepiece", None)  # any training would fail
  before = sorted(os.listdir(run / "tokenizer"))
  loaded = tokenizer_lib.load_saved_tokenizer(config, VOCAB, str(run))
  text = "Fellow-citizens of the Senate"
  assert loaded.encode(text) == sp_tokenizer.encode(text)
  assert sorted(os.listdir(run / "tokenizer")) == before
  with pytest.raises(FileNotFoundError, match="tokenizer/sp_\\*_384.model.*found none"):
    tokenizer_lib.load_saved_tokenizer(config, 384, str(run))
  shutil.copy(sp_tokenizer.model_path, run / "tokenizer" / f"sp_sotu_{VOCAB}.model")
  with pytest.raises(FileNotFoundError, match="found sp_sotu_512.model, sp_text_file-h0123"):
    tokenizer_lib.load_saved_tokenizer(config, VOCAB, str(run))
