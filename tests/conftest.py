"""The suite's shared set-up: one XLA compilation cache for every process of a test run, and
session fixtures for the data tests (one TFDS dir, one small SentencePiece model)."""

import os
import shutil
import tempfile

import numpy as np
import pytest

# libtpu (the [tpu] extra, for the ahead-of-time compile tests) must not grab the TPU backend
# in test processes; topology compiles work with the CPU platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from ao_mdm import specs
from ao_mdm.data import tokenizer as tokenizer_lib

VOCAB = 512


def pytest_configure(config):
  """Every process of this run (the tests, the `ao-mdm` commands they start, the multi-process
  workers) shares one persistent compilation cache, so the same small program compiles once per
  run rather than once per process, and compiles without LLVM's optimisations. Set before JAX
  is imported; the cache is removed at the end."""
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    config.ao_mdm_cache = tempfile.mkdtemp(prefix="ao_mdm_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = config.ao_mdm_cache
  # The `ao-mdm` commands the tests start use it too, never the user's ~/.cache/ao_mdm/xla.
  os.environ.setdefault("AO_MDM_COMPILE_CACHE", os.environ["JAX_COMPILATION_CACHE_DIR"])
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
  # The suite's programs are tiny, so compiling is most of its time: without LLVM's
  # optimisation passes and XLA:CPU's fusion emitters (plain elemental loops instead) a test
  # compiles 1.5-3x faster; what a program computes does not depend on either. (helpers imports
  # JAX, which reads the variables above when imported: hence the import here.)
  from helpers import FAST_COMPILE_FLAGS

  for flag in FAST_COMPILE_FLAGS:
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def pytest_unconfigure(config):
  if getattr(config, "ao_mdm_cache", None):
    shutil.rmtree(config.ao_mdm_cache, ignore_errors=True)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """A session directory used both as the TFDS data dir and as the tokenizer cache."""
  return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def sotu_config(data_dir):
  """The data spec of the embedded SOTU corpus."""
  return specs.default().data.replace(dataset="sotu", tfds_dir=data_dir)


@pytest.fixture(scope="session")
def sp_tokenizer(sotu_config, data_dir):
  """A vocab-512 SentencePiece model trained on the SOTU train split (builds the TFDS data)."""
  return tokenizer_lib.get_tokenizer(sotu_config, VOCAB, data_dir)


@pytest.fixture(scope="session")
def gcs_server():
  """A real GCS server on 127.0.0.1 (fake-gcs-server, objects in memory) with the bucket
  `bucket`; this process and the commands it starts reach it through STORAGE_EMULATOR_HOST
  alone (subprocesses get it from os.environ)."""
  from ao_mdm.storage import emulator, gcs

  server = emulator.LocalServer(("bucket",))
  saved = {
    k: os.environ.get(k)
    for k in (
      gcs.EMULATOR,
      "TENSORSTORE_GCS_HTTP_URL",
      "GOOGLE_AUTH_TOKEN_FOR_TESTING",
      "FSSPEC_GCS_TOKEN",
    )
  }
  os.environ.update(server.env())
  gcs.configure()
  yield server
  server.stop()
  for key, value in saved.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value


# The fixtures below import JAX (through helpers and the library) inside their bodies: this
# module is imported before pytest_configure sets JAX's variables.


@pytest.fixture(scope="session")
def tiny_run(data_dir, tmp_path_factory):
  """A work dir of helpers.tiny_config trained in this process (checkpoints at steps 1 and 2);
  shared by the modules of a test process: read it, never write into it."""
  from ao_mdm.train import loop
  from helpers import tiny_config

  workdir = str(tmp_path_factory.mktemp("tiny") / "run")
  loop.train_and_evaluate(specs.parse(tiny_config(data_dir)), workdir)
  return workdir


@pytest.fixture(scope="session")
def sp_export(sp_tokenizer, sotu_config, tmp_path_factory):
  """A small random AO-GPT with its own SentencePiece tokenizer (sp_tokenizer, vocab 512),
  written as `ao-mdm export` writes one: params, config and tokenizer/."""
  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.config import base_config
  from helpers import random_params

  c = base_config()
  c.model.update(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=32, cond_dim=32)
  c.data.update(dataset=sotu_config.dataset, tfds_dir=sotu_config.tfds_dir)
  config = specs.parse(c)
  root = tmp_path_factory.mktemp("sp_export")
  (root / "tok").mkdir()
  (root / "tok" / "sp_sotu_512.model").write_bytes(open(sp_tokenizer.model_path, "rb").read())
  return checkpoints.write_params_export(
    str(root / "export"), config.to_dict(), random_params(config, 9), str(root / "tok")
  )


@pytest.fixture(scope="session")
def hf_model():
  """A tiny GPT2LMHeadModel in eval mode (vocab helpers.HF_VOCAB, length helpers.HF_BLOCK),
  every param random (HF inits biases to 0, norms to 1)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from helpers import HF_BLOCK, HF_VOCAB

  torch.manual_seed(0)
  config = transformers.GPT2Config(
    n_layer=2,
    n_embd=32,
    n_head=4,
    n_positions=HF_BLOCK,
    vocab_size=HF_VOCAB,
    layer_norm_epsilon=1e-3,
    bos_token_id=0,
    eos_token_id=0,
  )
  model = transformers.GPT2LMHeadModel(config).eval()
  with torch.no_grad():
    for p in model.parameters():  # the head is wte itself, so it stays tied
      p.add_(0.05 * torch.randn_like(p))
  return model


@pytest.fixture(scope="session")
def eos_export(tmp_path_factory):
  """An export of helpers.eos_model (vocab 384, T=32) with a small SentencePiece tokenizer, as
  `sample` reads one: (path, spec, params, tokenizer)."""
  import random

  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.config import base_config
  from ao_mdm.data import tokenizer as tok_lib
  from helpers import eos_model

  root = tmp_path_factory.mktemp("until_eos")
  rng = random.Random(0)
  words = "the people of this union state congress nation we must our war peace law year".split()
  texts = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(400)]
  tok_lib.train_sentencepiece(texts, 384, str(root / "tokenizer" / "sp_words_384.model"))
  c = base_config()
  c.model.update(vocab_size=384, block_size=32, n_layer=2, n_embd=32, n_head=4, cond_dim=16)
  config = specs.parse(c)
  _, params = eos_model(v=384, t=32, eos_logit=4.0)
  path = checkpoints.write_params_export(
    str(root / "export"), config.to_dict(), params, str(root / "tokenizer")
  )
  return (
    path,
    config,
    params,
    tok_lib.SentencePieceTokenizer(str(root / "tokenizer" / "sp_words_384.model")),
  )


@pytest.fixture(scope="session")
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
