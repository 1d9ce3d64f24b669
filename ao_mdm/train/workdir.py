"""The layout of a training work dir (docs/design.md, "Checkpoints"), free of JAX: the command
line checks a --workdir or --checkpoint against it before anything is loaded."""
import os

CHECKPOINTS = "checkpoints"  # <step>/{state, ema, data, config}; an export: <out>/0/{params, ...}
SET_ASIDE = "checkpoints_set_aside"  # unreadable or foreign step dirs, never deleted
LOCK = "train.lock"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
TOKENIZER = "tokenizer"

DRAFT_HEAD = "the --workdir of an `ao-mdm train-draft`"


def has_checkpoints(workdir: str) -> bool:
  """Whether a training work dir already holds checkpoint steps."""
  return _has_steps(os.path.join(workdir, CHECKPOINTS))


def _has_steps(directory: str) -> bool:
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def check_checkpoint(path: str, flag: str = "--checkpoint",
                     want: str = "a training --workdir or an `ao-mdm export` / `import-torch` "
                                 "output") -> None:
  """A training work dir (with checkpoints/) or an export: a directory holding step dirs;
  `want` says what to give instead."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{flag} {path!r} is not a directory; give {want}")
  steps_dir = os.path.join(path, CHECKPOINTS)
  root = steps_dir if os.path.isdir(steps_dir) else path
  if not _has_steps(root):
    raise FileNotFoundError(f"{flag} {path!r} holds no checkpoint (no step directory in "
                            f"{root!r})")
