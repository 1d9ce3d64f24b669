"""`ao-mdm export`: a training run's EMA (or raw) params alone, with its config and tokenizer."""

from absl import flags

from ao_mdm.checkpoint import layout
from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.storage import paths

SUMMARY = "write the EMA params alone: --checkpoint=DIR --out=DIR [--weights=ema|params]"
# Old flag names, refused with a line naming the new one: --checkpoint, as every command that
# reads a run names it.
RENAMED_FLAGS = {"workdir": "checkpoint"}


def define(fv: flags.FlagValues) -> None:
  flags_lib.checkpoint(fv)
  flags_lib.out(fv, "Directory of the export (new or empty).")
  flags_lib.weights(fv, help_text="Which params: ema | params.")
  flags_lib.storage_timeout(fv)
  flags_lib.compile_cache(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "checkpoint", "out")
  layout.check_checkpoint(v["checkpoint"])
  paths.new_output_dir(v["out"])


def run(v: dict, given: set) -> None:
  del given
  flags_lib.enable_compile_cache(v["compile_cache"])
  from ao_mdm.checkpoint import checkpoints

  print(checkpoints.export(v["checkpoint"], v["out"], v["weights"]))
