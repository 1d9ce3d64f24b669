"""`ao-mdm export`: a training run's EMA (or raw) params alone, with its config and tokenizer."""
from absl import flags

from ao_mdm.checkpoint import layout
from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.storage import paths

SUMMARY = "write the EMA params alone: --workdir=DIR --out=DIR [--weights=ema|params]"


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "The training work dir to export (its newest readable "
                      "step).", flag_values=fv)
  flags_lib.out(fv, "Directory of the export (new or empty).")
  flags_lib.weights(fv, help_text="Which params: ema | params.")
  flags_lib.storage_timeout(fv)
  flags_lib.compile_cache(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "workdir", "out")
  layout.check_checkpoint(v["workdir"], "--workdir")
  paths.new_output_dir(v["out"])


def run(v: dict, given: set) -> None:
  del given
  flags_lib.enable_compile_cache(v["compile_cache"])
  from ao_mdm.checkpoint import checkpoints  # pylint: disable=g-import-not-at-top
  print(checkpoints.export(v["workdir"], v["out"], v["weights"]))
