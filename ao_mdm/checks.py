"""Checks of user-given paths and flags, cheap and free of JAX, so a bad one fails fast.

Each raises one FileNotFoundError / FileExistsError / ValueError naming the flag and the value.
"""
import json
import os

MODES = ("parallel", "speculative", "confidence")  # of `ao-mdm sample`
MODE_OPTIONS = {  # the options each mode's sampler takes
    "parallel": ("steps", "schedule", "temperature", "top_p", "top_k", "order", "top_p_rule"),
    "speculative": ("temperature", "top_p", "top_k", "top_p_rule", "draft"),
    "confidence": ("steps", "schedule", "temperature", "top_p", "top_k", "top_p_rule", "score"),
}


def new_output_dir(path: str, flag: str = "--out") -> None:
  """A directory to create: absent or empty, inside a writable directory."""
  if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
    raise FileExistsError(f"{flag} {path!r} exists and is not an empty directory; give a new path")
  _writable_parent(path, flag)


def new_output_file(path: str, flag: str = "--out") -> None:
  """A file to create: absent (nothing is overwritten), inside a writable directory."""
  output_file(path, flag)
  if os.path.lexists(path):
    raise FileExistsError(f"{flag} {path!r} exists; give a new path (nothing is overwritten)")


def output_file(path: str, flag: str = "--out") -> None:
  """A file to (over)write: not a directory, inside a writable directory."""
  if os.path.isdir(path):
    raise ValueError(f"{flag} {path!r} is a directory; give a file name")
  _writable_parent(path, flag)


def _writable_parent(path: str, flag: str) -> None:
  parent = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(parent):  # missing directories are created
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
    raise ValueError(f"{flag} {path!r} cannot be written: {parent!r} is not a writable directory")


def checkpoint(path: str, flag: str = "--checkpoint") -> None:
  """A training work dir (with checkpoints/) or an export: a directory holding step dirs."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{flag} {path!r} is not a directory; give a training --workdir or "
                            "an `ao-mdm export` / `import-torch` output")
  steps_dir = os.path.join(path, "checkpoints")
  root = steps_dir if os.path.isdir(steps_dir) else path
  if not _has_steps(root):
    raise FileNotFoundError(f"{flag} {path!r} holds no checkpoint (no step directory in "
                            f"{root!r})")


def has_checkpoints(workdir: str) -> bool:
  """Whether a training work dir already holds checkpoint steps."""
  return _has_steps(os.path.join(workdir, "checkpoints"))


def _has_steps(directory: str) -> bool:
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def text_file(path: str, flag: str) -> None:
  """An existing, readable UTF-8 file."""
  if os.path.isdir(path):
    raise ValueError(f"{flag} {path!r} is a directory; give a text file")
  if os.path.exists(path) and not os.path.isfile(path):
    raise ValueError(f"{flag} {path!r} is not a regular file (a pipe or device?); give a text file")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{flag} {path!r}: no such file")
  try:
    with open(path, encoding="utf-8") as f:
      while f.read(1 << 20):
        pass
  except UnicodeDecodeError as e:
    raise ValueError(f"{flag} {path!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
  except OSError as e:
    raise ValueError(f"{flag} {path!r} cannot be read ({e.strerror})") from None


def jsonl_records(path: str, what: str) -> list[dict]:
  """The JSON objects of a JSON-lines file (blank lines skipped); `what` names it in errors."""
  if not path or not os.path.isfile(path):
    raise FileNotFoundError(f"{what} {path!r}: no such file")
  records = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} line {number} is not JSON ({e.msg})") from None
      if not isinstance(record, dict):
        raise ValueError(f"{what} {path} line {number} is not a JSON object")
      records.append(record)
  if not records:
    raise ValueError(f"{what} {path} holds no records")
  return records


def processes(coordinator, num_processes, process_id, timeout: int) -> None:
  """The multi-process flags of `train`: a HOST:PORT coordinator with a count and an index, or
  a launcher that jax.distributed detects (SLURM, multi-host TPU VMs), or one process."""
  if timeout < 1:
    raise ValueError(f"--init_timeout={timeout} must be >= 1 (seconds)")
  if coordinator is not None:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(f"--coordinator={coordinator!r}: expected HOST:PORT, e.g. "
                       "10.0.0.2:8476 (process 0's address and a free port)")
    if num_processes is None or process_id is None:
      raise ValueError("--coordinator needs --num_processes and --process_id")
  elif num_processes is not None or process_id is not None:
    if (num_processes or 1) > 1 and not detected_launcher():
      raise ValueError(f"--num_processes={num_processes} needs --coordinator=HOST:PORT (no "
                       "SLURM job or multi-host TPU VM was detected to find one)")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} must be >= 1")
  if process_id is not None and not 0 <= process_id < (num_processes or 1):
    raise ValueError(f"--process_id={process_id} must be in [0, {num_processes or 1})")


def detected_launcher() -> str:
  """'slurm' or 'tpu' when this process was started as one of several by SLURM or on a
  multi-host TPU VM (jax.distributed finds the coordinator itself), else ''."""
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
    return "slurm"
  if "," in os.environ.get("TPU_WORKER_HOSTNAMES", "") or os.environ.get(
      "MEGASCALE_COORDINATOR_ADDRESS"):
    return "tpu"
  return ""


def mode_options(mode: str, given: set) -> None:
  """Refuses sampling options the chosen mode would ignore (e.g. --score outside confidence)."""
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}; accepted: {', '.join(MODES)}")
  for name in sorted(given - set(MODE_OPTIONS[mode])):
    modes = [m for m in MODES if name in MODE_OPTIONS[m]]
    raise ValueError(f"--{name} applies to --mode={' or --mode='.join(modes)}, not "
                     f"--mode={mode}")


_PLATFORM_DEVICES = {"tpu": ("/dev/accel*", "/dev/vfio/[0-9]*"), "cuda": ("/dev/nvidia[0-9]*",),
                     "gpu": ("/dev/nvidia[0-9]*",), "rocm": ("/dev/kfd",), "cpu": ()}


def platforms(value: str) -> None:
  """JAX_PLATFORMS names platforms this host has (checked before JAX would fail on it)."""
  import glob  # pylint: disable=g-import-not-at-top
  for name in [v.strip().lower() for v in value.split(",") if v.strip()]:
    if name not in _PLATFORM_DEVICES:
      raise ValueError(f"JAX_PLATFORMS={value!r}: unknown platform {name!r}; accepted: "
                       f"{', '.join(_PLATFORM_DEVICES)}")
    patterns = _PLATFORM_DEVICES[name]
    if patterns and not any(glob.glob(p) for p in patterns):
      raise ValueError(f"JAX_PLATFORMS={value!r}, but this host has no {name.upper()} (no "
                       f"{' or '.join(patterns)}); unset it or set JAX_PLATFORMS=cpu")


def topology(name: str) -> None:
  """A TPU topology name, GENERATION:SHAPE, checked before libtpu loads."""
  import re  # pylint: disable=g-import-not-at-top
  if not re.fullmatch(r"v\d+[a-z]*:\d+(x\d+)*", name):
    raise ValueError(f"--topology={name!r}: expected GENERATION:SHAPE, e.g. v5e:2x2, v5e:4x4, "
                     "v4:2x2x2, v5p:2x2x1, v6e:4x4")
