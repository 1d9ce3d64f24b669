"""Orbax checkpoints: the training manager, loading params for eval/sampling, export.

The import of the authors' PyTorch checkpoints is in interop/torch_import.py.

A training work dir holds `checkpoints/<step>/{state, ema, data, config}`: `state` is the train
state without its EMA params, which are the `ema` item, so that sampling and evaluation read
only the bytes they use (checkpoints written before the split hold the EMA inside `state` and
still load). An export holds `<out>/0/{params, config}`. Both are read by `load_params`.
"""

from collections.abc import Callable
import concurrent.futures
import contextlib
import gc
import logging
import os
import sys
import threading
import time
from typing import Any

import flax.linen as nn
import grain
import jax
import orbax.checkpoint as ocp

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.checkpoint import layout
from ao_mdm.data import tokenizer as tok_lib
from ao_mdm.runtime import quiet
from ao_mdm.storage import fs, gcs, outputs, paths
from ao_mdm.storage import lease as lease_lib

_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's name for a step being written (locally)


def abstract_params(cfg: specs.ModelSpec) -> Any:
  """The unboxed params' ShapeDtypeStructs, on this process's first device (a restore target)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  shapes = nn.unbox(jax.eval_shape(lambda k: model_lib.init_params(cfg, k), jax.random.key(0)))
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), shapes)


def manager(
  directory: str,
  max_to_keep: int | None = 3,
  async_save: bool = True,
  item_names: tuple = ("state", "ema", "data", "config"),
) -> ocp.CheckpointManager:
  """A CheckpointManager that keeps the newest `max_to_keep` complete checkpoints."""
  gcs.configure()
  options = ocp.CheckpointManagerOptions(
    max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True
  )
  directory = fs.absolute(directory)
  return probed(
    directory, lambda: ocp.CheckpointManager(directory, options=options, item_names=item_names)
  )


def train_manager(workdir: str, max_to_keep: int = 3) -> ocp.CheckpointManager:
  return manager(fs.join(workdir, layout.CHECKPOINTS), max_to_keep)


def save(
  mgr: ocp.CheckpointManager,
  step: int,
  state: Any,
  data_iter: Any,
  config: specs.Spec,
  force: bool = False,
) -> bool:
  """Save state (its EMA params as their own item), data-iterator position and config at
  `step` (asynchronously)."""
  return probed(
    str(mgr.directory),
    lambda: mgr.save(
      step,
      force=force,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state.replace(ema_params=None)),
        ema=ocp.args.StandardSave(state.ema_params),
        data=grain.checkpoint.CheckpointSave(data_iter),
        config=ocp.args.JsonSave(config.to_dict()),
      ),
    ),
  )


def restore(mgr: ocp.CheckpointManager, step: int, target: Any, data_iter: Any = None) -> Any:
  """Restore the train state at `step` into `target` (and the data iterator in place)."""
  split = "ema" in _items(mgr, step)
  items = {"state": ocp.args.StandardRestore(target.replace(ema_params=None) if split else target)}
  if split:
    items["ema"] = ocp.args.StandardRestore(target.ema_params)
  if data_iter is not None:
    items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
  restored = restore_items(mgr, step, **items)
  return restored.state.replace(ema_params=restored.ema) if split else restored.state


def restore_items(mgr: ocp.CheckpointManager, step: int, **items: Any) -> Any:
  """mgr.restore of the named items of checkpoint `step` (e.g. config=ocp.args.JsonRestore()),
  probed: a bucket that stops answering ends it."""
  return probed(str(mgr.directory), lambda: mgr.restore(step, args=ocp.args.Composite(**items)))


def save_items(mgr: ocp.CheckpointManager, step: int, **items: Any) -> None:
  """mgr.save of the named items at `step`, waited for; probed: a bucket that stops answering
  ends it."""

  def save():
    mgr.save(step, args=ocp.args.Composite(**items))
    mgr.wait_until_finished()

  probed(str(mgr.directory), save)


def _items(mgr: ocp.CheckpointManager, step: int) -> set:
  """The names in checkpoint `step`'s directory, read in one listing (`ema`: the current layout
  of a training step; `params`: an export)."""
  try:
    return set(fs.listdir(fs.join(str(mgr.directory), str(step))))
  except FileNotFoundError:
    return set()


def read_config(mgr: ocp.CheckpointManager, step: int) -> dict:
  """The config stored with checkpoint `step` (training work dir or export), as saved."""
  return restore_items(mgr, step, config=ocp.args.JsonRestore()).config


def restore_newest(
  mgr: ocp.CheckpointManager,
  load: Callable[[int, Any], Any],
  check: Callable | None = None,
  log: Callable[[str], None] = print,
  skipped: list | None = None,
):
  """(step, spec, load(step, spec)) of the newest checkpoint that reads; None if none does.

  The spec is the step's saved config on top of today's defaults (specs.with_defaults). A
  checkpoint that fails to read is skipped with one line saying which and why, and its step
  appended to `skipped`. `check(spec, saved)` (saved: the config as stored) may raise to refuse
  a readable checkpoint (e.g. of another model); that is not skipped, nor is a cancelled read or
  storage that stops answering (TimeoutError), which say nothing of the step.
  """
  for step in sorted(mgr.all_steps(), reverse=True):
    where = f"checkpoint step {step} in {mgr.directory}"
    try:
      with _quiet_failures():
        saved = read_config(mgr, step)
        config = specs.with_defaults(saved)
    except (concurrent.futures.CancelledError, TimeoutError):  # nothing said of the step
      raise
    except Exception as e:  # any corruption: skip it
      log(f"skipped {where}: its config cannot be read ({_why(mgr, step, e)})")
      if skipped is not None:
        skipped.append(step)
      continue
    if check:
      check(config, saved)
    try:
      with _quiet_failures():
        return step, config, load(step, config)
    except (concurrent.futures.CancelledError, TimeoutError):
      raise
    except Exception as e:
      log(f"skipped {where}: it cannot be restored ({_why(mgr, step, e)})")
      if skipped is not None:
        skipped.append(step)
  return None


class NotATrainingCheckpoint(ValueError):
  """A step directory of a work dir that holds no training checkpoint (e.g. an export)."""


def _why(mgr: ocp.CheckpointManager, step: int, e: Exception) -> str:
  """Plain words for why a step does not read: an item missing, or its data unreadable."""
  if isinstance(e, NotATrainingCheckpoint):
    return str(e)
  names = _items(mgr, step)
  expected = ("params", "config") if "params" in names else ("state", "ema", "data", "config")
  missing = [name for name in expected if name not in names]
  if missing:
    return f"its {' and '.join(missing)} item{'s are' if len(missing) > 1 else ' is'} missing"
  detail = _first_line(e)
  if len(detail) > 160 or "pybind11" in detail or "TensorStore(" in detail:
    detail = type(e).__name__  # a library's repr of its own objects says nothing more
  return f"its data cannot be read: truncated or corrupt ({detail})"


@contextlib.contextmanager
def _quiet_failures():
  """Orbax's reader threads and coroutines that a failed read leaves behind print tracebacks
  (an event loop closed under them, coroutines never awaited); the one line per skipped step
  says what matters, so those go nowhere while a step is read, and after."""
  hook = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  try:
    with quiet.silenced_stderr():
      yield
  finally:
    gc.collect()  # what the failed read left is collected here, still quietly
    sys.unraisablehook = hook


def set_aside(
  workdir: str,
  name: str,
  why: str,
  log: Callable[[str], None] = print,
  under: str = layout.CHECKPOINTS,
) -> str:
  """Moves <under>/<name> of the work dir (a checkpoint step by default) to
  checkpoints_set_aside/ (renamed, never deleted), so that checkpointing goes on past it;
  returns the new path."""
  relative = f"{under}/{name}" if under else name
  target = fs.join(
    workdir, layout.SET_ASIDE, f"{name}.{why}.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}"
  )
  fs.move(fs.join(workdir, relative), target)
  log(f"moved {relative} ({why}) aside to {target}")
  return target


def clean_workdir(workdir: str, log: Callable[[str], None] = print) -> None:
  """Before a run resumes (its lock held): removes unfinished checkpoint writes of killed runs
  (a temporary name locally, no commit mark on gs://) and sets aside step directories that are
  not training checkpoints (e.g. an export)."""
  directory = fs.join(workdir, layout.CHECKPOINTS)
  if not fs.isdir(directory):
    return
  for name in fs.listdir(directory):
    path = fs.join(directory, name)
    unfinished = _TMP_SUFFIX in name or (
      fs.is_gcs(path) and name.isdigit() and not fs.isfile(fs.join(path, layout.COMMITTED))
    )
    if unfinished:
      fs.rmtree(path)
      log(f"removed checkpoints/{name}, a checkpoint write that did not finish")
    elif name.isdigit() and not all(fs.isdir(fs.join(path, item)) for item in ("state", "config")):
      set_aside(workdir, name, "not-a-training-checkpoint", log)


PROBE_S = 2.0  # how often a wait on Orbax in a bucket asks whether the bucket answers


def probed(directory: str, call: Callable[[], Any]) -> Any:
  """call() (an Orbax call into `directory`: creating a manager, which lists the steps, a
  restore through tensorstore, a save, a wait for one, a listing); in a bucket, with the bucket
  asked every PROBE_S whether it answers, and one silent for --storage_timeout ends the wait
  with gcs.no_answer's error as a gcs.Stuck, which ends the process at once (Orbax's calls
  into storage have no deadline and cannot be stopped). Slow work in a bucket that answers is
  waited for."""
  if not fs.is_gcs(directory):
    return call()
  done, out = threading.Event(), {}

  def run():
    try:
      out["value"] = call()
    except BaseException as e:  # re-raised below
      out["error"] = e
    finally:
      done.set()

  threading.Thread(target=run, daemon=True, name="ao_mdm-orbax-call").start()
  while not done.wait(PROBE_S):
    try:
      gcs.check_bucket(directory)
    except TimeoutError as e:
      raise gcs.Stuck(str(e)) from e
  if "error" in out:
    raise out["error"]
  return out.get("value")


def wait_for_saves(mgr: ocp.CheckpointManager) -> None:
  """mgr.wait_until_finished(), probed: a bucket that stops answering ends it (probed)."""
  probed(str(mgr.directory), mgr.wait_until_finished)


def check_saved(mgr: ocp.CheckpointManager, step: int) -> None:
  """Refuses to go on when the checkpoint of `step` did not land (after its write finished)."""

  def landed() -> bool:
    mgr.wait_until_finished()
    mgr.reload()
    return step in mgr.all_steps()

  if not probed(str(mgr.directory), landed):
    raise OSError(
      f"the checkpoint of step {step} was not written to {mgr.directory}; "
      "training stops rather than go on without it"
    )


class WorkdirLock:
  """One training run per work dir: a lease on WORKDIR/train.lock, which names its holder
  (storage/lease.py: an flock locally, a renewed object on gs://). A local work dir this lock
  created is removed again if nothing else was written into it."""

  def __init__(self, workdir: str, log: Callable[[str], None] = print):
    self.created = not fs.exists(workdir)
    fs.makedirs(workdir)
    self.workdir, self.path = workdir, fs.join(workdir, layout.LOCK)
    try:
      self.lease = lease_lib.Lease(self.path, "ao-mdm train", log=log)
    except lease_lib.LeaseHeld as e:
      raise ValueError(
        f"--workdir {workdir} is in use by another `ao-mdm train` ({e}); one run "
        "per work dir: wait for it, stop it, or use another --workdir"
      ) from None

  @property
  def lost(self) -> bool:
    """Whether another process took the lock over (this one stalled past the lease)."""
    return self.lease.lost

  def release(self) -> None:
    """Gives the lock up; a local work dir the lock created goes too if it is otherwise empty."""
    self.lease.release()
    if (
      self.created
      and not fs.is_gcs(self.workdir)
      and fs.isdir(self.workdir)
      and not fs.listdir(self.workdir)
    ):
      fs.rmtree(self.workdir)


def _first_line(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


@contextlib.contextmanager
def _absl_errors_only() -> Any:
  """absl's Python logger (Orbax's) shows errors only inside; its level is restored after."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def reader(path: str) -> ocp.CheckpointManager:
  """A read-only manager over a training work dir or an export directory."""
  ckpt_dir = fs.join(path, layout.CHECKPOINTS)
  directory = ckpt_dir if fs.isdir(ckpt_dir) else path
  if not fs.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory at {path!r}")
  gcs.configure()
  where = fs.absolute(directory)
  options = ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0, create=False)
  with _absl_errors_only():  # Orbax's notes that a read-only manager writes nothing
    mgr = probed(where, lambda: ocp.CheckpointManager(where, options=options))
  if mgr.latest_step() is None:
    raise FileNotFoundError(f"{directory!r} holds no complete checkpoint")
  return mgr


def load_params(
  path: str,
  weights: str = "ema",
  log: Callable[[str], None] = print,
  shardings: Callable[[specs.Spec], Any] | None = None,
) -> tuple[specs.Spec, Any]:
  """(config, params) of the newest readable checkpoint of a work dir (`ema` or `params`) or
  an export. Only those params are read; `shardings(config)` places them (default: this
  process's first device)."""
  if weights not in ("ema", "params"):
    raise ValueError(f"--weights={weights}; accepted here: ema, params (model is for import-torch)")
  mgr = reader(path)
  # A training work dir holds training steps only (an export copied into it is skipped, as
  # `train` sets it aside); an export directory holds one step of params.
  is_export = not fs.isdir(fs.join(path, layout.CHECKPOINTS))
  if is_export and weights != "ema":
    raise ValueError(
      f"--weights={weights}: {path} is an export, which holds one set of params "
      "(the EMA unless made from raw params); use --weights=ema"
    )

  def check(config, saved):
    del config
    if "draft_head" in saved:
      raise ValueError(
        f"{path} is a draft head (written by `ao-mdm train-draft`), not a model: "
        f"pass it as --draft_head={path} with --mode=speculative, and the "
        "model's run or export as --checkpoint"
      )

  def load(step, config):
    items = _items(mgr, step)
    if not is_export and ("params" in items or not items & {"state", "ema"}):
      raise NotATrainingCheckpoint(
        "not a training checkpoint (an export's layout, copied into the work dir?)"
      )
    abstract = abstract_params(config.model)
    if shardings is not None:
      abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings(config)
      )
    if is_export or (weights == "ema" and "ema" in items):
      name = "params" if is_export else "ema"
      return restore_items(mgr, step, **{name: ocp.args.StandardRestore(abstract)})[name]
    field = "ema_params" if weights == "ema" else "params"  # one field of the train state
    target = {field: abstract}
    return restore_items(
      mgr,
      step,
      state=ocp.args.PyTreeRestore(
        item=target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True,
      ),
    ).state[field]

  found = restore_newest(mgr, load, check, log=log)
  if found is None:
    raise FileNotFoundError(f"no checkpoint under {path} can be read (each is listed above)")
  step, config, params = found
  what = (
    "the export's params"
    if is_export
    else ("its EMA params" if weights == "ema" else "its raw params")
  )
  log(f"loaded {path}, step {step}: {what}")
  return config, params


def load_run(path: str, weights: str = "ema", **kwargs) -> tuple:
  """(config, params, tokenizer) of a training work dir or export (kwargs: of load_params)."""
  config, params = load_params(path, weights, **kwargs)
  tokenizer = tok_lib.load_saved_tokenizer(config.data, config.model.vocab_size, path)
  tok_lib.check_vocab(tokenizer, config.model.vocab_size)
  return config, params, tokenizer


def export(path: str, out: str, weights: str = "ema") -> str:
  """Write the EMA (or raw) params alone, with the config and tokenizer, as an Orbax checkpoint."""
  paths.new_output_dir(out)  # before the restore, which may take minutes
  config, params = load_params(path, weights)
  return write_params_export(out, config.to_dict(), params, fs.join(path, layout.TOKENIZER))


def write_params_export(
  out: str, config: dict, params: Any, tokenizer_dir: str | None = None
) -> str:
  """Writes `<out>/0/{params, config}` (`config`: a JSON-able dict, e.g. Spec.to_dict()) and
  `tokenizer/`, so that nothing unfinished is ever read as an export: locally into a temporary
  directory, renamed at the end; on gs:// in place, the tokenizer first and Orbax's commit mark
  last. An error or Ctrl-C removes what was written."""
  paths.new_output_dir(out)
  with outputs.output_dir(out) as tmp:
    if tokenizer_dir and fs.isdir(tokenizer_dir):  # samplers and evaluators read it here
      fs.copytree(tokenizer_dir, fs.join(tmp, layout.TOKENIZER))
    write_params(tmp, config, params)
  return fs.absolute(out)


def write_params(out: str, config: dict, params: Any) -> None:
  """Writes `<out>/0/{params, config}`, called by every process of a run when the params are
  its global arrays: Orbax marks step 0 complete last, and a reader sees only complete steps."""
  mgr = manager(out, max_to_keep=None, async_save=False, item_names=("params", "config"))
  save_items(mgr, 0, params=ocp.args.StandardSave(params), config=ocp.args.JsonSave(config))
  mgr.close()


def has_params(path: str) -> bool:
  """Whether `path` holds a complete checkpoint or export."""
  try:
    reader(path)
  except FileNotFoundError:
    return False
  return True
