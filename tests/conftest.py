"""The suite's shared set-up: one XLA compilation cache for every process of a test run, and
session fixtures for the data tests (one TFDS dir, one small SentencePiece model)."""

import os
import shutil
import tempfile

import pytest

# libtpu (the [tpu] extra, for the ahead-of-time compile tests) must not grab the TPU backend
# in test processes; topology compiles work with the CPU platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from ao_mdm import specs
from ao_mdm.data import tokenizer as tokenizer_lib

VOCAB = 512


FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def default_compiler_flags() -> str:
  """XLA_FLAGS without FAST_COMPILE_FLAGS: for a test of float tolerances between two programs,
  which should see the numerics users get."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  return " ".join(f for f in flags if f not in FAST_COMPILE_FLAGS)


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
  # compiles 1.5-3x faster; what a program computes does not depend on either.
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
