"""GPT-2 in Flax (the Hugging Face architecture; interop/hf_gpt2.py imports its weights), to
score samples by generative perplexity. Names carry shapes in the letters of docs/design.md ("Shape
letters"): B batch, T tokens, D width, F MLP width, H heads, K head dim, V vocab, 3 for q, k, v.
"""

import dataclasses
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from ao_mdm.storage import fs, gcs

CONFIG_FILE = "gpt2_config.json"
PARAMS_DIR = "params"


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """The hyperparameters of a GPT-2, as `gpt2_config.json` stores them."""

  n_layer: int
  n_head: int
  n_embd: int
  n_positions: int
  vocab_size: int
  layer_norm_epsilon: float

  @classmethod
  def from_dict(cls, d: dict, source: str) -> "GPT2Config":
    """Read the fields from a JSON dict, naming `source` in the error if some are missing."""
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in d]
    if missing:
      raise ValueError(f"{source}: missing GPT-2 config key(s) {', '.join(missing)}")
    cfg = cls(
      **{n: int(d[n]) for n in names[:-1]}, layer_norm_epsilon=float(d["layer_norm_epsilon"])
    )
    if min(cfg.n_layer, cfg.n_head, cfg.n_positions, cfg.vocab_size) < 1 or cfg.n_embd % cfg.n_head:
      raise ValueError(f"{source}: invalid GPT-2 config {cfg}")
    return cfg


def _layer_norm(cfg: GPT2Config, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, use_fast_variance=False, name=name)


class Block(nn.Module):
  """One pre-LayerNorm block: causal self-attention, then a GELU (tanh) MLP, both residual."""

  cfg: GPT2Config

  @nn.compact
  def __call__(self, x_BTD: jax.Array, _: Any) -> tuple[jax.Array, None]:
    b, t, d = x_BTD.shape
    h = self.cfg.n_head
    qkv = nn.Dense(3 * d, name="c_attn")(_layer_norm(self.cfg, "ln_1")(x_BTD))
    qkv_BT3HK = qkv.reshape(b, t, 3, h, d // h)  # the HF layout: q, k, v, each head-major
    q_BTHK, k_BTHK, v_BTHK = qkv_BT3HK[:, :, 0], qkv_BT3HK[:, :, 1], qkv_BT3HK[:, :, 2]
    a_BTHK = jax.nn.dot_product_attention(q_BTHK, k_BTHK, v_BTHK, is_causal=True)  # 1/sqrt(K)
    x_BTD = x_BTD + nn.Dense(d, name="attn_proj")(a_BTHK.reshape(b, t, d))
    y_BTF = nn.gelu(
      nn.Dense(4 * d, name="c_fc")(_layer_norm(self.cfg, "ln_2")(x_BTD)), approximate=True
    )
    return x_BTD + nn.Dense(d, name="mlp_proj")(y_BTF), None


class GPT2LM(nn.Module):
  """GPT-2: token + learned position embeddings, scanned blocks, final LayerNorm, tied head."""

  cfg: GPT2Config

  @nn.compact
  def __call__(self, ids_BT: jax.Array) -> jax.Array:
    cfg = self.cfg
    wte = nn.Embed(cfg.vocab_size, cfg.n_embd, name="wte")
    wpe_TD = nn.Embed(cfg.n_positions, cfg.n_embd, name="wpe")(jnp.arange(ids_BT.shape[1]))
    blocks = nn.scan(
      Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=cfg.n_layer
    )(cfg, name="h")
    x_BTD, _ = blocks(wte(ids_BT) + wpe_TD, None)
    return wte.attend(_layer_norm(cfg, "ln_f")(x_BTD))  # [B, T, V]


def param_shapes(cfg: GPT2Config) -> dict:
  """The params tree of GPT2LM(cfg) as ShapeDtypeStructs (layers stacked on axis 0)."""
  ids = jnp.zeros((1, 1), jnp.int32)
  return jax.eval_shape(GPT2LM(cfg).init, jax.random.key(0), ids)["params"]


def _export_config(path: str) -> dict | None:
  """The `gpt2_config.json` dict of an export at `path`, or None if there is none."""
  try:
    d = fs.read_json(fs.join(path, CONFIG_FILE))
  except (OSError, ValueError):
    return None
  return d if isinstance(d, dict) and d.get("kind") == "gpt2" else None


def is_gpt2_export(path: str) -> bool:
  """Whether `path` holds a GPT-2 export (a `gpt2_config.json` of kind "gpt2")."""
  return _export_config(path) is not None


class GPT2Scorer:
  """A GPT-2 with params on device: per-token NLL of token ids, for generative perplexity."""

  def __init__(self, cfg: GPT2Config, params: Any):
    self.cfg, self.vocab_size, self.block_size = cfg, cfg.vocab_size, cfg.n_positions
    self._params = jax.device_put(params)
    model = GPT2LM(cfg)
    self._logits = jax.jit(lambda p, ids_BT: model.apply({"params": p}, ids_BT))
    self._nll = jax.jit(
      lambda p, ids_BT: optax.softmax_cross_entropy_with_integer_labels(
        cast(jax.Array, model.apply({"params": p}, ids_BT))[:, :-1], ids_BT[:, 1:]
      )
    )

  def _check(self, ids_BT: np.ndarray) -> np.ndarray:
    """Refuse ids that the model cannot score: not [B, T] integers, too long, or off-vocab."""
    ids_BT = np.asarray(ids_BT)
    if ids_BT.ndim != 2 or ids_BT.shape[1] < 1 or not np.issubdtype(ids_BT.dtype, np.integer):
      raise ValueError(f"ids must be integers [B, T >= 1], got {ids_BT.dtype} {ids_BT.shape}")
    if ids_BT.shape[1] > self.block_size:
      raise ValueError(f"length {ids_BT.shape[1]} > GPT-2 block_size {self.block_size}")
    if ids_BT.size and (ids_BT.min() < 0 or ids_BT.max() >= self.vocab_size):
      raise ValueError(
        f"ids in [{ids_BT.min()}, {ids_BT.max()}] outside the GPT-2 vocabulary "
        f"[0, {self.vocab_size})"
      )
    return ids_BT.astype(np.int32)

  def _run(self, fn: Any, ids_BT: np.ndarray) -> np.ndarray:
    with jax.default_matmul_precision("highest"):  # float32 matmuls, no TF32 on GPUs
      return np.asarray(fn(self._params, self._check(ids_BT)))

  def logits(self, ids_BT: np.ndarray) -> np.ndarray:
    """float32 [B, T, V] next-token logits (for tests)."""
    return self._run(self._logits, ids_BT)

  def token_nll(self, ids_BT: np.ndarray) -> np.ndarray:
    """float64 [B, T-1] NLL of tokens 1..T-1 given their prefix (token 0 is not scored)."""
    return self._run(self._nll, ids_BT).astype(np.float64)


def load_gpt2_scorer(path: str) -> GPT2Scorer:
  """Load a GPT-2 export written by `ao-mdm import-gpt2` (interop/hf_gpt2.py)."""
  if not fs.isdir(path):
    raise FileNotFoundError(f"GPT-2 export {path!r} not found")
  d = _export_config(path)
  if d is None:
    raise ValueError(f"{path!r} is not a GPT-2 export (no {CONFIG_FILE} of kind 'gpt2')")
  cfg = GPT2Config.from_dict(d, fs.join(path, CONFIG_FILE))
  try:
    gcs.configure()
    with ocp.StandardCheckpointer() as ckptr:
      params = ckptr.restore(fs.join(fs.absolute(path), PARAMS_DIR), param_shapes(cfg))
  except Exception as e:
    raise ValueError(f"{path!r}: cannot restore the GPT-2 params: {e}") from e
  return GPT2Scorer(cfg, params)
