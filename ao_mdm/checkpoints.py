"""Orbax checkpoints: the training manager, loading params for eval/sampling, export (DESIGN 7).

The import of the authors' PyTorch checkpoints is in torch_import.py.

A training work dir holds `checkpoints/<step>/{state, data, config}`; an export holds
`<out>/0/{params, config}`. Both are read by `load_params`.
"""
import json
import os
import shutil
from typing import Any, Optional

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp

from ao_mdm import train_state

CHECKPOINT_SUBDIR = "checkpoints"


def manager(directory: str, max_to_keep: Optional[int] = 3, async_save: bool = True,
            item_names: tuple = ("state", "data", "config")) -> ocp.CheckpointManager:
  """A CheckpointManager that keeps the newest `max_to_keep` complete checkpoints."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                               item_names=item_names)


def train_manager(workdir: str, max_to_keep: int = 3) -> ocp.CheckpointManager:
  return manager(os.path.join(workdir, CHECKPOINT_SUBDIR), max_to_keep)


def save(mgr: ocp.CheckpointManager, step: int, state: Any, data_iter: Any,
         config: ml_collections.ConfigDict, force: bool = False) -> bool:
  """Save state, data-iterator position and config at `step` (asynchronously)."""
  return mgr.save(step, force=force, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=grain.checkpoint.CheckpointSave(data_iter),
      config=ocp.args.JsonSave(json.loads(config.to_json()))))


def abstract_like(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that carry the target shardings, for restoring onto a mesh."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def restore(mgr: ocp.CheckpointManager, step: int, target: Any, data_iter: Any = None) -> Any:
  """Restore the train state at `step` into `target` (and the data iterator in place)."""
  items = {"state": ocp.args.StandardRestore(target)}
  if data_iter is not None:
    items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
  return mgr.restore(step, args=ocp.args.Composite(**items)).state


def read_config(path: str, step: Optional[int] = None) -> ml_collections.ConfigDict:
  """The config stored with a checkpoint (training work dir or export)."""
  mgr = _reader(path)
  step = mgr.latest_step() if step is None else step
  saved = mgr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
  return with_defaults(saved)


def with_defaults(saved: dict) -> ml_collections.ConfigDict:
  """A saved config on top of base_config(), so keys added since it was written get defaults."""
  from ao_mdm.config import base_config  # pylint: disable=g-import-not-at-top

  def merge(base, values):
    for key, value in values.items():
      if isinstance(value, dict) and isinstance(base.get(key), ml_collections.ConfigDict):
        merge(base[key], value)
      else:
        base[key] = value
  config = base_config()
  merge(config, saved)
  return config


def _reader(path: str) -> ocp.CheckpointManager:
  """A read-only manager over a training work dir or an export directory."""
  ckpt_dir = os.path.join(path, CHECKPOINT_SUBDIR)
  directory = ckpt_dir if os.path.isdir(ckpt_dir) else path
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory at {path!r}")
  mgr = ocp.CheckpointManager(os.path.abspath(directory),
                              options=ocp.CheckpointManagerOptions(read_only=True))
  if mgr.latest_step() is None:
    raise FileNotFoundError(f"{directory!r} holds no complete checkpoint")
  return mgr


def load_params(path: str, weights: str = "ema") -> tuple[ml_collections.ConfigDict, Any]:
  """(config, params) from a training work dir (`ema` or `params`) or an export."""
  if weights not in ("ema", "params"):
    raise ValueError(f"weights={weights!r}; accepted: ema, params")
  mgr = _reader(path)
  step = mgr.latest_step()
  config = read_config(path, step)
  item_names = set(mgr.item_metadata(step).keys())
  if "params" in item_names:
    abstract = jax.eval_shape(lambda: train_state.abstract_params(config))
    return config, mgr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract))).params
  abstract = train_state.abstract_state(config)
  state = mgr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract))).state
  return config, state.ema_params if weights == "ema" else state.params


def export(path: str, out: str, weights: str = "ema") -> str:
  """Write the EMA (or raw) params alone, with the config and tokenizer, as an Orbax checkpoint."""
  check_out(out)  # before the restore, which may take minutes
  config, params = load_params(path, weights)
  return write_params_export(out, config, params, os.path.join(path, "tokenizer"))


def check_out(out: str) -> None:
  """Refuse an output path that holds something already."""
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise FileExistsError(f"--out {out!r} exists and is not an empty directory; give a new path")


def write_params_export(out: str, config: ml_collections.ConfigDict, params: Any,
                        tokenizer_dir: Optional[str] = None) -> str:
  """Write `<out>/0/{params, config}` (+ `tokenizer/`) via a temporary directory, then rename."""
  check_out(out)
  out = os.path.abspath(out)
  tmp = f"{out}.tmp{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  mgr = manager(tmp, max_to_keep=None, async_save=False, item_names=("params", "config"))
  mgr.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                      config=ocp.args.JsonSave(json.loads(config.to_json()))))
  mgr.wait_until_finished()
  mgr.close()
  if tokenizer_dir and os.path.isdir(tokenizer_dir):  # samplers and evaluators read it from here
    shutil.copytree(tokenizer_dir, os.path.join(tmp, "tokenizer"))
  os.replace(tmp, out)
  return out
