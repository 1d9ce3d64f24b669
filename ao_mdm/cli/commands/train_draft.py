"""`ao-mdm train-draft`: train a draft head for `sample --mode=speculative` on a run's training
data, the model frozen (train/draft.py), and write it to a new directory."""

import dataclasses

from absl import flags

from ao_mdm.checkpoint import layout
from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.decode.options import DRAFT_TRAINING, ORDERS
from ao_mdm.storage import paths

SUMMARY = (
  "train a draft head for --mode=speculative on a run's training data, the model "
  "frozen: --checkpoint=RUN --workdir=DIR [--steps=600 --batch_size=32]"
)


def define(fv: flags.FlagValues) -> None:
  flags_lib.checkpoint(
    fv, "The run (a training work dir or an export) whose model the head drafts for."
  )
  flags.DEFINE_string(
    "workdir", None, "Where the head is written (a new or empty directory).", flag_values=fv
  )
  flags_lib.weights(fv, help_text="Which params of the run the head is fit to: ema | params.")
  flags.DEFINE_integer("steps", DRAFT_TRAINING["steps"], "Training steps.", flag_values=fv)
  flags_lib.batch_size(fv, DRAFT_TRAINING["batch_size"], "Sequences per step.")
  flags_lib.seed(fv)
  flags.DEFINE_enum(
    "order",
    None,
    list(ORDERS),
    "The order the head is trained for (default: both, half the sequences each).",
    flag_values=fv,
  )
  flags_lib.storage_timeout(fv)
  flags_lib.compile_cache(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "checkpoint", "workdir")
  layout.check_checkpoint(v["checkpoint"])
  for name in ("steps", "batch_size"):
    if v[name] < 1:
      raise ValueError(f"--{name}={v[name]} must be >= 1")
  paths.new_output_dir(v["workdir"], "--workdir")


def run(v: dict, given: set) -> None:
  del given
  flags_lib.enable_compile_cache(v["compile_cache"])
  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.decode import draft
  from ao_mdm.runtime import interrupts
  from ao_mdm.train import draft as draft_training

  settings = draft_training.Settings(
    num_steps=v["steps"], batch_size=v["batch_size"], seed=v["seed"]
  )
  if v["order"]:  # all L2R or all random; without it, the default mix
    settings = dataclasses.replace(settings, l2r_fraction=1.0 if v["order"] == "l2r" else 0.0)
  config, params, tokenizer = checkpoints.load_run(v["checkpoint"], v["weights"])
  print(f"fitting a draft head to {v['checkpoint']}'s {v['weights']} params", flush=True)
  with interrupts.on_interrupt(lambda: f"nothing was written to {v['workdir']}"):
    head_params, figures, blocks = draft_training.train_head(
      config, params, tokenizer, settings, log=_print
    )
  print(
    f"validation sum_x min(p, q), the acceptance of drafts 1..{settings.chain} at "
    f"temperature 1: {draft_training.describe(figures)} ({blocks} blocks)",
    flush=True,
  )
  written = draft.save(
    v["workdir"],
    config.model,
    head_params,
    settings,
    figures,
    v["checkpoint"],
    v["weights"],
    params,
  )
  print(f"wrote {written}")


def _print(line: str) -> None:
  print(line, flush=True)
