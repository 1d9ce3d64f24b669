"""`ao-mdm export-torch`: a run's or an export's params in the authors' PyTorch checkpoint
layout (docs/checkpoints.md, "Weights out"), the inverse of `import-torch`.

The file is a `torch.save` dict: `model`, the state dict under their key names; `ema_model`,
{decay, num_updates, shadow_params} with the same tensors in `model.parameters()` order (their
sample_AOGPT.py reads its weights from there); `model_args`, what their AOGPTConfig takes
(n_layer, n_head, n_embd, block_size, bias, vocab_size, dropout); `tokenizer`, the run's
(torch_layout.TOKENIZER), which their loaders never read and `import-torch` uses. Or, with
`fmt="safetensors"`, the state dict alone under the same names, model_args and the tokenizer in
its metadata. Parameters are float32 whatever the run computed in.
"""

import base64
from collections.abc import Callable
import io
import json
from typing import Any

import numpy as np

from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.data import tokenizer as tok_lib
from ao_mdm.interop import torch_layout
from ao_mdm.storage import fs, paths

FORMATS = ("torch", "safetensors")


def model_args(cfg) -> dict:
  """The authors' AOGPTConfig fields of a model spec (their Linears all have biases)."""
  return dict(
    n_layer=cfg.n_layer,
    n_head=cfg.n_head,
    n_embd=cfg.n_embd,
    block_size=cfg.block_size,
    bias=True,
    vocab_size=cfg.vocab_size,
    dropout=0.0,
  )


def _saved_tokenizer(config: specs.Spec, checkpoint: str) -> tuple[str, bytes | None]:
  """The name of the tokenizer saved with a run or export and, for SentencePiece, the bytes of
  its .model file (GPT-2 BPE is named only: its files ship with the package)."""
  if config.data.tokenizer != "sentencepiece":
    return config.data.tokenizer, None
  saved = tok_lib.load_saved_tokenizer(config.data, config.model.vocab_size, checkpoint)
  assert isinstance(saved, tok_lib.SentencePieceTokenizer)
  return saved.name, fs.read_bytes(saved.model_path)


def export_torch(
  checkpoint: str,
  out: str,
  weights: str = "ema",
  fmt: str = "torch",
  log: Callable[[str], None] = print,
) -> str:
  """Writes the params of `checkpoint` (a training work dir's `weights`, or an export's) to the
  file `out` in format `fmt`; returns its path."""
  if fmt not in FORMATS:
    raise ValueError(f"--format={fmt!r}; accepted: {', '.join(FORMATS)}")
  paths.new_output_file(out)
  config, params = checkpoints.load_params(checkpoint, weights, log=log)
  name, sp_model = _saved_tokenizer(config, checkpoint)
  cfg = config.model
  state = torch_layout.to_torch_state_dict(params, cfg)
  args = model_args(cfg)
  if fmt == "safetensors":
    from safetensors.numpy import save

    metadata = {
      "model_args": json.dumps(args),
      "variant": cfg.variant,
      "cond_dim": str(cfg.cond_dim),
      torch_layout.TOKENIZER: name,
    }
    if sp_model is not None:
      metadata[torch_layout.TOKENIZER_MODEL] = base64.b64encode(sp_model).decode("ascii")
    data = save(state, metadata=metadata)
  else:
    try:
      import torch
    except ImportError as e:
      raise ImportError("export-torch needs PyTorch: pip install -e '.[torch]'") from e
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in state.items()}
    parameters = [tensors[r.key] for r in torch_layout.reference_layout(cfg) if r.conv != "tied"]
    tokenizer: dict[str, Any] = {"name": name}
    if sp_model is not None:  # a tensor: loads with weights_only=True in any torch version
      tokenizer["model"] = torch.frombuffer(bytearray(sp_model), dtype=torch.uint8)
    buffer = io.BytesIO()
    torch.save(
      {
        "model": tensors,
        "model_args": args,
        "ema_model": {
          "decay": config.train.ema_decay,
          "num_updates": 0,
          "shadow_params": parameters,
        },
        torch_layout.TOKENIZER: tokenizer,
      },
      buffer,
    )
    data = buffer.getvalue()
  fs.write_bytes(out, data)
  return fs.absolute(out)
