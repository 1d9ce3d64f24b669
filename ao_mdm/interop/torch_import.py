"""Import of reference PyTorch checkpoints (scxue/AO-GPT-MDM, a nanoGPT fork).

A reference checkpoint is a `torch.save` dict with `model` (state dict), `ema_model`
({decay, num_updates, shadow_params}: a list in `model.parameters()` order), `model_args`,
`optimizer`, `iter_num` and `config`. `import_torch` maps it onto our parameter tree and writes
an export (`<out>/0/{params, config}`); the inverse, `torch_layout.to_torch_state_dict`, is what
`export-torch` writes.
It also takes the safetensors file of `export-torch --format=safetensors` (one set of weights,
model_args in its metadata) and the tokenizer our exports carry (torch_layout.TOKENIZER).
docs/checkpoints.md has the key mapping; docs/design.md, "Checkpoints", the formats.
"""

import base64
from collections.abc import Callable
import io
import json
import re
import tempfile
from typing import Any
import zipfile

from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.data import gpt2
from ao_mdm.data import tokenizer as tok_lib
from ao_mdm.interop import torch_layout
from ao_mdm.storage import fs, paths

TORCH_WEIGHTS = ("ema", "model")
_ORIG_MOD = "_orig_mod."
# The shape keys the authors' model_args hold; the variant and cond_dim are read off the weights.
_MODEL_ARGS = tuple(k for k in specs.ModelSpec.SHAPE if k not in ("variant", "cond_dim"))
# A causal-mask buffer the reference registers only when PyTorch lacks scaled_dot_product_attention.
_MASK_BUFFER = re.compile(r"transformer\.h\.\d+\.attn\.bias")


def _few(items: list, limit: int = 4, sep: str = ", ") -> str:
  """The first few items for an error line, then how many more."""
  more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
  return sep.join(map(str, items[:limit])) + more


def _names(keys) -> str:
  """A short, sorted listing of key names for an error line."""
  return _few(sorted(map(str, keys)))


def is_safetensors(path: str) -> bool:
  """Whether the file starts as a safetensors file does: its header's length, then '{'."""
  with fs.open_read(path) as f:
    head = f.read(9)
  return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > 1


def _load_safetensors(path: str) -> dict:
  """A safetensors export as a checkpoint dict: `model` (numpy), `model_args` and `tokenizer`
  from the metadata."""
  from safetensors.numpy import load

  data = fs.read_bytes(path)
  try:
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    state = load(data)
  except Exception as e:
    raise ValueError(
      f"{path!r} is not a safetensors file safetensors can read: "
      f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}"
    ) from None
  try:
    args = json.loads(metadata["model_args"])
    if not isinstance(args, dict):
      raise ValueError("not an object")
  except (KeyError, ValueError):
    raise ValueError(
      f"{path!r} is a safetensors file without the JSON model_args in its metadata "
      "that `ao-mdm export-torch --format=safetensors` writes; found metadata "
      f"{_names(metadata) or 'none'}"
    ) from None
  ckpt = {"model": state, "model_args": args}
  if torch_layout.TOKENIZER in metadata:
    model = metadata.get(torch_layout.TOKENIZER_MODEL)
    try:
      model = None if model is None else base64.b64decode(model, validate=True)
    except ValueError:
      raise ValueError(f"{path!r}: metadata {torch_layout.TOKENIZER_MODEL} is not base64") from None
    ckpt[torch_layout.TOKENIZER] = {"name": metadata[torch_layout.TOKENIZER], "model": model}
  return ckpt


def _load_checkpoint(path: str) -> tuple[dict, bool]:
  """(the checkpoint dict, whether it holds one set of weights: a safetensors file)."""
  if not fs.isfile(path):
    raise FileNotFoundError(f"no reference checkpoint file at {path!r}")
  if is_safetensors(path):
    return _load_safetensors(path), True
  return _load_torch_checkpoint(path), False


def _load_torch_checkpoint(path: str) -> dict:
  """The reference checkpoint dict, loaded on CPU; refuses anything else."""
  try:
    import torch
  except ImportError as e:
    raise ImportError("import-torch needs PyTorch: pip install -e '.[torch]'") from e
  # A local zip-format file is mapped (only the tensors used are read, not the optimizer
  # state); one in a bucket is read whole.
  source = io.BytesIO(fs.read_bytes(path)) if fs.is_gcs(path) else path
  try:
    # weights_only: tensors, containers and plain values only; a pickled callable (code that
    # would run on load) is refused before it runs.
    ckpt = torch.load(
      source,
      map_location="cpu",
      weights_only=True,
      mmap=not fs.is_gcs(path) and zipfile.is_zipfile(path),
    )
  except Exception as e:
    found = re.search(r"GLOBAL ([\w.]+)", str(e))
    if found:  # a pickled callable: what would have run
      raise ValueError(
        f"{path!r} holds an object of type {found[1]}, which a checkpoint of the "
        "authors' trainer does not contain; refused without running it "
        "(torch.load weights_only=True)"
      ) from None
    unpickler = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
    detail = unpickler[1] if unpickler else (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise ValueError(
      f"{path!r} is not a PyTorch checkpoint torch.load can read: {detail}"
    ) from None
  if (
    not isinstance(ckpt, dict)
    or not isinstance(ckpt.get("model"), dict)
    or not isinstance(ckpt.get("model_args"), dict)
  ):
    what = f"the keys {_names(ckpt)}" if isinstance(ckpt, dict) else type(ckpt).__name__
    raise ValueError(
      f"{path!r} is not a reference AO-GPT checkpoint: expected a dict with "
      f"'model' (state dict) and 'model_args'; found {what}"
    )
  return ckpt


def _strip_prefix(state: dict, path: str) -> dict:
  """The state dict with torch.compile's `_orig_mod.` prefixes removed."""
  out = {}
  for key, value in state.items():
    name = key[len(_ORIG_MOD) :] if key.startswith(_ORIG_MOD) else key
    if name in out:
      raise ValueError(f"{path!r}: key {name!r} appears both with and without {_ORIG_MOD!r}")
    out[name] = value
  return out


def _default_import_config(variant: str) -> specs.Spec:
  """The paper's `<variant>_small` run (ao_mdm/paper.py): the authors' recipe around the model."""
  from ao_mdm import paper

  return specs.parse(paper.paper_config(f"{variant}_small"))


def _config_from_checkpoint(
  config: specs.Spec, model_args: dict, variant: str, cond_dim: int, path: str
) -> tuple[specs.Spec, list]:
  """`config` with the model fields set from the checkpoint, and a line per field it changed."""
  missing = [k for k in _MODEL_ARGS if k not in model_args]
  if missing:
    raise ValueError(
      f"{path!r}: model_args lacks {', '.join(missing)}; found {_names(list(model_args))}"
    )
  wanted: dict[str, int | str] = {k: int(model_args[k]) for k in _MODEL_ARGS}
  wanted.update(variant=variant, cond_dim=cond_dim)
  changed = {k: v for k, v in wanted.items() if getattr(config.model, k) != v}
  source = lambda k: "keys" if k in ("variant", "cond_dim") else "model_args"
  changes = [
    f"model.{k} {getattr(config.model, k)} -> {v} from the checkpoint's {source(k)}"
    for k, v in changed.items()
  ]
  return config.replace(model=config.model.replace(**changed)), changes


def _detect_variant(state: dict, variant: str | None, path: str) -> str:
  """The variant: "ao" when AdaLN keys are present, else "sigma"; refuses a contradicting one."""
  detected = (
    "ao"
    if any(".adaLN." in k or k.startswith("transformer.final_layer.") for k in state)
    else "sigma"
  )
  if variant is not None and variant != detected:
    why = "has AdaLN keys" if detected == "ao" else "has no AdaLN keys"
    raise ValueError(f"variant={variant!r} but {path!r} {why}: it is a {detected!r} checkpoint")
  return detected


def _tensors(ckpt: dict, rows: list[torch_layout.Row], weights: str, path: str) -> dict[str, Any]:
  """key -> tensor of the chosen weights, after checking keys and shapes against `rows`."""
  state = _strip_prefix(ckpt["model"], path)
  expected = {r.key for r in rows}
  ignored = {k for k in state if _MASK_BUFFER.fullmatch(k) and getattr(state[k], "ndim", 0) == 4}
  missing = expected - set(state)
  extra = set(state) - expected - ignored
  if missing:
    raise ValueError(f"{path!r}: missing key(s) {_names(missing)}")
  if extra:
    raise ValueError(
      f"{path!r}: unexpected key(s) {_names(extra)} (not used by the "
      f"{'AO-GPT' if rows[-1].conv != 'tied' else 'sigma-GPT'} model)"
    )
  bad = [
    f"{r.key} has shape {tuple(state[r.key].shape)}, expected {r.shape}"
    for r in rows
    if tuple(state[r.key].shape) != r.shape
  ]
  if bad:
    raise ValueError(f"{path!r}: wrong shape(s): " + _few(bad, sep="; "))
  if weights == "model":
    return {r.key: state[r.key] for r in rows}
  ema = ckpt.get("ema_model")
  if not isinstance(ema, dict) or "shadow_params" not in ema:
    raise ValueError(
      f"{path!r} has no ema_model with shadow_params (the EMA weights that "
      "--weights=ema, the default, imports); use --weights=model for the raw ones"
    )
  params = [r for r in rows if r.conv != "tied"]  # parameters() lists a tied tensor once
  shadow = list(ema["shadow_params"])
  if len(shadow) != len(params):
    raise ValueError(
      f"{path!r}: ema_model.shadow_params has {len(shadow)} tensors, expected "
      f"{len(params)} (one per parameter, first {params[0].key}, last "
      f"{params[-1].key})"
    )
  bad = [
    f"{r.key} (shadow_params[{i}]) has shape {tuple(s.shape)}, expected {r.shape}"
    for i, (r, s) in enumerate(zip(params, shadow))
    if tuple(s.shape) != r.shape
  ]
  if bad:
    raise ValueError(f"{path!r}: wrong EMA shape(s): " + _few(bad, sep="; "))
  return {r.key: s for r, s in zip(params, shadow)}


def _tokenizer(ckpt: dict, given: str | None, path: str) -> tuple[str | None, bytes | None]:
  """(name, SentencePiece model bytes or None) of the tokenizer to import: `given` ("gpt2" or a
  SentencePiece .model file), else the one the checkpoint carries (torch_layout.TOKENIZER);
  (None, None) when neither names one, as in the authors' checkpoints (GPT-2 BPE)."""
  if given:
    return ("gpt2", None) if given == "gpt2" else ("sentencepiece", fs.read_bytes(given))
  entry = ckpt.get(torch_layout.TOKENIZER)
  if entry is None:
    return None, None
  name = entry.get("name") if isinstance(entry, dict) else None
  if name not in tok_lib.TOKENIZERS:
    raise ValueError(
      f"{path!r}: its {torch_layout.TOKENIZER!r} entry names no tokenizer of ours (accepted: "
      f"{', '.join(tok_lib.TOKENIZERS)}); give --tokenizer=FILE|gpt2"
    )
  model = entry.get("model")
  if name == "sentencepiece" and not isinstance(model, bytes):
    array = model.numpy() if hasattr(model, "numpy") else None  # a uint8 tensor in a torch file
    if array is None or array.dtype != np.uint8 or array.ndim != 1:
      raise ValueError(
        f"{path!r}: its SentencePiece tokenizer is not the bytes of a .model file "
        "(a 1-D uint8 tensor); give --tokenizer=FILE|gpt2"
      )
    model = array.tobytes()
  return name, model if name == "sentencepiece" else None


def _sentencepiece_dir(model: bytes, vocab_size: int, directory: str, source: str) -> str:
  """`directory` holding the SentencePiece model as an export keeps it (the name
  load_saved_tokenizer finds), after checking that it loads and fits the model's vocab."""
  path = fs.join(directory, f"sp_imported_{vocab_size}.model")
  fs.write_bytes(path, model)
  try:
    sp = tok_lib.SentencePieceTokenizer(path)
  except (RuntimeError, ValueError) as e:
    raise ValueError(
      f"{source} is not a SentencePiece model that loads: "
      f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}"
    ) from None
  if sp.vocab_size > vocab_size:
    raise ValueError(
      f"{source} has {sp.vocab_size} pieces, more than the model's vocab_size={vocab_size}"
    )
  return directory


def _as_numpy(x: Any) -> np.ndarray:
  """A tensor of either file format as a float32 numpy array."""
  if isinstance(x, np.ndarray):
    return x.astype(np.float32, copy=False)
  import torch

  return x.detach().to(torch.float32).cpu().numpy()


def import_torch(
  checkpoint: str,
  out: str,
  weights: str = "ema",
  variant: str | None = None,
  config: specs.Spec | None = None,
  tokenizer: str | None = None,
  log: Callable[[str], None] = print,
) -> tuple[specs.Spec, dict]:
  """Convert a reference PyTorch checkpoint, or our safetensors export (one set of weights:
  `weights` does not apply), to an export at `out`; returns (config, params).

  The model fields of `config` (default: ao_mdm/paper.py `ao_small` / `sigma_small`) follow the
  checkpoint's model_args, data.tokenizer the tokenizer (`tokenizer`: "gpt2" or a SentencePiece
  .model file; default: the one the file carries, else GPT-2 BPE); every change is logged.
  Missing, unused or misshaped keys are refused.
  """
  if weights not in TORCH_WEIGHTS:
    raise ValueError(f"weights={weights!r}; accepted: {', '.join(TORCH_WEIGHTS)}")
  if variant not in (None, "ao", "sigma"):
    raise ValueError(f"variant={variant!r}; accepted: ao, sigma (or None to detect it)")
  if tokenizer not in (None, "gpt2") and not fs.isfile(tokenizer):
    raise FileNotFoundError(
      f"--tokenizer {tokenizer!r}: no such file (a SentencePiece .model, or gpt2)"
    )
  paths.new_output_dir(out)
  ckpt, one_set = _load_checkpoint(checkpoint)
  weights = "model" if one_set else weights
  state = _strip_prefix(ckpt["model"], checkpoint)
  variant = _detect_variant(state, variant, checkpoint)
  paper_recipe = config is None
  config = _default_import_config(variant) if config is None else config
  wtpe = state.get("transformer.wtpe.weight")
  cond_dim = int(wtpe.shape[1]) if variant == "ao" and wtpe is not None else config.model.cond_dim
  config, changes = _config_from_checkpoint(
    config, ckpt["model_args"], variant, cond_dim, checkpoint
  )
  name, sp_model = _tokenizer(ckpt, tokenizer, checkpoint)
  if name and name != config.data.tokenizer:
    changes.append(
      f"data.tokenizer {config.data.tokenizer} -> {name} from "
      f"{'--tokenizer' if tokenizer else 'the checkpoint'}"
    )
    config = config.replace(data=config.data.replace(tokenizer=name))
  if paper_recipe and name != "sentencepiece" and config.model.vocab_size < gpt2.VOCAB_SIZE:
    raise ValueError(
      f"{checkpoint!r}: model_args.vocab_size={config.model.vocab_size} is below "
      f"the {gpt2.VOCAB_SIZE} ids of GPT-2 BPE, the tokenizer of the authors' "
      "models (their vocab_size is 50304); an export of it could not be sampled "
      "or evaluated"
      + (
        ""
        if name
        else "; a model of another tokenizer needs it: --tokenizer=FILE (a SentencePiece .model)"
      )
    )
  bias = bool(ckpt["model_args"].get("bias", True))
  rows = torch_layout.reference_layout(config.model, bias)
  tensors = _tensors(ckpt, rows, weights, checkpoint)
  del ckpt, state
  with tempfile.TemporaryDirectory(prefix="ao_mdm_import_") as tmp:
    tokenizer_dir = (
      None
      if sp_model is None
      else _sentencepiece_dir(
        sp_model,
        config.model.vocab_size,
        tmp,
        f"--tokenizer {tokenizer!r}" if tokenizer else f"the tokenizer of {checkpoint!r}",
      )
    )
    params = _params(tensors, rows, config.model, bias, checkpoint)
    checkpoints.write_params_export(out, config.to_dict(), params, tokenizer_dir)
  for line in changes:  # only once the import succeeded
    log(line)
  return config, params


def _params(
  tensors: dict, rows: list[torch_layout.Row], cfg: specs.ModelSpec, bias: bool, path: str
) -> dict:
  """Our parameter tree of the checked reference tensors (emptied as they are converted)."""
  tied = (
    tensors.pop("lm_head.weight")
    if rows[-1].conv == "tied" and "lm_head.weight" in tensors
    else None
  )
  if tied is not None and not np.array_equal(
    _as_numpy(tied), _as_numpy(tensors["transformer.wte.weight"])
  ):
    raise ValueError(
      f"{path!r}: lm_head.weight differs from transformer.wte.weight; sigma-GPT ties them"
    )
  flat: dict[tuple, np.ndarray] = {}
  layers: dict[tuple, list[np.ndarray]] = {}
  for row in rows:
    if row.conv == "tied":  # checked above; the token embedding is the head
      continue
    x = torch_layout.to_ours(row, _as_numpy(tensors.pop(row.key)), cfg)
    if row.layer is None:
      flat[row.path] = x
    else:
      layers.setdefault(row.path, []).append(x)
  flat.update({p: np.stack(xs) for p, xs in layers.items()})
  del layers

  abstract = traverse_util.flatten_dict(
    nn.unbox(jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0))))
  )
  for p, a in abstract.items():  # model_args.bias=False: the absent biases are zero
    if p not in flat and not bias and p[-1] == "bias":
      flat[p] = np.zeros(a.shape, np.float32)
  wrong = [
    f"{'/'.join(p)}: {flat[p].shape if p in flat else 'absent'} != {a.shape}"
    for p, a in abstract.items()
    if p not in flat or flat[p].shape != a.shape
  ]
  if wrong or set(flat) - set(abstract):
    raise AssertionError(f"import mapping does not fit the model: {wrong}")
  return traverse_util.unflatten_dict(
    {p: jnp.asarray(np.ascontiguousarray(x, np.float32)) for p, x in flat.items()}
  )
