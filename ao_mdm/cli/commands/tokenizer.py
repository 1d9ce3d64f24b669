"""`ao-mdm tokenizer`: train a SentencePiece tokenizer on a dataset or a local text file."""

from absl import flags

from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.storage import fs, paths

SUMMARY = (
  "train a SentencePiece BPE tokenizer (byte fallback: exact round trip): "
  "--corpus=sotu|PATH --vocab_size=N --out=DIR"
)


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string(
    "corpus", "sotu", "Dataset registry name or a local text file.", flag_values=fv
  )
  flags.DEFINE_integer(
    "vocab_size", 2048, "Tokenizer vocab size (a multiple of 128).", flag_values=fv
  )
  flags_lib.out(
    fv,
    "Directory the tokenizer model is written into (new or empty). A training run trains "
    "its own into WORKDIR/tokenizer/ and keeps it: a moved or edited corpus changes nothing "
    "for the run.",
  )
  flags_lib.storage_timeout(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "out")
  if "/" in v["corpus"] or fs.isfile(v["corpus"]):
    paths.text_file(v["corpus"], "--corpus")
  paths.new_output_dir(v["out"])


def run(v: dict, given: set) -> None:
  del given
  from ao_mdm.data import tokenizer

  print(tokenizer.train_tokenizer(v["corpus"], v["vocab_size"], v["out"]))
