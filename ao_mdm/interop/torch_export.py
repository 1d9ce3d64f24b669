"""`ao-mdm export-torch`: a run's or an export's params in the authors' PyTorch checkpoint
layout (docs/checkpoints.md, "Weights out"), the inverse of `import-torch`.

The file is a `torch.save` dict: `model`, the state dict under their key names; `ema_model`,
{decay, num_updates, shadow_params} with the same tensors in `model.parameters()` order (their
sample_AOGPT.py reads its weights from there); `model_args`, what their AOGPTConfig takes
(n_layer, n_head, n_embd, block_size, bias, vocab_size, dropout). Or, with
`fmt="safetensors"`, the state dict alone under the same names, model_args in its metadata.
Parameters are float32 whatever the run computed in.
"""
import io
import json
from typing import Callable

import numpy as np

from ao_mdm.checkpoint import checkpoints
from ao_mdm.interop import torch_import
from ao_mdm.storage import fs
from ao_mdm.storage import paths

FORMATS = ("torch", "safetensors")


def model_args(cfg) -> dict:
  """The authors' AOGPTConfig fields of a model spec (their Linears all have biases)."""
  return dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
              block_size=cfg.block_size, bias=True, vocab_size=cfg.vocab_size, dropout=0.0)


def export_torch(checkpoint: str, out: str, weights: str = "ema", fmt: str = "torch",
                 log: Callable[[str], None] = print) -> str:
  """Writes the params of `checkpoint` (a training work dir's `weights`, or an export's) to the
  file `out` in format `fmt`; returns its path."""
  if fmt not in FORMATS:
    raise ValueError(f"--format={fmt!r}; accepted: {', '.join(FORMATS)}")
  paths.new_output_file(out)
  config, params = checkpoints.load_params(checkpoint, weights, log=log)
  cfg = config.model
  state = torch_import.to_torch_state_dict(params, cfg)
  args = model_args(cfg)
  if fmt == "safetensors":
    from safetensors.numpy import save  # pylint: disable=g-import-not-at-top
    data = save(state, metadata={"model_args": json.dumps(args), "variant": cfg.variant,
                                 "cond_dim": str(cfg.cond_dim)})
  else:
    try:
      import torch  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("export-torch needs PyTorch: pip install -e '.[torch]'") from e
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in state.items()}
    parameters = [tensors[r.key] for r in torch_import.reference_layout(cfg) if r.conv != "tied"]
    buffer = io.BytesIO()
    torch.save({"model": tensors, "model_args": args, "ema_model": {
        "decay": config.train.ema_decay, "num_updates": 0, "shadow_params": parameters}}, buffer)
    data = buffer.getvalue()
  fs.write_bytes(out, data)
  return fs.absolute(out)
