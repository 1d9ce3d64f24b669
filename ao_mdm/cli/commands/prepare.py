"""`ao-mdm prepare`: tokenize a config's dataset once into the token shards train and eval read."""

from absl import flags

from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.data import sudoku
from ao_mdm.storage import paths

SUMMARY = (
  "tokenize a config's dataset once into token shards that train and eval read: "
  "--config=... [--splits=train,validation --workers=N --workdir=DIR]"
)


def define(fv: flags.FlagValues) -> None:
  flags_lib.config(fv)
  flags.DEFINE_string("splits", "train,validation", "Comma-separated splits.", flag_values=fv)
  flags.DEFINE_integer("workers", None, "Worker processes (default: every core).", flag_values=fv)
  flags.DEFINE_string(
    "workdir",
    None,
    "A training work dir, whose tokenizer a SentencePiece "
    "config prepares with (trained there first if it has none).",
    flag_values=fv,
  )
  flags_lib.process_index(fv)
  flags.DEFINE_boolean(
    "verify",
    False,
    "Hash every shard of a split prepared before "
    "(otherwise its sizes and versions are checked against the manifest).",
    flag_values=fv,
  )
  flags_lib.storage_timeout(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "config")
  if v["config"].data.dataset == sudoku.NAME:
    raise ValueError(
      f"data.dataset={sudoku.NAME!r} has nothing to prepare: `ao-mdm train` draws its grids as it "
      "reads them (ao_mdm/data/sudoku.py)"
    )
  checks.data_dirs(v["config"].data)
  paths.directory(v["workdir"], "--workdir")
  if v["workers"] is not None and v["workers"] < 1:
    raise ValueError(f"--workers={v['workers']} must be >= 1")
  if not checks.names(v["splits"]):
    raise ValueError("--splits is empty; give e.g. --splits=train,validation")


def run(v: dict, given: set) -> None:
  del given
  from ao_mdm.data import prepare

  for line in prepare.prepare_splits(
    v["config"],
    checks.names(v["splits"]),
    v["workers"],
    v["workdir"],
    v["process_id"],
    v["num_processes"],
    v["verify"],
  ):
    print(line, flush=True)
