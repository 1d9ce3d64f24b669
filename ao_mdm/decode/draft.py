"""A learned draft head for speculative decoding (docs/sampling.md, "A learned draft head").

The self-drafting mode guesses a token one position too early: its drafts never see the token
just sampled. The head is one small AdaLN MLP block beside the frozen base model: from the
base's final hidden state at the newest slot (the slot that predicted the token just sampled),
the base's input embedding of that token and the next target position, it returns a hidden
state like the base's at the next slot, which the base's own final norm and head read out. Fed
its own output and its own draft, it chains for k drafts. `ao-mdm train-draft` trains it
(train/draft.py); verification stays the base's, so samples are exact whatever the head
predicts.
"""

from collections.abc import Callable
import dataclasses
import hashlib
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.storage import fs


class DraftHead(nn.Module):
  """(f_BWD, x_BWD, cond) -> the next hidden state: f the hidden state of the slot that
  predicted the token just sampled, x the base's slot-input embedding of that token, cond the
  base's conditioning for the next target (None for sigma-GPT, whose x holds the target)."""

  cfg: specs.ModelSpec  # the base model's

  @nn.compact
  def __call__(self, f_BWD, x_BWD, cond):
    d = self.cfg.n_embd
    u = jnp.concatenate(
      [
        model_lib.Norm(self.cfg, name="f_norm")(f_BWD),
        model_lib.Norm(self.cfg, name="x_norm")(x_BWD),
      ],
      axis=-1,
    )
    u_BWD = model_lib.Dense(self.cfg, (d,), (None, "embed"), name="fuse")(u)
    y = model_lib.Norm(self.cfg, name="norm")(u_BWD)
    gate = 1.0
    if cond is not None:
      shift, scale, gate = model_lib.per_slot(
        model_lib.Dense(self.cfg, (3, d), ("cond", None, "embed"), name="adaln"), cond
      )
      y = y * (1 + scale) + shift
    y = model_lib.Dense(self.cfg, (4 * d,), ("embed", "mlp"), name="mlp_in")(y)
    y = model_lib.Dense(self.cfg, (d,), ("mlp", "embed"), name="mlp_out")(nn.gelu(y, False))
    return u_BWD + gate * y


def init_head(cfg: specs.ModelSpec, key: jax.Array) -> Any:
  """Initial (unboxed) params of a head for the base model `cfg`."""
  t, d = cfg.block_size, cfg.n_embd
  cond = (jnp.zeros((t, cfg.cond_dim)), jnp.zeros((1, t), jnp.int32)) if cfg.arch.adaln else None
  x = jnp.zeros((1, t, d))
  return nn.unbox(DraftHead(cfg).init(key, x, x, cond)["params"])


def step(
  model: nn.Module,
  params: Any,
  head_params: Any,
  f_BWD: jax.Array,
  tok_BW: jax.Array,
  pos_BW: jax.Array,
  target_BW: jax.Array,
) -> tuple:
  """One draft: (the next hidden state, float32 logits of the token at `target_BW`), from the
  hidden state f_BWD of the slot that predicted token `tok_BW` at position `pos_BW`."""
  x_BWD, cond = model.apply({"params": params}, tok_BW, pos_BW, target_BW, method="embed")
  f_BWD = cast(jax.Array, DraftHead(model.cfg).apply({"params": head_params}, f_BWD, x_BWD, cond))
  return f_BWD, model.apply({"params": params}, f_BWD, cond, method="logits")


def fingerprint(params: Any) -> str:
  """A short hash of a base model's token embedding: which model a head was trained on."""
  data = np.asarray(jax.device_get(params["token_embed"]), np.float32).tobytes()
  return hashlib.sha256(data).hexdigest()[:16]


# The base model's shape keys that a head's params depend on: all but its depth and heads.
BASE_KEYS = tuple(k for k in specs.ModelSpec.SHAPE if k not in ("n_layer", "n_head"))


def save(
  workdir: str,
  cfg: specs.ModelSpec,
  head_params: Any,
  settings: Any,
  figures: dict,
  base_checkpoint: str,
  base_weights: str,
  params: Any,
) -> str:
  """Writes a head (an export-style Orbax checkpoint, under a temporary name and renamed) with
  what `load` checks: the base model's shape and a fingerprint of the base params it fit."""
  saved = {
    "model": dataclasses.asdict(cfg),
    "draft_head": {
      "settings": dataclasses.asdict(settings),
      "validation_overlap": figures,
      "base_checkpoint": fs.absolute(base_checkpoint),
      "base_weights": base_weights,
      "base_fingerprint": fingerprint(params),
    },
  }
  return checkpoints.write_params_export(workdir, saved, head_params)


def load(path: str, cfg: specs.ModelSpec, params: Any, log: Callable[[str], None] = print) -> Any:
  """The params of the head saved at `path` for the base model `cfg`;
  refused if it was made for another shape, a note if for other base params (saved by `save`)."""
  mgr = checkpoints.reader(path)
  step = mgr.latest_step()
  saved = checkpoints.read_config(mgr, step)
  if "draft_head" not in saved:
    raise ValueError(
      f"--draft_head {path!r} is not a draft head (`ao-mdm train-draft "
      "--checkpoint=RUN --workdir=DIR` makes one)"
    )
  diffs = [
    f"{k} {saved['model'].get(k)} vs {getattr(cfg, k)}"
    for k in BASE_KEYS
    if saved["model"].get(k) != getattr(cfg, k)
  ]
  if diffs:
    raise ValueError(
      f"--draft_head {path!r} was trained for another model shape (" + "; ".join(diffs) + ")"
    )
  abstract = jax.eval_shape(lambda: init_head(cfg, jax.random.key(0)))
  head_params = checkpoints.restore_items(
    mgr, step, params=ocp.args.StandardRestore(abstract)
  ).params
  if saved["draft_head"]["base_fingerprint"] != fingerprint(params):
    log(
      f"note: draft head {path} was trained on other params "
      f"({saved['draft_head']['base_checkpoint']}); samples stay exact, drafts may be "
      "accepted less often"
    )
  return head_params
