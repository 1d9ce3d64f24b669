"""The layout of a training work dir (docs/design.md, "Checkpoints"), free of JAX: the command
line checks a --workdir or --checkpoint against it before anything is loaded."""

from ao_mdm.storage import fs, paths

CHECKPOINTS = "checkpoints"  # <step>/{state, ema, data, config}; an export: <out>/0/{params, ...}
SET_ASIDE = "checkpoints_set_aside"  # unreadable or foreign step dirs, never deleted
LOCK = "train.lock"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
TOKENIZER = "tokenizer"
REFERENCE = "reference"  # GRPO: an export of the initial params, the KL penalty's reference
PROFILE = "profile"  # jax.profiler traces (train.profile_steps)
COMMITTED = "commit_success.txt"  # Orbax's mark of a finished step on gs://

DRAFT_HEAD = "the --workdir of an `ao-mdm train-draft`"


def has_checkpoints(workdir: str) -> bool:
  """Whether a training work dir already holds checkpoint steps."""
  return _has_steps(fs.join(workdir, CHECKPOINTS))


def _has_steps(directory: str) -> bool:
  return fs.isdir(directory) and any(name.isdigit() for name in fs.listdir(directory))


def newest_complete_step(workdir: str) -> int | None:
  """The newest step whose checkpoint write finished, by Orbax's rule (a step directory under its
  final name; on gs://, holding its commit mark): the step a restart resumes from if it reads."""
  directory = fs.join(workdir, CHECKPOINTS)
  if not fs.isdir(directory):
    return None
  for step in sorted((int(name) for name in fs.listdir(directory) if name.isdigit()), reverse=True):
    if not fs.is_gcs(directory) or fs.isfile(fs.join(directory, str(step), COMMITTED)):
      return step
  return None


def check_checkpoint(
  path: str,
  flag: str = "--checkpoint",
  want: str = "a training --workdir or an `ao-mdm export` / `import-torch` output",
) -> None:
  """A training work dir (with checkpoints/) or an export: a directory holding step dirs;
  `want` says what to give instead."""
  name, above = fs.basename(path.rstrip("/")), fs.parent(path.rstrip("/"))
  for inside, run in (
    (name == CHECKPOINTS, above),
    (name.isdigit() and fs.basename(above) == CHECKPOINTS, fs.parent(above)),
  ):
    if inside and fs.isdir(fs.join(run, CHECKPOINTS)):
      raise ValueError(
        f"{flag} {path!r} is inside a training work dir; give the work dir "
        f"itself, {run!r} (its newest readable step is used)"
      )
  if not fs.isdir(path):
    raise FileNotFoundError(f"{flag} {path!r} is not a directory; give {want}")
  steps_dir = fs.join(path, CHECKPOINTS)
  root = steps_dir if fs.isdir(steps_dir) else path
  if not _has_steps(root):
    raise FileNotFoundError(f"{flag} {path!r} holds no checkpoint (no step directory in {root!r})")


def check_writable(workdir: str, flag: str = "--workdir") -> None:
  """Every path a run writes in `workdir` can be written: no file where it keeps a directory,
  no directory where it writes a file, and (locally) a writable place to create them."""
  paths.directory(workdir, flag)
  for name in (CHECKPOINTS, SET_ASIDE, TENSORBOARD, TOKENIZER, PROFILE):
    if fs.isfile(fs.join(workdir, name)):
      raise ValueError(
        f"{flag} {workdir!r}: {name} is a file, where a run keeps a directory; "
        "move it away or use another work dir"
      )
  for name in (METRICS, LOCK):
    if fs.isdir(fs.join(workdir, name)):
      raise ValueError(
        f"{flag} {workdir!r}: {name} is a directory, where a run writes a "
        "file; move it away or use another work dir"
      )
  paths.output_file(fs.join(workdir, METRICS), flag)
