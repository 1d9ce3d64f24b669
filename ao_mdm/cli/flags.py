"""Flags that several commands define, each command with its own help text; free of JAX.

A command module defines its flags on the FlagValues it is given (`define(fv)`), so that its
`--help` lists only its own flags and each flag means one thing there.
"""

from absl import flags
from ml_collections import config_flags

from ao_mdm.specs import DTYPES

# Flags that name a path: each may be local or gs://BUCKET/..., with ~ expanded
# (storage/paths.py checks their form before anything else).
PATH_FLAGS = (
  "workdir",
  "out",
  "checkpoint",
  "init_from",
  "draft_head",
  "text_file",
  "lambada_file",
  "generated",
  "scorer",
  "hf_dir",
  "compile_cache",
  "profile",
)


def config(fv: flags.FlagValues) -> None:
  config_flags.DEFINE_config_file(
    "config", None, "ml_collections config file.", lock_config=True, flag_values=fv
  )


def storage_timeout(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer(
    "storage_timeout",
    60,
    "Seconds a Cloud Storage (gs://) call may retry "
    "before the command fails with one error line (an unreachable server, a "
    "network outage); also AO_MDM_STORAGE_TIMEOUT.",
    flag_values=fv,
  )


def compile_cache(
  fv: flags.FlagValues, default: str = "$XDG_CACHE_HOME/ao_mdm/xla (~/.cache/ao_mdm/xla)"
) -> None:
  flags.DEFINE_string(
    "compile_cache",
    None,
    "Where compiled programs are kept for the next run "
    "(a directory or gs:// path; `off`: nowhere); default: "
    f"{default}; also AO_MDM_COMPILE_CACHE, else JAX_COMPILATION_CACHE_DIR. "
    "Remove the directory to clear it.",
    flag_values=fv,
  )


def checkpoint(
  fv: flags.FlagValues,
  help_text: str = "A training work dir or an export (its newest readable step).",
) -> None:
  flags.DEFINE_string("checkpoint", None, help_text, flag_values=fv)


def weights(
  fv: flags.FlagValues,
  choices: tuple = ("ema", "params"),
  help_text: str = "Which params of a training work dir: ema | params (an export "
  "holds one set: ema).",
) -> None:
  flags.DEFINE_enum("weights", choices[0], list(choices), help_text, flag_values=fv)


def out(fv: flags.FlagValues, help_text: str) -> None:
  flags.DEFINE_string("out", None, help_text, flag_values=fv)


def seed(fv: flags.FlagValues, help_text: str = "Random seed.") -> None:
  flags.DEFINE_integer("seed", 0, help_text, flag_values=fv)


def batch_size(fv: flags.FlagValues, default: int, help_text: str) -> None:
  flags.DEFINE_integer("batch_size", default, help_text, lower_bound=1, flag_values=fv)


def dtype(fv: flags.FlagValues, help_text: str) -> None:
  flags.DEFINE_enum("dtype", None, list(DTYPES), help_text, flag_values=fv)


def process_index(fv: flags.FlagValues) -> None:
  """--num_processes and --process_id: which of several processes this one is."""
  flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.", flag_values=fv)
  flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.", flag_values=fv)


def profile(fv: flags.FlagValues, what: str) -> None:
  flags.DEFINE_string(
    "profile",
    None,
    f"A directory (or gs:// path) for a jax.profiler trace of "
    f"{what}; TensorBoard's profile plugin or XProf opens it.",
    flag_values=fv,
  )


def profiled(directory: str | None):
  """A jax.profiler trace into `directory` around the block (ao_mdm.profiler), or nothing."""
  import contextlib

  if not directory:
    return contextlib.nullcontext()
  from ao_mdm import profiler

  return profiler.trace(directory, lambda line: print(line, flush=True))


def enable_compile_cache(flag: str | None, workdir: str | None = None) -> None:
  """Turns on the persistent compilation cache where --compile_cache (or its default) says."""
  from ao_mdm.storage import compile_cache as cache_lib

  cache_lib.enable(cache_lib.where(flag, workdir))
