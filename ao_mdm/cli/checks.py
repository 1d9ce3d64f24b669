"""Checks that several commands make of their flags, cheap and free of JAX, so a bad one fails
fast (the paths through storage/paths.py, work dirs and checkpoints through
checkpoint/layout.py); each command's own checks are in its module under commands/.

Each raises one FileNotFoundError / FileExistsError / ValueError naming the flag and the value.
"""

import importlib.util
import os

from ao_mdm.cli.flags import PATH_FLAGS
from ao_mdm.storage import fs, gcs, paths

_PLATFORM_DEVICES = {
  "tpu": ("/dev/accel*", "/dev/vfio/[0-9]*"),
  "cuda": ("/dev/nvidia[0-9]*",),
  "gpu": ("/dev/nvidia[0-9]*",),
  "rocm": ("/dev/kfd",),
  "cpu": (),
}


def platforms(value: str) -> None:
  """JAX_PLATFORMS names platforms this host has (checked before JAX would fail on it)."""
  import glob

  for name in [v.strip().lower() for v in value.split(",") if v.strip()]:
    if name not in _PLATFORM_DEVICES:
      raise ValueError(
        f"JAX_PLATFORMS={value!r}: unknown platform {name!r}; accepted: "
        f"{', '.join(_PLATFORM_DEVICES)}"
      )
    patterns = _PLATFORM_DEVICES[name]
    if patterns and not any(glob.glob(p) for p in patterns):
      raise ValueError(
        f"JAX_PLATFORMS={value!r}, but this host has no {name.upper()} (no "
        f"{' or '.join(patterns)}); unset it or set JAX_PLATFORMS=cpu"
      )


def names(value: str) -> list:
  """The items of a comma-separated flag such as --datasets=sotu,wikitext2."""
  return [x.strip() for x in (value or "").split(",") if x.strip()]


def int_list(value: str, flag: str) -> list:
  """A comma-separated flag of positive integers, e.g. --ensemble=8,64."""
  items = names(value)
  if not all(x.isdigit() and int(x) > 0 for x in items):
    raise ValueError(f"{flag}={value}: expected positive integers separated by commas, e.g. 8,64")
  return [int(x) for x in items]


def require(v: dict, *flags) -> None:
  missing = [f"--{k}" for k in flags if v.get(k) in (None, "")]
  if missing:
    raise ValueError(f"missing {', '.join(missing)}")


def not_with(given: set, flags, why: str) -> None:
  """Refuses flags that would be ignored: `why` says what makes them not apply."""
  others = [f"--{k}" for k in flags if k in given]
  if others:
    raise ValueError(f"{', '.join(others)} do not apply {why}")


def storage(v: dict, given: set) -> None:
  """Before the other checks: how long a gs:// call may retry (--storage_timeout, passed on to
  every Cloud Storage client of this process and its children), and every path flag in its
  checked form (~ expanded; a misspelt gs:// URL refused)."""
  if "storage_timeout" in given:
    if v["storage_timeout"] < 1:
      raise ValueError(f"--storage_timeout={v['storage_timeout']} must be >= 1 (seconds)")
    os.environ[gcs.TIMEOUT_ENV] = str(v["storage_timeout"])
  gcs.configure()
  for name in PATH_FLAGS:
    if v.get(name):
      v[name] = paths.check(v[name], f"--{name}")
  if os.environ.get(gcs.EMULATOR) and any(fs.is_gcs(v.get(n) or "") for n in PATH_FLAGS):
    from ao_mdm.runtime import quiet

    with quiet.silenced_stderr():  # tensorstore's line about the emulator's credentials
      gcs.start_tensorstore()


def extra_installed(module: str, extra: str, what: str) -> None:
  """Refuses `what` before anything runs when the extra that provides `module` is missing."""
  if importlib.util.find_spec(module) is None:
    raise ImportError(f"{what} needs {module}, which is not installed: pip install -e '.[{extra}]'")


def data_dirs(data) -> None:
  """The preparation's and the TFDS data's directories (of a specs.DataSpec) can be used
  (checked before any work)."""
  paths.directory(data.prepared_dir or None, "data.prepared_dir")
  paths.directory(
    data.tfds_dir or os.environ.get("TFDS_DATA_DIR") or None, "data.tfds_dir (or TFDS_DATA_DIR)"
  )


def quiet_environment() -> None:
  """Before JAX loads: a JAX_PLATFORMS given checked, then runtime/quiet.py's environment (no
  TensorFlow start-up lines, no TPU start-up on a host without one)."""
  from ao_mdm.runtime import quiet

  if os.environ.get("JAX_PLATFORMS"):
    platforms(os.environ["JAX_PLATFORMS"])
  quiet.environment()


def error_text(e: Exception) -> str:
  """The message of an error, an OSError as `what: path` rather than `[Errno N] ...`."""
  if isinstance(e, OSError) and e.strerror and e.filename and str(e).startswith("[Errno"):
    return f"{e.strerror}: {e.filename!r}" + (f" -> {e.filename2!r}" if e.filename2 else "")
  return str(e)


def loaded_config(config) -> None:
  """A --config that loaded is a ConfigDict (a file that failed to load raises here) whose keys
  are all base_config()'s (specs.check_keys)."""
  import ml_collections

  from ao_mdm import specs

  config.keys()
  if not isinstance(config, ml_collections.ConfigDict):
    raise TypeError("get_config() did not return a ConfigDict")
  specs.check_keys(config)


def config_flag_error(argv: list, e: Exception) -> str:
  """The clearest line for a flag error: missing or broken config file, unknown config key."""
  import importlib.util

  import ml_collections

  from ao_mdm import specs

  path = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None)
  if path is None:
    return str(e)
  file, _, arg = path.partition(":")  # configs/paper.py:NAME passes NAME to get_config
  if not os.path.isfile(file):
    return f"--config {file!r}: no such file (e.g. configs/tiny.py)"
  spec = importlib.util.spec_from_file_location("ao_mdm_user_config", file)
  if spec is None or spec.loader is None or not file.endswith(".py"):
    return (
      f"--config {file!r} is not a Python config file: give a .py file that defines "
      "get_config() returning a ConfigDict (e.g. configs/tiny.py)"
    )
  try:  # the user's config file, loaded again to say what is wrong with it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except Exception as load_error:
    return (
      f"--config {path!r} cannot be loaded ({type(load_error).__name__}: {load_error}); "
      "a config file defines get_config() returning a ConfigDict"
    )
  if not isinstance(config, ml_collections.ConfigDict):
    return (
      f"--config {path!r}: get_config() returned a {type(config).__name__}, not an "
      "ml_collections.ConfigDict"
    )
  for flag in argv[1:]:
    name = flag.lstrip("-").split("=", 1)[0]
    if not name.startswith("config."):
      continue
    node, keys = config, name.split(".")[1:]
    for i, key in enumerate(keys):
      if not hasattr(node, "keys") or key not in node:
        where = "config." + ".".join(keys[:i]) if i else "the config"
        known = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "none (a value)"
        near = specs.closest(key, node.keys()) if hasattr(node, "keys") else None
        hint = f"did you mean --{'.'.join(['config', *keys[:i], near])}?" if near else ""
        return f"--{name}: {where} has no key {key!r}; {hint or 'its keys: ' + known}"
      node = node[key]
  return str(e)
