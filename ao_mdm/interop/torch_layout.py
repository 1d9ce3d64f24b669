"""The authors' state-dict layout (scxue/AO-GPT-MDM, model.py): which reference tensor holds
which of our parameters, and how each converts. Both directions use it: `torch_import` reads the
reference layout, `torch_export` and `torch_reference` write it. docs/checkpoints.md has the map.
"""

from typing import Any, NamedTuple

from flax import traverse_util
import flax.linen as nn
import jax
import numpy as np

from ao_mdm import specs

# Where our exports name their tokenizer (the authors' loaders read only model, model_args and
# ema_model): in a torch file the entry {"name": "gpt2"} or {"name": "sentencepiece", "model":
# the .model protobuf as a uint8 tensor}; in a safetensors file's metadata, TOKENIZER (the name)
# and TOKENIZER_MODEL (the protobuf, base64). GPT-2 BPE is named only: its files ship with us.
TOKENIZER = "tokenizer"
TOKENIZER_MODEL = "tokenizer_model"


class Row(NamedTuple):
  """One reference tensor: state-dict key, torch shape, our param path, conversion, layer."""

  key: str
  shape: tuple
  path: tuple
  conv: str
  layer: int | None = None


def reference_layout(cfg: specs.ModelSpec, bias: bool = True) -> list[Row]:
  """The reference state dict of a model config, in state-dict (= parameters()) order.

  `bias` is the reference's model_args.bias: without it the attention/MLP Linears (and the
  sigma-GPT LayerNorms) have no bias; AdaLN layers and the AO-GPT head always have one.
  sigma-GPT's `lm_head.weight` is tied to `transformer.wte.weight` (conv "tied"): it is in the
  state dict but not in parameters().
  """
  d, h, v, t, c = cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size, cfg.cond_dim
  ao = cfg.variant == "ao"
  rows = [
    Row("transformer.wte.weight", (v, d), ("token_embed",), "same"),
    Row("transformer.wpe.weight", (t + 1, d), ("pos_embed",), "same"),
    Row("transformer.wtpe.weight", (t, c if ao else d), ("target_embed",), "same"),
    Row("transformer.wnonee.weight", (1, d), ("none_embed",), "row"),
  ]
  block: list[tuple[str, tuple[int, ...], str, str, bool]] = [
    ("ln_1.weight", (d,), "ln_1/scale", "same", True)
  ]
  block += [
    ("ln_1.bias", (d,), "ln_1/bias", "same", not ao and bias),
    ("attn.c_attn.weight", (3 * d, d), "qkv/kernel", "qkv", True),
    ("attn.c_attn.bias", (3 * d,), "qkv/bias", "qkv_bias", bias),
    ("attn.c_proj.weight", (d, d), "attn_out/kernel", "attn_out", True),
    ("attn.c_proj.bias", (d,), "attn_out/bias", "same", bias),
    ("attn.q_norm.weight", (d // h,), "q_norm/scale", "same", ao),
    ("attn.k_norm.weight", (d // h,), "k_norm/scale", "same", ao),
    ("ln_2.weight", (d,), "ln_2/scale", "same", True),
    ("ln_2.bias", (d,), "ln_2/bias", "same", not ao and bias),
    ("mlp.c_fc.weight", (4 * d, d), "mlp_in/kernel", "linear", True),
    ("mlp.c_fc.bias", (4 * d,), "mlp_in/bias", "same", bias),
    ("mlp.c_proj.weight", (d, 4 * d), "mlp_out/kernel", "linear", True),
    ("mlp.c_proj.bias", (d,), "mlp_out/bias", "same", bias),
    ("adaLN.1.weight", (6 * d, c), "adaln/kernel", "mod", ao),
    ("adaLN.1.bias", (6 * d,), "adaln/bias", "mod_bias", ao),
  ]
  for i in range(cfg.n_layer):
    rows += [
      Row(f"transformer.h.{i}.{key}", shape, ("blocks",) + tuple(path.split("/")), conv, i)
      for key, shape, path, conv, present in block
      if present
    ]
  if ao:
    final = "transformer.final_layer."
    rows += [
      Row(final + "ln_f.weight", (d,), ("ln_f", "scale"), "same"),
      Row(final + "adaLN_final.1.weight", (2 * d, c), ("final_adaln", "kernel"), "mod"),
      Row(final + "adaLN_final.1.bias", (2 * d,), ("final_adaln", "bias"), "mod_bias"),
      Row("lm_head.weight", (v, d), ("head", "kernel"), "linear"),
      Row("lm_head.bias", (v,), ("head", "bias"), "same"),
    ]
  else:
    rows.append(Row("transformer.ln_f.weight", (d,), ("ln_f", "scale"), "same"))
    if bias:
      rows.append(Row("transformer.ln_f.bias", (d,), ("ln_f", "bias"), "same"))
    rows.append(Row("lm_head.weight", (v, d), ("token_embed",), "tied"))
  return rows


def to_ours(row: Row, w: np.ndarray, cfg: specs.ModelSpec) -> np.ndarray:
  """A reference tensor (PyTorch Linear weights are [out, in]) in our layout."""
  d, h = cfg.n_embd, cfg.n_head
  if row.conv in ("same", "tied"):
    return w
  if row.conv == "row":  # [1, D] embedding table of the [None] token -> [D]
    return w.reshape(d)
  if row.conv == "linear":
    return w.T
  if row.conv == "qkv":  # [3D, D], rows (q|k|v, head, head dim) -> [D, 3, H, K]
    return w.reshape(3, h, d // h, d).transpose(3, 0, 1, 2)
  if row.conv == "qkv_bias":
    return w.reshape(3, h, d // h)
  if row.conv == "attn_out":  # [D, D] with input (head, head dim) -> [H, K, D]
    return w.T.reshape(h, d // h, d)
  if row.conv == "mod":  # [J D, C], J chunks along the output -> [C, J, D]
    return w.reshape(-1, d, w.shape[-1]).transpose(2, 0, 1)
  if row.conv == "mod_bias":
    return w.reshape(-1, d)
  raise ValueError(f"unknown conversion {row.conv!r} for {row.key}")


def _to_reference(row: Row, x: np.ndarray) -> np.ndarray:
  """Our array of one reference tensor (per-layer slice already taken) in the reference layout."""
  if row.conv in ("same", "tied"):
    return x
  if row.conv == "row":
    return x.reshape(row.shape)
  if row.conv == "linear":
    return x.T
  if row.conv == "qkv":
    return x.transpose(1, 2, 3, 0).reshape(row.shape)
  if row.conv == "attn_out":
    return x.reshape(-1, x.shape[-1]).T
  if row.conv == "mod":
    return x.transpose(1, 2, 0).reshape(row.shape)
  if row.conv in ("qkv_bias", "mod_bias"):
    return x.reshape(row.shape)
  raise ValueError(f"unknown conversion {row.conv!r} for {row.key}")


def to_torch_state_dict(params: Any, cfg: specs.ModelSpec) -> dict[str, np.ndarray]:
  """Our params (boxed or not) as a reference state dict (float32 numpy, reference key order)."""
  flat = traverse_util.flatten_dict(jax.device_get(nn.unbox(params)))
  out = {}
  for row in reference_layout(cfg):
    x = np.asarray(flat[row.path], np.float32)
    x = x if row.layer is None else x[row.layer]
    out[row.key] = np.ascontiguousarray(_to_reference(row, x))
  return out
