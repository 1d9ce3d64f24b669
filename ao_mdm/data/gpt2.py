"""GPT-2 BPE (the paper's tokenizer) built offline with tiktoken from files shipped in the package.

The files are OpenAI's `encoder.json` and `vocab.bpe` (see `gpt2_bpe/ATTRIBUTION.md`); their
sha256 is checked at load, so a missing or altered file is refused before tiktoken reads it.
"""

from collections.abc import Sequence
import hashlib
import os
from typing import Any

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_bpe")
# The hashes tiktoken's own `gpt2` encoding expects for these files.
FILE_SHA256 = {
  "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
  "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
ENDOFTEXT = "<|endoftext|>"
EOS_ID = 50256
VOCAB_SIZE = 50257
# GPT-2's split pattern, in tiktoken's faster equivalent form (tiktoken_ext.openai_public).
SPLIT_PATTERN = (
  r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)


def check_file(path: str, expected_sha256: str) -> None:
  """Refuse a missing file or one whose sha256 is not the expected one."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GPT-2 BPE file missing: {path} (expected sha256 {expected_sha256})")
  with open(path, "rb") as f:
    actual = hashlib.sha256(f.read()).hexdigest()
  if actual != expected_sha256:
    raise ValueError(
      f"GPT-2 BPE file {path} has sha256 {actual}; expected {expected_sha256} "
      "(the file is altered or truncated; restore it from the package)"
    )


class GPT2Tokenizer:
  """GPT-2 byte-level BPE: 50257 ids, <|endoftext|> = 50256 is the EOS."""

  name = "gpt2"
  # The files are checked against FILE_SHA256 at load: their digests define the tokenizer.
  sha256 = hashlib.sha256("".join(sorted(FILE_SHA256.values())).encode()).hexdigest()

  def __init__(self, data_dir: str = DATA_DIR):
    import tiktoken
    from tiktoken import load as tiktoken_load

    for name, sha in FILE_SHA256.items():
      check_file(os.path.join(data_dir, name), sha)
    ranks = tiktoken_load.data_gym_to_mergeable_bpe_ranks(
      vocab_bpe_file=os.path.join(data_dir, "vocab.bpe"),
      encoder_json_file=os.path.join(data_dir, "encoder.json"),
      vocab_bpe_hash=FILE_SHA256["vocab.bpe"],
      encoder_json_hash=FILE_SHA256["encoder.json"],
    )
    self._enc = tiktoken.Encoding(
      name="gpt2",
      pat_str=SPLIT_PATTERN,
      mergeable_ranks=ranks,
      special_tokens={ENDOFTEXT: EOS_ID},
      explicit_n_vocab=VOCAB_SIZE,
    )
    self.data_dir = data_dir
    self.vocab_size: int = self._enc.n_vocab
    self.eos_id: int = self._enc.eot_token

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, with no EOS added; "<|endoftext|>" in the text is ordinary text."""
    return self._enc.encode_ordinary(text)

  def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
    """Token ids of several texts at once; num_threads=1 encodes in this thread (a plain loop
    is faster than tiktoken's batch call with one thread)."""
    if num_threads == 1:
      return [self._enc.encode_ordinary(t) for t in texts]
    return self._enc.encode_ordinary_batch(
      texts, **({"num_threads": num_threads} if num_threads else {})
    )

  def decode(self, ids: Sequence[int] | Any) -> str:
    """The text of `ids` (a list or a 1-D integer array)."""
    return self._enc.decode([int(i) for i in ids])

  def token_bytes(self, token_id: int) -> bytes:
    """The token's bytes (byte-level BPE: a token may hold part of a character)."""
    return self._enc.decode_single_token_bytes(int(token_id))

  def __reduce__(self):  # worker processes rebuild it from the files
    return GPT2Tokenizer, (self.data_dir,)
