"""`ao-mdm compile`: the train step or the cached sampler compiled ahead of time for a TPU
topology on this host (needs libtpu, no TPU), with per-chip memory and a roofline projection."""

import math
import re

from absl import flags

from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.decode.options import SCHEDULES

SUMMARY = (
  "ahead-of-time compile for a TPU topology, with memory and a roofline projection: "
  "--config=... --topology=v5e:4x4 [--program=train|sample --batch_size=8 "
  "--steps=64 --dtype=bfloat16]"
)
PROGRAMS = ("train", "sample")


def define(fv: flags.FlagValues) -> None:
  flags_lib.config(fv)
  flags.DEFINE_string("topology", None, "A TPU topology such as v5e:4x4.", flag_values=fv)
  flags.DEFINE_enum(
    "program",
    "train",
    list(PROGRAMS),
    "The sharded train step, or the cached sampler (one generation of "
    "--batch_size samples in --steps steps, every cache bucket).",
    flag_values=fv,
  )
  flags_lib.batch_size(fv, 4, "Samples generated at once (--program=sample).")
  flags.DEFINE_integer("steps", 64, "Decoding steps S (--program=sample).", flag_values=fv)
  flags.DEFINE_enum(
    "schedule", "linear", list(SCHEDULES), "Unmasking schedule (--program=sample).", flag_values=fv
  )
  flags_lib.dtype(
    fv,
    "The decoding dtype (--program=sample), float32 (the default) or "
    "bfloat16 (params and K/V cache).",
  )


def topology(name: str) -> None:
  """A TPU topology name, GENERATION:SHAPE, checked before libtpu loads."""
  if not re.fullmatch(r"v\d+[a-z]*:\d+(x\d+)*", name):
    raise ValueError(
      f"--topology={name!r}: expected GENERATION:SHAPE, e.g. v5e:1, v5e:2x2, "
      "v5e:4x4, v4:2x2x2, v5p:2x2x1, v6e:4x4"
    )


def check(v: dict, given: set) -> None:
  checks.require(v, "config", "topology")
  topology(v["topology"])
  if v["program"] == "train":
    checks.not_with(
      given,
      ("batch_size", "steps", "schedule", "dtype"),
      "to --program=train (the config sets its batch and compute dtype)",
    )
  elif v["steps"] < 1 or v["batch_size"] < 1:
    raise ValueError(f"--steps={v['steps']} and --batch_size={v['batch_size']} must be >= 1")
  else:
    chips = math.prod(int(x) for x in v["topology"].split(":")[1].split("x"))
    if chips != 1:
      raise ValueError(
        f"--topology={v['topology']} has {chips} chips; --program=sample "
        "compiles the sampler for one chip: give a one-chip topology such as "
        "v5e:1 or v6e:1x1"
      )


def run(v: dict, given: set) -> None:
  del given
  from ao_mdm.perf import aot

  name = v["config_file"]
  if v["program"] == "train":
    aot.compile_for_topology(v["config"], v["topology"], name=name, log=_print)
  else:
    aot.compile_sampler(
      v["config"],
      v["topology"],
      name,
      batch_size=v["batch_size"],
      steps=v["steps"],
      schedule=v["schedule"],
      dtype=v["dtype"] or "float32",
      log=_print,
    )


def _print(text: str) -> None:
  print(text, flush=True)
