"""`ao-mdm import-gpt2`: a local Hugging Face GPT-2 directory (safetensors, or a PyTorch .bin
read with torch's weights-only loader) converted into the export that eval/gpt2_scorer.py
scores with: the paper's generative-perplexity scorer (GPT-2 Large)."""

import dataclasses
import io
import pickle
import warnings

import flax
import numpy as np
import orbax.checkpoint as ocp

from ao_mdm.eval import gpt2_scorer
from ao_mdm.storage import fs, gcs, outputs, paths

# Hugging Face options that change the architecture, with the HF default, the only value accepted.
HF_FIXED = {
  "activation_function": "gelu_new",
  "n_inner": None,
  "scale_attn_weights": True,
  "scale_attn_by_inverse_layer_idx": False,
}
# Our flat param path -> the HF key (without "transformer."); "{}" is the layer index.
HF_NAMES = {
  "wte/embedding": "wte.weight",
  "wpe/embedding": "wpe.weight",
  "ln_f/scale": "ln_f.weight",
  "ln_f/bias": "ln_f.bias",
  "h/ln_1/scale": "h.{}.ln_1.weight",
  "h/ln_1/bias": "h.{}.ln_1.bias",
  "h/c_attn/kernel": "h.{}.attn.c_attn.weight",
  "h/c_attn/bias": "h.{}.attn.c_attn.bias",
  "h/attn_proj/kernel": "h.{}.attn.c_proj.weight",
  "h/attn_proj/bias": "h.{}.attn.c_proj.bias",
  "h/ln_2/scale": "h.{}.ln_2.weight",
  "h/ln_2/bias": "h.{}.ln_2.bias",
  "h/c_fc/kernel": "h.{}.mlp.c_fc.weight",
  "h/c_fc/bias": "h.{}.mlp.c_fc.bias",
  "h/mlp_proj/kernel": "h.{}.mlp.c_proj.weight",
  "h/mlp_proj/bias": "h.{}.mlp.c_proj.bias",
}


def _read_hf_weights(hf_dir: str) -> dict:
  """The state dict of `model.safetensors` or else `pytorch_model.bin`, as float32 numpy; a file
  that does not read (truncated, damaged, or a pickle that would run code) is a ValueError
  naming it."""
  st, pt = fs.join(hf_dir, "model.safetensors"), fs.join(hf_dir, "pytorch_model.bin")
  if fs.isfile(st):
    from safetensors.numpy import load

    try:
      sd = load(fs.read_bytes(st))
    except Exception as e:  # SafetensorError and its kin
      raise ValueError(f"{st}: not a readable safetensors file ({_first_line(e)})") from e
  elif fs.isfile(pt):
    try:
      import torch
    except ImportError as e:
      raise ImportError(
        f"{pt} needs PyTorch to read: pip install -e '.[torch]' (or convert "
        "it to model.safetensors)"
      ) from e
    try:  # weights_only: the safe unpickler, which refuses any code in the file
      with warnings.catch_warnings():  # its notes on pickle protocols
        warnings.simplefilter("ignore")
        state = torch.load(io.BytesIO(fs.read_bytes(pt)), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
      raise ValueError(
        f"{pt}: not a readable PyTorch state dict (its pickle holds more than "
        "tensors, e.g. code, which the safe loader refuses)"
      ) from e
    except Exception as e:  # a damaged zip archive
      raise ValueError(f"{pt}: not a readable PyTorch state dict ({_first_line(e)})") from e
    if not isinstance(state, dict):
      raise ValueError(f"{pt}: holds a {type(state).__name__}, not a state dict")
    sd = {k: v.float().numpy() for k, v in state.items()}
  else:
    raise FileNotFoundError(f"{hf_dir!r} has neither model.safetensors nor pytorch_model.bin")
  return {k.removeprefix("transformer."): np.asarray(v, np.float32) for k, v in sd.items()}


def _first_line(e: Exception) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _hf_params(sd: dict, cfg: gpt2_scorer.GPT2Config, source: str) -> dict:
  """Map an HF GPT-2 state dict to our params; refuse missing, misshaped or unknown keys."""
  lm_head = sd.pop("lm_head.weight", None)
  if lm_head is not None and "wte.weight" in sd and not np.array_equal(lm_head, sd["wte.weight"]):
    raise ValueError(f"{source}: lm_head.weight differs from wte.weight (untied head)")
  sd = {k: v for k, v in sd.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
  flat, missing, bad = {}, [], []
  for path, want in flax.traverse_util.flatten_dict(gpt2_scorer.param_shapes(cfg), sep="/").items():
    layered = "{}" in HF_NAMES[path]
    keys = [HF_NAMES[path].format(i) for i in range(cfg.n_layer)] if layered else [HF_NAMES[path]]
    shape = want.shape[1:] if layered else want.shape  # Conv1D weights are [in, out] like ours
    missing += [k for k in keys if k not in sd]
    bad += [
      f"{k} {sd[k].shape} (expected {shape})" for k in keys if k in sd and sd[k].shape != shape
    ]
    if all(k in sd for k in keys):
      flat[path] = np.stack([sd.pop(k) for k in keys]) if layered else sd.pop(keys[0])
  errors = [f"missing key(s) {', '.join(missing)}"] if missing else []
  errors += [f"wrong shape(s) {'; '.join(bad)}"] if bad else []
  errors += [f"unexpected key(s) {', '.join(sorted(sd))}"] if sd else []
  if errors:
    raise ValueError(f"{source}: " + "; ".join(errors))
  return flax.traverse_util.unflatten_dict(flat, sep="/")


def import_hf_gpt2(hf_dir: str, out: str) -> str:
  """Convert a local HF GPT-2 directory into `<out>/{gpt2_config.json, params}`; return `out`.
  The config, which marks an export, is written last (and locally the whole via a rename)."""
  paths.new_output_dir(out)
  config_path = fs.join(hf_dir, "config.json")
  if not fs.isfile(config_path):
    raise FileNotFoundError(f"{config_path!r} not found (expected a Hugging Face GPT-2 directory)")
  hf_config = fs.read_json(config_path)
  cfg = gpt2_scorer.GPT2Config.from_dict(hf_config, config_path)
  unsupported = {k: hf_config[k] for k, v in HF_FIXED.items() if hf_config.get(k, v) != v}
  if unsupported:
    raise ValueError(f"{config_path}: unsupported GPT-2 option(s) {unsupported}")
  params = _hf_params(_read_hf_weights(hf_dir), cfg, hf_dir)
  gcs.configure()
  with outputs.output_dir(out) as tmp:
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(fs.join(tmp, gpt2_scorer.PARAMS_DIR), params)
      ckptr.wait_until_finished()
    fs.write_json(
      fs.join(tmp, gpt2_scorer.CONFIG_FILE), {"kind": "gpt2", **dataclasses.asdict(cfg)}
    )
  return fs.absolute(out)
