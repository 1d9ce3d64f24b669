"""`ao-mdm info`: the parameter count and training FLOPs per token of a config's model."""

from absl import flags

from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib

SUMMARY = (
  "parameter count, training FLOPs per token (6N plus attention) and clu's parameter "
  "table of a config: --config=..."
)


def define(fv: flags.FlagValues) -> None:
  flags_lib.config(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "config")


def run(v: dict, given: set) -> None:
  del given
  from ao_mdm import model

  print(model.describe(v["config"].model))
