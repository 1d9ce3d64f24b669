"""Tests for ao_mdm.data.gpt2 (GPT-2 BPE from the files shipped in the package)."""

import os
import shutil

import pytest

from ao_mdm import specs
from ao_mdm.data import corpus, gpt2
from ao_mdm.data import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def tok():
  return gpt2.GPT2Tokenizer()


def _copy_files(tmp_path) -> str:
  for name in gpt2.FILE_SHA256:
    shutil.copy(os.path.join(gpt2.DATA_DIR, name), tmp_path / name)
  return str(tmp_path)


def test_known_ids_and_interface(tok):
  assert tok.encode("Hello world!") == [15496, 995, 0]
  assert tok.decode([15496, 995, 0]) == "Hello world!"
  assert (tok.vocab_size, tok.eos_id) == (50257, 50256)
  assert tok.decode([tok.eos_id]) == "<|endoftext|>"
  assert tok.eos_id not in tok.encode("a <|endoftext|> b")  # special text is ordinary text


def test_round_trip_on_validation_split(tok):
  docs = corpus.sotu_documents("validation")
  assert docs
  for doc, ids in zip(docs, tok.encode_batch(docs)):
    assert ids == tok.encode(doc)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == doc
  for text in ["Größe – naïve café, 東京 🚀", "  two  spaces\n\nnew\tlines  ", ""]:
    assert tok.decode(tok.encode(text)) == text


def test_directory_argument(tmp_path):
  assert gpt2.GPT2Tokenizer(_copy_files(tmp_path)).encode("Hello world!") == [15496, 995, 0]


def test_missing_file_is_refused(tmp_path):
  directory = _copy_files(tmp_path)
  os.remove(os.path.join(directory, "vocab.bpe"))
  with pytest.raises(FileNotFoundError, match=f"vocab.bpe.*{gpt2.FILE_SHA256['vocab.bpe']}"):
    gpt2.GPT2Tokenizer(directory)


def test_altered_file_is_refused(tmp_path):
  directory = _copy_files(tmp_path)
  with open(os.path.join(directory, "encoder.json"), "ab") as f:
    f.write(b" ")
  expected = gpt2.FILE_SHA256["encoder.json"]
  with pytest.raises(ValueError, match=f"encoder.json.*expected {expected}"):
    gpt2.GPT2Tokenizer(directory)


def test_get_tokenizer(tmp_path):
  data = specs.default().data.replace(dataset="openwebtext", tokenizer="gpt2")
  tok = tokenizer_lib.get_tokenizer(data, 50304, str(tmp_path))
  assert isinstance(tok, gpt2.GPT2Tokenizer)
  assert not os.listdir(tmp_path)  # nothing trained or cached
  with pytest.raises(ValueError, match="vocab_size 50000 .* >= 50257"):
    tokenizer_lib.get_tokenizer(data, 50000, str(tmp_path))
