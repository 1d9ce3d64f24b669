"""Orbax checkpoints: the training manager, loading params for eval/sampling, export (DESIGN 7).

A training work dir holds `checkpoints/<step>/{state, data, config}`; an export holds
`<out>/0/{params, config}`. Both are read by `load_params`.
"""
import json
import os
from typing import Any, Optional

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp

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
  cfg = mgr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
  return ml_collections.ConfigDict(cfg)


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
  from ao_mdm import train  # local import: checkpoints must not import training at module load
  mgr = _reader(path)
  step = mgr.latest_step()
  config = read_config(path, step)
  item_names = set(mgr.item_metadata(step).keys())
  if "params" in item_names:
    abstract = jax.eval_shape(lambda: train.abstract_params(config))
    return config, mgr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract))).params
  abstract = train.abstract_state(config)
  state = mgr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract))).state
  return config, state.ema_params if weights == "ema" else state.params


def export(path: str, out: str, weights: str = "ema") -> str:
  """Write the EMA (or raw) params alone, with the config, as an Orbax checkpoint."""
  config, params = load_params(path, weights)
  if os.path.exists(out) and os.listdir(out):
    raise FileExistsError(f"--out {out!r} exists and is not empty")
  mgr = manager(out, max_to_keep=None, async_save=False, item_names=("params", "config"))
  mgr.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                      config=ocp.args.JsonSave(json.loads(config.to_json()))))
  mgr.wait_until_finished()
  return out
