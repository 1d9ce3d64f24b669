"""Tests for the import of reference PyTorch checkpoints (ao_mdm.torch_import.import_torch).

Imported params are run through our model and compared with the PyTorch model of
ao_mdm/torch_reference.py (the authors' module tree and computation), so the key mapping is
checked against the reference computation, not only against its own inverse.
"""

import json

import flax
import jax
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.config import base_config
from ao_mdm.interop import torch_import, torch_layout
from helpers import default_stage_keeps, random_params

torch = pytest.importorskip("torch")
from ao_mdm.interop import torch_reference  # needs torch


def _config(variant: str, block_size: int = 12, vocab_size: int = 96):
  c = base_config()
  c.model.update(
    variant=variant,
    vocab_size=vocab_size,
    block_size=block_size,
    n_layer=2,
    n_head=2,
    n_embd=16,
    cond_dim=8,
  )
  c.data.update(dataset="openwebtext", tokenizer="gpt2")
  return specs.parse(c)


def _reference_checkpoint(config, params, ema_params, bias: bool = True) -> dict:
  """A full reference checkpoint dict as train_AOGPT_CL.py saves it."""
  sd = {
    k: torch.from_numpy(v)
    for k, v in torch_layout.to_torch_state_dict(params, config.model).items()
  }
  if config.model.variant == "sigma":
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied: one tensor, two keys
  model = {(f"_orig_mod.{k}" if i % 2 else k): v for i, (k, v) in enumerate(sd.items())}
  ema_sd = torch_layout.to_torch_state_dict(ema_params, config.model)
  shadow = [
    torch.from_numpy(v)
    for k, v in ema_sd.items()
    if not (config.model.variant == "sigma" and k == "lm_head.weight")
  ]
  m = config.model
  model_args = dict(
    n_layer=m.n_layer,
    n_head=m.n_head,
    n_embd=m.n_embd,
    block_size=m.block_size,
    bias=bias,
    vocab_size=m.vocab_size,
    dropout=0.0,
  )
  # The optimizer state as their configure_optimizers makes it (AdamW, two param groups, fused
  # off) after one step, and the scalar globals they save as `config`.
  weights = [torch.nn.Parameter(v.clone()) for v in sd.values()]
  optimizer = torch.optim.AdamW(
    [
      {"params": weights[::2], "weight_decay": 0.05},
      {"params": weights[1::2], "weight_decay": 0.0},
    ],
    lr=6e-4,
    betas=(0.9, 0.95),
  )
  sum(w.sum() for w in weights).backward()
  optimizer.step()
  return {
    "model": model,
    "ema_model": {"decay": 0.9999, "num_updates": 7, "shadow_params": shadow},
    "ema_rate": 0.9999,
    "optimizer": optimizer.state_dict(),
    "model_args": model_args,
    "iter_num": 7,
    "config": {
      "learning_rate": 6e-4,
      "dataset": "openwebtext",
      "compile": False,
      "train_mode": "Random_CL",
      "random_ratio": 0.9,
      "gradient_accumulation_steps": 64,
    },
  }


def _batch(config, seed: int = 0):
  rng = np.random.default_rng(seed)
  b, t = 3, config.model.block_size
  tokens = rng.integers(0, config.model.vocab_size, (b, t)).astype(np.int32)
  order = np.stack([rng.permutation(t) for _ in range(b)]).astype(np.int32)
  return tokens, order


def _assert_params_equal(got, want):
  got = flax.traverse_util.flatten_dict(jax.device_get(got), sep="/")
  want = flax.traverse_util.flatten_dict(want, sep="/")
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_array_equal(np.asarray(got[key]), want[key], err_msg=key)


def _save(tmp_path, ckpt, name="ckpt.pt") -> str:
  path = str(tmp_path / name)
  torch.save(ckpt, path)
  return path


@pytest.mark.parametrize("variant", ["ao", "sigma"])
@pytest.mark.parametrize("weights", ["model", "ema"])
def test_import_matches_params_and_reference_forward(tmp_path, variant, weights):
  config = _config(variant)
  params, ema = random_params(config, 1), random_params(config, 2)
  path = _save(tmp_path, _reference_checkpoint(config, params, ema))
  out = str(tmp_path / "export")
  got_config, got = torch_import.import_torch(path, out, weights=weights, config=config)
  want = params if weights == "model" else ema
  _assert_params_equal(got, want)
  assert got_config.model == config.model

  loaded_config, loaded = checkpoints.load_params(out)  # the export round trip is the identity
  _assert_params_equal(loaded, want)
  assert loaded_config.model == got_config.model

  tokens, order = _batch(config)
  logits = model_lib.make_model(config.model).apply({"params": loaded}, tokens, order)
  reference = torch_reference.logits(torch_reference.from_params(want, config.model), tokens, order)
  np.testing.assert_allclose(np.asarray(logits), reference, rtol=1e-4, atol=1e-4)


def test_model_args_bias_false(tmp_path):
  config = _config("ao")
  params = random_params(config, 3)
  for name in ("qkv", "attn_out", "mlp_in", "mlp_out"):  # the reference has no such biases
    params["blocks"][name]["bias"] = np.zeros_like(params["blocks"][name]["bias"])
  ckpt = _reference_checkpoint(config, params, params, bias=False)
  ckpt["model"] = {
    k: v
    for k, v in ckpt["model"].items()
    if not k.endswith(("c_attn.bias", "c_proj.bias", "c_fc.bias"))
  }
  ckpt["ema_model"]["shadow_params"] = list(ckpt["model"].values())
  _, got = torch_import.import_torch(
    _save(tmp_path, ckpt), str(tmp_path / "out"), "ema", config=config
  )
  _assert_params_equal(got, params)


def test_config_follows_model_args(tmp_path, capsys):
  ckpt_config = _config("sigma", block_size=12, vocab_size=96)
  params = random_params(ckpt_config, 4)
  path = _save(tmp_path, _reference_checkpoint(ckpt_config, params, params))
  given = _config("sigma", block_size=8, vocab_size=64)
  got_config, got = torch_import.import_torch(path, str(tmp_path / "out"), config=given)
  printed = capsys.readouterr().out
  assert "model.block_size 8 -> 12 from the checkpoint's model_args" in printed
  assert "model.vocab_size 64 -> 96 from the checkpoint's model_args" in printed
  assert (got_config.model.block_size, got_config.model.vocab_size) == (12, 96)
  assert given.model.block_size == 8  # the given config is not modified
  _assert_params_equal(got, params)


@pytest.fixture(scope="module")
def ao_checkpoint():
  config = _config("ao")
  return config, _reference_checkpoint(config, random_params(config, 5), random_params(config, 6))


def _refused(tmp_path, ckpt, config, match, weights="ema", variant=None, error=ValueError):
  out = tmp_path / "out"
  with pytest.raises(error, match=match):
    torch_import.import_torch(_save(tmp_path, ckpt), str(out), weights, variant, config)
  assert not out.exists()


def test_missing_key_refused(tmp_path, ao_checkpoint):
  config, ckpt = ao_checkpoint
  model = {k: v for k, v in ckpt["model"].items() if not k.endswith("h.1.attn.k_norm.weight")}
  _refused(
    tmp_path,
    {**ckpt, "model": model},
    config,
    r"missing key\(s\) transformer\.h\.1\.attn\.k_norm\.weight",
  )


def test_extra_key_refused(tmp_path, ao_checkpoint):
  config, ckpt = ao_checkpoint
  model = {**ckpt["model"], "_orig_mod.transformer.h.0.attn.rotary": torch.zeros(4)}
  _refused(
    tmp_path,
    {**ckpt, "model": model},
    config,
    r"unexpected key\(s\) transformer\.h\.0\.attn\.rotary",
  )


def test_wrong_shape_refused(tmp_path, ao_checkpoint):
  config, ckpt = ao_checkpoint
  model = dict(ckpt["model"])
  key = next(k for k in model if k.endswith("h.0.ln_2.weight"))
  model[key] = torch.zeros(17)
  _refused(
    tmp_path,
    {**ckpt, "model": model},
    config,
    r"transformer\.h\.0\.ln_2\.weight has shape \(17,\), expected \(16,\)",
  )


def test_wrong_ema_refused(tmp_path, ao_checkpoint):
  config, ckpt = ao_checkpoint
  shadow = list(ckpt["ema_model"]["shadow_params"])
  n = len(shadow)
  _refused(
    tmp_path,
    {**ckpt, "ema_model": {"shadow_params": shadow[:-1]}},
    config,
    f"shadow_params has {n - 1} tensors, expected {n}",
  )
  shadow[1] = torch.zeros(14, 16)
  _refused(
    tmp_path,
    {**ckpt, "ema_model": {"shadow_params": shadow}},
    config,
    r"transformer\.wpe\.weight \(shadow_params\[1\]\) has shape \(14, 16\), "
    r"expected \(13, 16\)",
  )


def test_not_a_checkpoint_refused(tmp_path, ao_checkpoint):
  config, ckpt = ao_checkpoint
  _refused(tmp_path, ckpt["model"], config, "expected a dict with 'model'")
  text = tmp_path / "notes.txt"
  text.write_text("not a checkpoint")
  with pytest.raises(ValueError, match="not a PyTorch checkpoint"):
    torch_import.import_torch(str(text), str(tmp_path / "out"), config=config)
  with pytest.raises(FileNotFoundError, match="no reference checkpoint file"):
    torch_import.import_torch(str(tmp_path / "absent.pt"), str(tmp_path / "out"), config=config)


class _Payload:
  """Unpickling this runs a shell command (what a malicious .pt could do)."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    import os

    return os.system, (f"touch {self.marker}",)


def test_the_paper_recipe_refuses_a_vocab_too_small_for_gpt2(tmp_path, ao_checkpoint, capsys):
  _, ckpt = ao_checkpoint
  with pytest.raises(ValueError, match=r"model_args.vocab_size=96 is below the 50257 ids"):
    torch_import.import_torch(_save(tmp_path, ckpt), str(tmp_path / "out"))
  assert capsys.readouterr().out == "" and not (tmp_path / "out").exists()


def test_checkpoint_with_code_is_refused_and_never_runs(tmp_path, ao_checkpoint):
  config, ckpt = ao_checkpoint
  marker = tmp_path / "payload_ran"
  path = _save(tmp_path, {**ckpt, "config": _Payload(str(marker))}, "evil.pt")
  with pytest.raises(
    ValueError,
    match=r"evil.pt' holds an object of type (posix|os)\.system, "
    r"which a checkpoint .* refused without running it",
  ):
    torch_import.import_torch(path, str(tmp_path / "out"), config=config)
  assert not marker.exists() and not (tmp_path / "out").exists()


def test_variant_mismatch_and_bad_arguments_refused(tmp_path, ao_checkpoint):
  config, ckpt = ao_checkpoint
  _refused(tmp_path, ckpt, config, "variant='sigma' but .* has AdaLN keys", variant="sigma")
  with pytest.raises(ValueError, match="weights='params'; accepted: ema, model"):
    torch_import.import_torch("x.pt", str(tmp_path / "out"), "params")


def test_non_empty_out_refused(tmp_path, ao_checkpoint):
  config, ckpt = ao_checkpoint
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "file").write_text("x")
  with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
    torch_import.import_torch(_save(tmp_path, ckpt), str(tmp_path / "out"), config=config)


def test_untied_sigma_head_refused(tmp_path):
  config = _config("sigma")
  params = random_params(config, 7)
  ckpt = _reference_checkpoint(config, params, params)
  ckpt["model"]["lm_head.weight"] = ckpt["model"]["lm_head.weight"] + 1.0
  _refused(
    tmp_path, ckpt, config, "lm_head.weight differs from transformer.wte.weight", weights="model"
  )


@pytest.mark.parametrize("variant", default_stage_keeps(["ao", "sigma"], ["sigma"]))
def test_export_torch_loads_in_the_reference_and_imports_back_bitwise(tmp_path, variant):
  """`export-torch` of an export of a bfloat16 run: float32 tensors under the authors' names;
  their module tree (torch_reference) gives our logits; import-torch gives our params back
  bitwise, from `model` and from `ema_model`; safetensors holds the same tensors."""
  from safetensors import safe_open
  from safetensors.numpy import load_file

  from ao_mdm.interop import torch_export

  config = _config(variant)
  config = config.replace(model=config.model.replace(dtype="bfloat16"))
  params = random_params(config, 5)
  export = checkpoints.write_params_export(str(tmp_path / "export"), config.to_dict(), params)
  path = torch_export.export_torch(export, str(tmp_path / "out" / "ckpt.pt"))
  ckpt = torch.load(path, weights_only=True)
  m = config.model
  assert ckpt["model_args"] == dict(
    n_layer=m.n_layer,
    n_head=m.n_head,
    n_embd=m.n_embd,
    block_size=m.block_size,
    bias=True,
    vocab_size=m.vocab_size,
    dropout=0.0,
  )
  assert all(t.dtype == torch.float32 for t in ckpt["model"].values())
  reference = torch_reference.TorchAOGPT(m)
  reference.load_state_dict(ckpt["model"])  # strict: every name and shape theirs
  tokens, order = _batch(config)
  ours = model_lib.make_model(m.replace(dtype="float32")).apply({"params": params}, tokens, order)
  np.testing.assert_allclose(
    torch_reference.logits(reference, tokens, order), np.asarray(ours), rtol=1e-4, atol=1e-4
  )
  for weights in ("model", "ema"):
    _, back = torch_import.import_torch(
      path, str(tmp_path / f"back_{weights}"), weights=weights, config=config
    )
    _assert_params_equal(back, params)
  safe = torch_export.export_torch(
    export, str(tmp_path / "out" / "model.safetensors"), fmt="safetensors"
  )
  tensors = load_file(safe)
  assert sorted(tensors) == sorted(ckpt["model"])
  for name, value in tensors.items():
    np.testing.assert_array_equal(value, ckpt["model"][name].numpy(), err_msg=name)
  with safe_open(safe, "np") as f:
    assert json.loads(f.metadata()["model_args"]) == ckpt["model_args"]
  with pytest.raises(FileExistsError, match="exists; give a new path"):
    torch_export.export_torch(export, path)


def _greedy(path):
  """Greedy samples (texts and ids) of a run or export after a prompt (its tokenizer's ids)."""
  from ao_mdm.decode import generate

  config, params, tokenizer = checkpoints.load_run(path)
  return [
    (r["text"], list(map(int, r["tokens"])))
    for r in generate.sample_texts(
      params,
      config.model,
      tokenizer,
      num_samples=2,
      batch_size=2,
      prompt="Fellow citizens of the Senate",
      temperature=0.0,
      steps=8,
    )
  ]


@pytest.mark.parametrize("fmt", default_stage_keeps(["torch", "safetensors"], []))  # 15 s each
def test_export_torch_of_a_sentencepiece_model_imports_back_with_the_same_greedy_samples(
  tmp_path, sp_export, fmt, capsys
):
  """Issue 43, items 1 and 2: the file carries its tokenizer (torch: a uint8 tensor that
  weights_only loads, beside the keys the authors' loaders read; safetensors: its metadata),
  import-torch takes either format and the round trip changes no param, no tokenizer byte and
  no greedy sample."""
  from ao_mdm.interop import torch_export

  path = torch_export.export_torch(sp_export, str(tmp_path / f"model.{fmt}"), fmt=fmt)
  _, want, tokenizer = checkpoints.load_run(sp_export)
  if fmt == "torch":
    ckpt = torch.load(path, weights_only=True)
    assert {"model", "model_args", "ema_model"} < set(ckpt)
    assert ckpt["tokenizer"]["name"] == "sentencepiece"
    assert ckpt["tokenizer"]["model"].numpy().tobytes() == open(tokenizer.model_path, "rb").read()
  capsys.readouterr()
  config, params = torch_import.import_torch(path, str(tmp_path / "back"))  # the paper's recipe
  assert "data.tokenizer gpt2 -> sentencepiece from the checkpoint" in capsys.readouterr().out
  assert config.data.tokenizer == "sentencepiece" and config.model.vocab_size == 512
  _assert_params_equal(params, jax.device_get(want))
  assert checkpoints.load_run(str(tmp_path / "back"))[2].sha256 == tokenizer.sha256
  assert _greedy(str(tmp_path / "back")) == _greedy(sp_export)


def test_a_file_without_its_tokenizer_needs_tokenizer_flag(tmp_path, sp_export):
  """A file that lost the entry (e.g. saved again by the authors' trainer) is refused under the
  paper's GPT-2 recipe with a line naming --tokenizer; with it, it imports; a damaged model is
  refused with one line."""
  from ao_mdm.interop import torch_export

  ckpt = torch.load(
    torch_export.export_torch(sp_export, str(tmp_path / "full.pt")), weights_only=True
  )
  tokenizer = ckpt.pop("tokenizer")
  path = _save(tmp_path, ckpt, "theirs.pt")
  with pytest.raises(
    ValueError, match=r"vocab_size=512 is below the 50257 ids .* --tokenizer=FILE"
  ):
    torch_import.import_torch(path, str(tmp_path / "out"))
  model = tmp_path / "sp.model"
  model.write_bytes(tokenizer["model"].numpy().tobytes())
  config, _ = torch_import.import_torch(path, str(tmp_path / "out"), tokenizer=str(model))
  assert config.data.tokenizer == "sentencepiece"
  assert checkpoints.load_run(str(tmp_path / "out"))[2].vocab_size == 512
  damaged = _save(
    tmp_path,
    {**ckpt, "tokenizer": {"name": "sentencepiece", "model": torch.zeros(9, dtype=torch.uint8)}},
    "damaged.pt",
  )
  with pytest.raises(
    ValueError,
    match=r"the tokenizer of .*damaged.pt' is not a SentencePiece "
    r"model that loads",
  ):
    torch_import.import_torch(damaged, str(tmp_path / "out2"))
  assert not (tmp_path / "out2").exists()


def test_error_lines_list_a_few_keys(tmp_path, ao_checkpoint):
  """A dict that is no checkpoint (here a bare state dict) is named by a few of its keys."""
  config, ckpt = ao_checkpoint
  n = len(ckpt["model"])
  with pytest.raises(ValueError) as e:
    torch_import.import_torch(_save(tmp_path, ckpt["model"]), str(tmp_path / "out"), config=config)
  assert f"... and {n - 4} more" in str(e.value) and len(str(e.value)) < 400, str(e.value)
