"""`ao-mdm train`: train a model from a config into a work dir, resuming where it stopped."""

import os
import sys
import traceback

from absl import flags

from ao_mdm import specs
from ao_mdm.checkpoint import layout
from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.data import sudoku
from ao_mdm.runtime import hosts
from ao_mdm.storage import paths

HOLDS_SIGNALS = True  # a SIGTERM during start-up stops at the first step boundary
SUMMARY = "train a model: --config=configs/tiny.py --workdir=DIR [--config.x.y=value ...]"
FLAG_HINTS = {  # flags of other commands, and how train does the same
  "profile": "a jax.profiler trace of train steps is --config.train.profile_steps=N (from "
  "step train.profile_start_step, default 10) into WORKDIR/profile; TensorBoard "
  "opens it with the [profile] extra (tensorboard-plugin-profile)"
}


def define(fv: flags.FlagValues) -> None:
  flags_lib.config(fv)
  flags.DEFINE_string(
    "workdir",
    None,
    "Training work dir: checkpoints/ (Orbax, async, each save verified; a run resumes from "
    "the newest readable one), tokenizer/, metrics.jsonl and tensorboard/. The run prints "
    "clu's parameter table, then every train.log_every steps the loss with its L2R and "
    "any-order shares, learning rate, grad norm, tokens/s and MFU, and every "
    "train.eval_every steps the EMA params' validation loss. One run at a time (train.lock).",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "init_from",
    None,
    "Start a new run from the params of an export or import (refused when --workdir holds "
    "checkpoints: drop it to resume).",
    flag_values=fv,
  )
  flags.DEFINE_boolean(
    "start_over",
    False,
    "When no checkpoint of --workdir can be read, move "
    "them aside and train from step 0 (otherwise an error).",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "coordinator", None, "Multi-process: coordinator HOST:PORT (process 0).", flag_values=fv
  )
  flags_lib.process_index(fv)
  flags.DEFINE_integer(
    "init_timeout",
    180,
    "Multi-process: seconds to wait for the other processes and the coordinator before giving up.",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "heartbeat_timeout",
    hosts.HEARTBEAT_S,
    "Multi-process: seconds a process may "
    "go unheard before the others take it for lost and stop, each with one "
    "error line. Heartbeats go every half of it: a killed process is noticed "
    "after half to all of it, and a live one that cannot send for longer than "
    "half (stopped, swapping, a network stall) may be taken for lost.",
    flag_values=fv,
  )
  flags_lib.storage_timeout(fv)
  flags_lib.compile_cache(fv, default="WORKDIR/xla_cache")


def processes(coordinator, num_processes, process_id, timeout: int, heartbeat: int) -> None:
  """The multi-process flags: a HOST:PORT coordinator with a count and an index, or a launcher
  that jax.distributed detects (SLURM, multi-host TPU VMs), or one process."""
  if timeout < 1:
    raise ValueError(f"--init_timeout={timeout} must be >= 1 (seconds)")
  if heartbeat < 1:
    raise ValueError(f"--heartbeat_timeout={heartbeat} must be >= 1 (seconds)")
  if coordinator is not None:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(
        f"--coordinator={coordinator!r}: expected HOST:PORT, e.g. "
        "10.0.0.2:8476 (process 0's address and a free port)"
      )
    if num_processes is None or process_id is None:
      raise ValueError("--coordinator needs --num_processes and --process_id")
  elif num_processes is not None or process_id is not None:
    if (num_processes or 1) > 1 and not hosts.detected_launcher():
      raise ValueError(
        f"--num_processes={num_processes} needs --coordinator=HOST:PORT (no "
        "SLURM job or multi-host TPU VM was detected to find one)"
      )
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} must be >= 1")
  if process_id is not None and not 0 <= process_id < (num_processes or 1):
    raise ValueError(f"--process_id={process_id} must be in [0, {num_processes or 1})")


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "config", "workdir")
  if v["config"].train.wandb_project:
    checks.extra_installed(
      "wandb", "wandb", f"config.train.wandb_project={v['config'].train.wandb_project!r}"
    )
  checks.data_dirs(v["config"].data)
  if sudoku.NAME in (v["config"].data.dataset, v["config"].data.tokenizer):
    sudoku.check_run(v["config"])
  layout.check_writable(v["workdir"])
  if v["init_from"]:
    layout.check_checkpoint(v["init_from"], "--init_from")
  processes(
    v["coordinator"], v["num_processes"], v["process_id"], v["init_timeout"], v["heartbeat_timeout"]
  )
  post_training(v["config"])


def post_training(config: specs.Spec) -> None:
  """Every pair of a data.pairs file and the GRPO reward function, checked before anything is
  written or loaded (a bad line or reward name fails in seconds, the work dir untouched)."""
  from ao_mdm.data import pairs

  source = config.data.pairs
  if source and source.partition(":")[0] not in pairs.GENERATED:
    paths.text_file(source, "config.data.pairs")
    pairs.read_pairs(source)
  if config.grpo.reward:
    from ao_mdm.train import grpo  # imports JAX (seconds), not the model

    grpo.load_reward(config.grpo.reward)


def run(v: dict, given: set) -> None:
  del given
  flags_lib.enable_compile_cache(v["compile_cache"], v["workdir"])
  from ao_mdm.runtime import interrupts
  from ao_mdm.train import cluster, loop

  cluster.join(
    v["coordinator"], v["num_processes"], v["process_id"], v["init_timeout"], v["heartbeat_timeout"]
  )  # Ctrl-C while joining ends the process at once
  stop = interrupts.StopRequest()  # a SIGTERM held since start-up, or any signal from now on
  try:
    result = loop.train_and_evaluate(
      v["config"], v["workdir"], v["init_from"], v["start_over"], stop=stop
    )
  except Exception as e:
    if not cluster.multi_process():
      raise
    if os.environ.get("AO_MDM_TRACEBACK"):
      traceback.print_exc()
    message = " ".join(checks.error_text(e).split())
    cluster.fail(e, lambda: print(f"error: {message}", file=sys.stderr, flush=True))
  cluster.finish(result.get("exit_code", 0))
