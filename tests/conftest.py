"""Session fixtures for the data tests: one TFDS dir and one small SentencePiece model."""
import os

import ml_collections
import pytest

# libtpu (the [tpu] extra, for the ahead-of-time compile tests) must not grab the TPU backend
# in test processes; topology compiles work with the CPU platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from ao_mdm.data import tokenizer as tokenizer_lib

VOCAB = 512


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """A session directory used both as the TFDS data dir and as the tokenizer cache."""
  return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def sotu_config(data_dir):
  """`config.data` for the embedded SOTU corpus."""
  return ml_collections.ConfigDict(
      {"dataset": "sotu", "text_file": "", "tokenizer": "sentencepiece", "tfds_dir": data_dir})


@pytest.fixture(scope="session")
def sp_tokenizer(sotu_config, data_dir):
  """A vocab-512 SentencePiece model trained on the SOTU train split (builds the TFDS data)."""
  return tokenizer_lib.get_tokenizer(sotu_config, VOCAB, data_dir)
