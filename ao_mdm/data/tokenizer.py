"""Tokenizers: the `Tokenizer` interface, SentencePiece (trained on the corpus), caching."""

from collections.abc import Iterable, Iterator, Sequence
import hashlib
import io
import re
from typing import Any, Protocol, runtime_checkable

import sentencepiece as spm

from ao_mdm import specs
from ao_mdm.storage import fs

TOKENIZERS = ("sentencepiece", "gpt2", "sudoku")
VOCAB_MULTIPLE = 128
# SentencePiece skips training lines longer than this many bytes; longer pieces are cut.
_MAX_SENTENCE_BYTES = 4096
# Training lines: split at newlines and at spaces after a sentence end (. ! ? or a closing quote).
_SENTENCE_END = re.compile(r"(?<=[.!?\"')\]’”])\s+(?=\S)|\n+")


@runtime_checkable
class Tokenizer(Protocol):
  """What the pipeline and the model need from a tokenizer (SentencePiece, GPT-2 BPE, ...)."""

  name: str  # one of TOKENIZERS
  sha256: str  # of the files that define it: prepared data is keyed by it
  eos_id: int
  vocab_size: int

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, with no BOS/EOS added."""

  def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
    """Token ids of several texts; num_threads 0: the library's default, 1: this thread only."""

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids`; decode(encode(t)) == t."""

  def token_bytes(self, token_id: int) -> bytes:
    """The UTF-8 bytes token `token_id` adds to a text (a part of a character, for a byte
    token): what the server shows of a token and where it starts in the text."""


class SentencePieceTokenizer:
  """A trained SentencePiece model loaded from a file (local or gs://)."""

  name = "sentencepiece"

  def __init__(self, model_path: str):
    if not fs.isfile(model_path):
      raise FileNotFoundError(f"SentencePiece model not found: {model_path}")
    self.model_path = model_path
    model = fs.read_bytes(model_path)
    self.sha256 = hashlib.sha256(model).hexdigest()
    self._sp = spm.SentencePieceProcessor(model_proto=model)
    self.vocab_size: int = self._sp.get_piece_size()
    self.eos_id: int = self._sp.eos_id()
    if self.eos_id < 0:
      raise ValueError(f"SentencePiece model {model_path} has no EOS id")

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, with no BOS/EOS added."""
    return self._sp.encode(text)

  def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
    """Token ids of several texts at once (faster than one by one)."""
    return self._sp.encode(texts, num_threads=num_threads or -1)

  def decode(self, ids: Sequence[int] | Any) -> str:
    """The text of `ids` (a list or a 1-D integer array)."""
    return self._sp.decode([int(i) for i in ids])

  def token_bytes(self, token_id: int) -> bytes:
    """A byte piece's one byte (`<0xE6>`), else the piece's text with its spaces (`▁`)."""
    i = int(token_id)
    if self._sp.is_byte(i):
      return bytes([int(self._sp.id_to_piece(i)[3:5], 16)])
    if self._sp.is_control(i) or self._sp.is_unknown(i):
      return self._sp.decode([i]).encode()
    return self._sp.id_to_piece(i).replace("\u2581", " ").encode()

  def __reduce__(self):  # worker processes reload the model from its file
    return SentencePieceTokenizer, (self.model_path,)


def sentences(text: str) -> list[str]:
  """The text cut at newlines and at spaces after a sentence end; blank pieces dropped."""
  return [s for s in _SENTENCE_END.split(text) if s.strip()]


def _training_sentences(texts: Iterable[str]) -> Iterator[str]:
  """Splits texts into sentences (SentencePiece skips over-long lines), cutting the too long."""
  for text in texts:
    for sentence in sentences(text):
      data = sentence.encode("utf-8")
      for start in range(0, len(data), _MAX_SENTENCE_BYTES):
        piece = data[start : start + _MAX_SENTENCE_BYTES].decode("utf-8", errors="ignore")
        if piece.strip():
          yield piece


def check_vocab_size(vocab_size: int) -> None:
  """Refuses a vocab size that is not a positive multiple of 128 (the model pads nothing)."""
  if not isinstance(vocab_size, int) or vocab_size <= 0 or vocab_size % VOCAB_MULTIPLE:
    raise ValueError(
      f"vocab_size must be a positive multiple of {VOCAB_MULTIPLE}, got {vocab_size!r}"
    )
  if vocab_size < 384:
    raise ValueError(
      f"vocab_size must be at least 384 (256 byte pieces + merges), got {vocab_size}"
    )


def train_sentencepiece(texts: Iterable[str], vocab_size: int, out_path: str) -> str:
  """Trains a byte-fallback BPE SentencePiece model (exact round trip) and writes it to out_path."""
  check_vocab_size(vocab_size)
  model = io.BytesIO()
  try:
    _train(texts, vocab_size, model)
  except RuntimeError as e:  # e.g. more pieces asked for than the corpus can give
    why = str(e).strip().splitlines()[-1].rsplit("] ", 1)[-1]
    raise ValueError(
      f"SentencePiece cannot train a vocab of {vocab_size} on this corpus: {why}"
    ) from None
  fs.write_bytes(out_path, model.getvalue())
  return out_path


def _train(texts: Iterable[str], vocab_size: int, model: io.BytesIO) -> None:
  spm.SentencePieceTrainer.train(
    sentence_iterator=_training_sentences(texts),
    model_writer=model,
    model_type="bpe",
    vocab_size=vocab_size,
    byte_fallback=True,
    character_coverage=0.9995,
    # Exact round trip: no normalisation, no dummy prefix, keep every space.
    normalization_rule_name="identity",
    add_dummy_prefix=False,
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    unk_id=0,
    eos_id=1,
    bos_id=-1,
    pad_id=-1,
    max_sentence_length=_MAX_SENTENCE_BYTES * 2,
    input_sentence_size=0,  # use every sentence: no sampling, deterministic
    shuffle_input_sentence=False,
    num_threads=1,
    minloglevel=2,
  )


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Refuses a tokenizer whose ids would not fit the model's embedding table."""
  if tokenizer.vocab_size > model_vocab_size:
    raise ValueError(
      f"tokenizer vocab_size {tokenizer.vocab_size} exceeds the model vocab_size "
      f"{model_vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}"
    )


def _dataset_tag(data_config: specs.DataSpec) -> str:
  """A file-name-safe name for the dataset; a local text file is named by its content hash."""
  from ao_mdm.data import datasets

  return datasets.dataset_tag(data_config)


def get_tokenizer(data_config: specs.DataSpec, vocab_size: int, cache_dir: str | None) -> Tokenizer:
  """Loads the cached tokenizer for the dataset, training it on the train split if it is missing."""
  name = data_config.tokenizer
  if name not in TOKENIZERS:
    raise ValueError(f"unknown tokenizer {name!r}; accepted: {', '.join(TOKENIZERS)}")
  if name == "gpt2":  # fixed files shipped in the package: no training, no cache
    from ao_mdm.data import gpt2

    if vocab_size < gpt2.VOCAB_SIZE:
      raise ValueError(
        f"vocab_size {vocab_size} is too small for the gpt2 tokenizer; expected "
        f">= {gpt2.VOCAB_SIZE} (the paper pads to 50304)"
      )
    return gpt2.GPT2Tokenizer()
  if name == "sudoku":  # a grid's digits: nothing to train or keep
    from ao_mdm.data import sudoku

    return sudoku.SudokuTokenizer()
  check_vocab_size(vocab_size)
  assert cache_dir, "a SentencePiece tokenizer is kept in a directory"  # run_tokenizer checks
  path = fs.join(cache_dir, "tokenizer", f"sp_{_dataset_tag(data_config)}_{vocab_size}.model")
  if not fs.isfile(path):
    from ao_mdm.data import datasets

    tfds_dir = datasets.resolve_tfds_dir(data_config.tfds_dir)
    train_sentencepiece(datasets.load_documents(data_config, "train", tfds_dir), vocab_size, path)
  return SentencePieceTokenizer(path)


def run_tokenizer(config: specs.Spec, workdir: str | None) -> Tokenizer:
  """The tokenizer of a training run (trained into workdir/tokenizer/ if it is SentencePiece and
  missing), checked against the model's vocab size."""
  if config.data.tokenizer == "sentencepiece" and not workdir:
    raise ValueError(
      "data.tokenizer='sentencepiece' is trained for each run: give --workdir=DIR, "
      "the work dir `ao-mdm train` uses (the tokenizer is trained there if missing)"
    )
  tokenizer = get_tokenizer(config.data, config.model.vocab_size, workdir)
  check_vocab(tokenizer, config.model.vocab_size)
  return tokenizer


def load_saved_tokenizer(
  data_config: specs.DataSpec, vocab_size: int, checkpoint: str
) -> Tokenizer:
  """The tokenizer saved with a training work dir or export; never trains one, never writes.

  A SentencePiece run keeps `<checkpoint>/tokenizer/sp_<dataset>_<V>.model`; GPT-2 uses the
  files shipped in the package.
  """
  if data_config.tokenizer != "sentencepiece":
    return get_tokenizer(data_config, vocab_size, checkpoint)
  directory = fs.join(checkpoint, "tokenizer")
  found = [
    fs.join(directory, name)
    for name in (fs.listdir(directory) if fs.isdir(directory) else [])
    if name.startswith("sp_") and name.endswith(f"_{vocab_size}.model")
  ]
  if len(found) != 1:
    what = "none" if not found else ", ".join(fs.basename(f) for f in found)
    raise FileNotFoundError(
      f"{checkpoint} needs exactly one SentencePiece tokenizer "
      f"tokenizer/sp_*_{vocab_size}.model (saved by `ao-mdm train` and copied by `ao-mdm "
      f"export`); found {what}"
    )
  return SentencePieceTokenizer(found[0])


def train_tokenizer(corpus: str, vocab_size: int, out: str) -> str:
  """A SentencePiece tokenizer trained on a registry dataset's or a local text file's train
  split, written into directory `out` (`ao-mdm tokenizer`); returns the model's path."""
  from ao_mdm.data import datasets

  data_config = datasets.data_config_for(corpus)
  path = fs.join(out, f"sp_{_dataset_tag(data_config)}_{vocab_size}.model")
  tfds_dir = datasets.resolve_tfds_dir(data_config.tfds_dir)
  train_sentencepiece(datasets.load_documents(data_config, "train", tfds_dir), vocab_size, path)
  return path
