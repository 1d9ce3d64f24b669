"""Checks of each command's flags, cheap and free of JAX, so a bad one fails fast (the paths
through paths.py, work dirs and checkpoints through train/workdir.py).

Each raises one FileNotFoundError / FileExistsError / ValueError naming the flag and the value.
"""
import math
import os

from ao_mdm import hosts
from ao_mdm.cli.options import COMMAND_FLAGS, PATH_FLAGS
from ao_mdm.storage import fs
from ao_mdm.storage import gcs
from ao_mdm.storage import paths
from ao_mdm.decode.options import MODE_OPTION_NAMES, MODE_OPTIONS, MODES
from ao_mdm.train import workdir as workdir_lib


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
    if (num_processes or 1) > 1 and not hosts.detected_launcher():
      raise ValueError(f"--num_processes={num_processes} needs --coordinator=HOST:PORT (no "
                       "SLURM job or multi-host TPU VM was detected to find one)")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} must be >= 1")
  if process_id is not None and not 0 <= process_id < (num_processes or 1):
    raise ValueError(f"--process_id={process_id} must be in [0, {num_processes or 1})")


def mode_options(mode: str, given: set) -> None:
  """Refuses sampling options the chosen mode would ignore (e.g. --score outside confidence);
  the mode itself is one of the --mode flag's choices."""
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
    raise ValueError(f"--topology={name!r}: expected GENERATION:SHAPE, e.g. v5e:1, v5e:2x2, "
                     "v5e:4x4, v4:2x2x2, v5p:2x2x1, v6e:4x4")


def names(value: str) -> list:
  """The items of a comma-separated flag such as --datasets=sotu,wikitext2."""
  return [x.strip() for x in (value or "").split(",") if x.strip()]


def int_list(value: str, flag: str) -> list:
  """A comma-separated flag of positive integers, e.g. --ensemble=8,64."""
  items = names(value)
  if not all(x.isdigit() and int(x) > 0 for x in items):
    raise ValueError(f"{flag}={value}: expected positive integers separated by commas, e.g. 8,64")
  return [int(x) for x in items]


def _require(v: dict, *flags) -> None:
  missing = [f"--{k}" for k in flags if v.get(k) in (None, "")]
  if missing:
    raise ValueError(f"missing {', '.join(missing)}")


def _not_with(given: set, flags, why: str) -> None:
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
    from ao_mdm import interrupts  # pylint: disable=g-import-not-at-top
    with interrupts.silenced_stderr():  # tensorstore's line about the emulator's credentials
      gcs.start_tensorstore()


def command_inputs(command: str, v: dict, given: set, bench: str = "") -> None:
  """Every check of a command's flags that needs no JAX, so a bad one fails in well under a
  second: `v` maps each flag name to its value, `given` names those set on the command line."""
  foreign = sorted(given - set(COMMAND_FLAGS[command]))
  if foreign:
    name = f"{command} {bench}".strip()
    raise ValueError(f"{', '.join('--' + f for f in foreign)} not accepted by `ao-mdm {name}`; "
                     f"`ao-mdm {command} --help` lists its flags")
  if command == "train":
    _require(v, "config", "workdir")
    _data_dirs(v["config"])
    workdir_lib.check_writable(v["workdir"])
    if v["init_from"]:
      workdir_lib.check_checkpoint(v["init_from"], "--init_from")
    processes(v["coordinator"], v["num_processes"], v["process_id"], v["init_timeout"])
  elif command == "train-draft":
    _require(v, "checkpoint", "workdir")
    workdir_lib.check_checkpoint(v["checkpoint"])
    if v["weights"] not in ("ema", "params"):
      raise ValueError(f"--weights={v['weights']}; train-draft accepts ema or params")
    for name in ("steps", "batch_size"):
      if name in given and v[name] < 1:
        raise ValueError(f"--{name}={v[name]} must be >= 1")
    paths.new_output_dir(v["workdir"], "--workdir")
  elif command == "prepare":
    _require(v, "config")
    _data_dirs(v["config"])
    paths.directory(v["workdir"], "--workdir")
    if v["workers"] is not None and v["workers"] < 1:
      raise ValueError(f"--workers={v['workers']} must be >= 1")
    if not names(v["splits"]):
      raise ValueError("--splits is empty; give e.g. --splits=train,validation")
  elif command in ("info", "compile"):
    _require(v, "config", *(("topology",) if command == "compile" else ()))
    if command == "compile":
      topology(v["topology"])
      if v["program"] == "train":
        _not_with(given, ("batch_size", "steps", "schedule", "dtype"),
                  "to --program=train (the config sets its batch and compute dtype)")
      elif v["steps"] < 1 or v["batch_size"] < 1:
        raise ValueError(f"--steps={v['steps']} and --batch_size={v['batch_size']} must be >= 1")
      else:
        chips = math.prod(int(x) for x in v["topology"].split(":")[1].split("x"))
        if chips != 1:
          raise ValueError(f"--topology={v['topology']} has {chips} chips; --program=sample "
                           "compiles the sampler for one chip: give a one-chip topology such "
                           "as v5e:1 or v6e:1x1")
  elif command == "bench":
    _require(v, "config")
    if v["dtype"] and bench != "sample":
      raise ValueError(f"--dtype={v['dtype']} applies to `ao-mdm bench sample` only")
    if v["baseline"] != "none" and bench != "train":
      raise ValueError(f"--baseline={v['baseline']} applies to `ao-mdm bench train` only")
    if v["mode"] != "parallel" and bench != "sample":
      raise ValueError(f"--mode={v['mode']} applies to `ao-mdm bench sample` only")
    if v["mode"] == "speculative" and not v["checkpoint"]:
      raise ValueError("bench sample --mode=speculative needs --checkpoint (a trained model: "
                       "acceptance depends on it)")
    if v["draft_head"] and v["mode"] != "speculative":
      raise ValueError("--draft_head applies to `ao-mdm bench sample --mode=speculative`")
    if v["checkpoint"]:
      workdir_lib.check_checkpoint(v["checkpoint"])
    if v["draft_head"]:
      workdir_lib.check_checkpoint(v["draft_head"], "--draft_head", workdir_lib.DRAFT_HEAD)
    _bench_config(v["config"], bench, v["mode"])
  elif command == "tokenizer":
    _require(v, "out")
    if "/" in v["corpus"] or fs.isfile(v["corpus"]):
      paths.text_file(v["corpus"], "--corpus")
    paths.new_output_dir(v["out"])
  elif command == "export":
    _require(v, "workdir", "out")
    if v["weights"] not in ("ema", "params"):
      raise ValueError(f"--weights={v['weights']}; export accepts ema or params")
    workdir_lib.check_checkpoint(v["workdir"], "--workdir")
    paths.new_output_dir(v["out"])
  elif command == "sample":
    _sample_inputs(v, given)
  elif command == "eval":
    _eval_inputs(v, given)
  elif command == "import-torch":
    _require(v, "checkpoint", "out")
    if v["weights"] not in ("ema", "model"):
      raise ValueError(f"--weights={v['weights']}; import-torch accepts ema or model")
    if fs.isdir(v["checkpoint"]):
      raise ValueError(f"--checkpoint {v['checkpoint']!r} is a directory; give the PyTorch "
                       "ckpt.pt file of the authors' code")
    if not fs.isfile(v["checkpoint"]):
      raise FileNotFoundError(f"--checkpoint {v['checkpoint']!r}: no such file (a PyTorch "
                              "ckpt.pt of the authors' code)")
    paths.new_output_dir(v["out"])
  elif command == "import-gpt2":
    _require(v, "hf_dir", "out")
    paths.new_output_dir(v["out"])


BENCH_CONFIGS = {"sample": "configs/bench_sampler.py", "train": "configs/bench_train.py",
                 "data": "configs/bench_data.py"}


def _data_dirs(config) -> None:
  """The preparation's and the TFDS data's directories can be used (checked before any work)."""
  data = config.data
  paths.directory(data.get("prepared_dir") or None, "data.prepared_dir")
  paths.directory(data.get("tfds_dir") or os.environ.get("TFDS_DATA_DIR") or None,
                  "data.tfds_dir (or TFDS_DATA_DIR)")


def _bench_config(config, bench: str, mode: str) -> None:
  """A benchmark's config has its `bench` section, and every value in it can run (all are
  checked before the first is timed)."""
  if bench not in BENCH_CONFIGS:  # bench restart reads its run's own config
    return
  if "bench" not in config:
    raise ValueError(f"--config has no `bench` section, which `ao-mdm bench {bench}` reads; give "
                     f"{BENCH_CONFIGS[bench]} (or a copy of it)")
  if bench == "sample" and mode == "parallel":
    t = int(config.model.block_size)
    bad = [int(s) for s in config.bench.steps if not 1 <= int(s) <= t]
    if bad:
      raise ValueError(f"config.bench.steps={tuple(config.bench.steps)}: {bad} outside [1, {t}] "
                       "(model.block_size: one token per step at most)")


def _sample_inputs(v: dict, given: set) -> None:
  _require(v, "checkpoint")
  workdir_lib.check_checkpoint(v["checkpoint"])
  if v["out"]:
    paths.new_output_file(v["out"])
  if "infill_span" in given and not v["infill"]:
    raise ValueError("--infill_span applies with --infill")
  mode_options(v["mode"], given & MODE_OPTION_NAMES)
  if v["draft_head"]:
    workdir_lib.check_checkpoint(v["draft_head"], "--draft_head", workdir_lib.DRAFT_HEAD)


def _eval_inputs(v: dict, given: set) -> None:
  if v["generated"]:
    _not_with(given, ("checkpoint", "datasets", "text_file", "lambada_file", "protocol",
                      "split", "orders", "ensemble", "max_blocks"),
              "with --generated (which scores samples under --scorer)")
    _require(v, "scorer")
    paths.text_file(v["generated"], "--generated")
    if not fs.isfile(fs.join(v["scorer"], "gpt2_config.json")):  # not import-gpt2's
      workdir_lib.check_checkpoint(v["scorer"], "--scorer")
    return
  _require(v, "checkpoint")
  workdir_lib.check_checkpoint(v["checkpoint"])
  for name in ("text_file", "lambada_file"):
    if v[name]:
      paths.text_file(v[name], f"--{name}")
  if v["text_file"]:
    _not_with(given, ("datasets", "lambada_file", "split", "max_blocks"),
              "with --text_file (which evaluates every block of that one file)")
  elif not names(v["datasets"]):
    raise ValueError("--datasets is empty; give registry names, e.g. --datasets=sotu")
  elif v["lambada_file"] and "lambada" not in names(v["datasets"]):
    raise ValueError("--lambada_file applies with --datasets=...,lambada")
  custom = [f"--{k}" for k in ("split", "max_blocks", "orders") if k in given]
  if v["protocol"] == "paper" and custom:
    raise ValueError(f"{', '.join(custom)} apply with --protocol=custom; --protocol=paper fixes "
                     "the split, block count and orders per dataset")
  if v["orders"] < 1 or v["batch_size"] < 1 or v["max_blocks"] < 0:
    raise ValueError(f"--orders={v['orders']} and --batch_size={v['batch_size']} must be >= 1, "
                     f"--max_blocks={v['max_blocks']} >= 0 (0: all)")
  int_list(v["ensemble"], "--ensemble")


def quiet_environment() -> None:
  """Before JAX loads: no TensorFlow start-up lines, and no TPU start-up on a host without one.

  With libtpu installed (the [tpu] extra) JAX probes for a TPU and prints errors where there is
  none. A host with a TPU (/dev/accel*, /dev/vfio/N) or an NVIDIA GPU keeps JAX's own choice;
  `compile` targets TPU topologies through the CPU platform either way.
  """
  import glob  # pylint: disable=g-import-not-at-top
  if os.environ.get("JAX_PLATFORMS"):
    platforms(os.environ["JAX_PLATFORMS"])
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  if not any(glob.glob(p) for p in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def error_text(e: Exception) -> str:
  """The message of an error, an OSError as `what: path` rather than `[Errno N] ...`."""
  if isinstance(e, OSError) and e.strerror and e.filename and str(e).startswith("[Errno"):
    return f"{e.strerror}: {e.filename!r}" + (f" -> {e.filename2!r}" if e.filename2 else "")
  return str(e)


def loaded_config(config) -> None:
  """A --config that loaded is a ConfigDict (a file that failed to load raises here) whose keys
  are all base_config()'s (a misspelt field would be ignored and its default used); a
  benchmark's own `bench` section aside."""
  import difflib  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from ao_mdm.config import base_config  # pylint: disable=g-import-not-at-top
  config.keys()
  if not isinstance(config, ml_collections.ConfigDict):
    raise TypeError("get_config() did not return a ConfigDict")

  def check(node, base, prefix):
    for key in node.keys():
      name = f"{prefix}{key}"
      if key not in base:
        close = difflib.get_close_matches(key, list(base.keys()), n=1)
        hint = f"; did you mean {prefix}{close[0]}?" if close else (
            f"; {prefix.rstrip('.') or 'the config'} has {', '.join(sorted(base.keys()))}")
        raise ValueError(f"the --config file sets {name}, which is no config key{hint}")
      if isinstance(base[key], ml_collections.ConfigDict):
        check(node[key], base[key], f"{name}.")
  check({k: v for k, v in config.items() if k != "bench"}, base_config(), "")


def config_flag_error(argv: list, e: Exception) -> str:
  """The clearest line for a flag error: missing or broken config file, unknown config key."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  path = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None)
  if path is None:
    return str(e)
  file, _, arg = path.partition(":")  # configs/paper.py:NAME passes NAME to get_config
  if not os.path.isfile(file):
    return f"--config {file!r}: no such file (e.g. configs/tiny.py)"
  spec = importlib.util.spec_from_file_location("ao_mdm_user_config", file)
  if spec is None or not file.endswith(".py"):
    return (f"--config {file!r} is not a Python config file: give a .py file that defines "
            "get_config() returning a ConfigDict (e.g. configs/tiny.py)")
  try:  # the user's config file, loaded again to say what is wrong with it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except Exception as load_error:  # pylint: disable=broad-except
    return (f"--config {path!r} cannot be loaded ({type(load_error).__name__}: {load_error}); "
            "a config file defines get_config() returning a ConfigDict")
  if not isinstance(config, ml_collections.ConfigDict):
    return (f"--config {path!r}: get_config() returned a {type(config).__name__}, not an "
            "ml_collections.ConfigDict")
  for flag in argv[1:]:
    name = flag.lstrip("-").split("=", 1)[0]
    if not name.startswith("config."):
      continue
    node, keys = config, name.split(".")[1:]
    for i, key in enumerate(keys):
      if not hasattr(node, "keys") or key not in node:
        where = "config." + ".".join(keys[:i]) if i else "the config"
        known = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "none (a value)"
        return f"--{name}: {where} has no key {key!r}; its keys: {known}"
      node = node[key]
  return str(e)
