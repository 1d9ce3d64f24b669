"""`ao-mdm harness`: lm-evaluation-harness tasks on a checkpoint, scored exactly by the "ao_mdm"
model (interop/harness.py; docs/evaluation.md, "The harness"); needs the `[harness]` extra."""

import contextlib
import importlib.util
import json

from absl import flags

from ao_mdm.checkpoint import layout
from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.storage import fs, paths

SUMMARY = (
  "lm-evaluation-harness tasks, exact likelihoods: --checkpoint=DIR --tasks=a,b "
  "[--include_path=DIR --num_fewshot=N --limit=N --out=results.json]"
)
MODES = ("l2r", "parallel")  # interop/harness.py's


def define(fv: flags.FlagValues) -> None:
  flags_lib.checkpoint(fv)
  flags_lib.weights(fv)
  flags.DEFINE_list(
    "tasks",
    None,
    "Harness task names, comma-separated (`python -m ao_mdm.interop.harness ls tasks` lists them).",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "include_path",
    None,
    "A directory of your own task YAML files (e.g. a task over a local JSON-lines file).",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "num_fewshot", None, "Few-shot examples per request (default: the task's).", flag_values=fv
  )
  flags.DEFINE_float(
    "limit",
    None,
    "Documents per task (an integer), or a fraction of each task (below 1).",
    flag_values=fv,
  )
  flags_lib.batch_size(fv, 8, "Requests scored per forward.")
  flags.DEFINE_enum(
    "dtype",
    "float32",
    ["float32", "bfloat16"],
    "Compute dtype of scoring and generation.",
    flag_values=fv,
  )
  flags.DEFINE_enum(
    "mode",
    "l2r",
    list(MODES),
    "generate_until's decoder: l2r (sequential, exact) or parallel (--steps steps).",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "steps", 0, "Parallel decoding steps (0: the sampler's default).", flag_values=fv
  )
  flags.DEFINE_integer(
    "bootstrap_iters",
    1000,
    "Bootstrap resamples for the metrics' standard errors (0: none).",
    flag_values=fv,
  )
  flags_lib.seed(fv, "Seed of few-shot sampling and generation.")
  flags_lib.out(fv, "Write the harness's results JSON here (a new file).")
  flags_lib.storage_timeout(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "checkpoint", "tasks")
  layout.check_checkpoint(v["checkpoint"])
  if importlib.util.find_spec("lm_eval") is None:
    raise ValueError(
      "the harness is not installed: pip install -e '.[harness]' (its versions: constraints.txt)"
    )
  include = v["include_path"]
  if include and fs.is_gcs(include):
    raise ValueError(
      f"--include_path {include!r}: give a local directory (the harness reads "
      "its task files from this machine)"
    )
  if include and fs.isfile(include):
    raise ValueError(
      f"--include_path {include!r} is a file; give the directory of your task "
      "YAML files (every one in it is read)"
    )
  if include and not fs.isdir(include):
    raise FileNotFoundError(f"--include_path {include!r}: no such directory")
  if v["out"]:
    paths.new_output_file(v["out"])
  if v["batch_size"] < 1:
    raise ValueError(f"--batch_size={v['batch_size']} must be >= 1")
  for name in ("steps", "bootstrap_iters", "num_fewshot"):
    if v[name] is not None and v[name] < 0:
      raise ValueError(f"--{name}={v[name]} must be >= 0")
  if v["limit"] is not None and not (
    0 < v["limit"] < 1 or v["limit"] >= 1 and v["limit"].is_integer()
  ):
    raise ValueError(
      f"--limit={v['limit']}: give a number of documents (an integer >= 1) or a "
      "fraction of each task (0 < limit < 1)"
    )


def run(v: dict, given: set) -> None:
  del given
  import logging
  import os

  for name in ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS"):  # ours: a line per batch
    os.environ.setdefault(name, "1")
  import lm_eval
  from lm_eval import utils as lm_utils

  from ao_mdm.interop import harness
  from ao_mdm.runtime import quiet

  verbose = flags.FLAGS["verbosity"].present
  if not verbose:  # its INFO lines are not our output
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
  harness.quiet_workers()
  manager, tasks = harness.load_tasks(
    v["tasks"], fs.absolute(v["include_path"]) if v["include_path"] else None
  )
  model = harness.AoMdm(
    v["checkpoint"],
    weights=v["weights"],
    dtype=v["dtype"],
    batch_size=v["batch_size"],
    mode=v["mode"],
    steps=v["steps"],
    seed=v["seed"],
    log=print,
  )
  limit = v["limit"] if v["limit"] is None or v["limit"] < 1 else int(v["limit"])
  # the harness runs `git describe` at the end: "fatal: not a git repository" outside a checkout
  with contextlib.nullcontext() if verbose else quiet.silenced_stderr():
    results = lm_eval.simple_evaluate(
      model=model,
      tasks=tasks,
      num_fewshot=v["num_fewshot"],
      limit=limit,
      task_manager=manager,
      bootstrap_iters=v["bootstrap_iters"],
      random_seed=v["seed"],
      numpy_random_seed=v["seed"],
      torch_random_seed=v["seed"],
      fewshot_random_seed=v["seed"],
      log_samples=False,
    )
  print(lm_utils.make_table(results))
  summary = {
    "results": results["results"],
    "checkpoint": v["checkpoint"],
    "weights": v["weights"],
    "dtype": v["dtype"],
  }
  if v["out"]:
    fs.write_json(v["out"], json.loads(json.dumps(results, default=str)))
    print(f"wrote {v['out']}")
  print(json.dumps(summary, default=str))
