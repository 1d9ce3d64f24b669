"""Tests for ao_mdm.gpt2_scorer against a tiny random Hugging Face GPT-2 (the oracle)."""

import os

import numpy as np
import pytest

from ao_mdm.eval import gpt2_scorer
from ao_mdm.interop import hf_gpt2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

VOCAB, BLOCK = 101, 16


@pytest.fixture(scope="module")
def hf_model():
  """A tiny GPT2LMHeadModel in eval mode, every param random (HF inits biases to 0, norms to 1)."""
  torch.manual_seed(0)
  config = transformers.GPT2Config(
    n_layer=2,
    n_embd=32,
    n_head=4,
    n_positions=BLOCK,
    vocab_size=VOCAB,
    layer_norm_epsilon=1e-3,
    bos_token_id=0,
    eos_token_id=0,
  )
  model = transformers.GPT2LMHeadModel(config).eval()
  with torch.no_grad():
    for p in model.parameters():  # the head is wte itself, so it stays tied
      p.add_(0.05 * torch.randn_like(p))
  return model


def _save(model, path, fmt: str = "safetensors") -> str:
  """`save_pretrained`; "bin" rewrites the weights as a Hub-style pytorch_model.bin."""
  model.save_pretrained(path)
  if fmt == "bin":  # transformers 5 always writes safetensors, so write the .bin ourselves
    os.remove(os.path.join(path, "model.safetensors"))
    sd = {k.removeprefix("transformer."): v for k, v in model.state_dict().items()}  # has lm_head
    for i in range(model.config.n_layer):  # the buffers old checkpoints carry
      sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, BLOCK, BLOCK, dtype=torch.bool))
      sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, os.path.join(path, "pytorch_model.bin"))
  return str(path)


@pytest.fixture(scope="module")
def scorer(hf_model, tmp_path_factory):
  hf_dir = _save(hf_model, tmp_path_factory.mktemp("hf"))
  return gpt2_scorer.load_gpt2_scorer(
    hf_gpt2.import_hf_gpt2(hf_dir, str(tmp_path_factory.mktemp("out") / "gpt2"))
  )


def _ids(seed: int = 0, shape=(3, BLOCK)) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, VOCAB, shape)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_matches_torch_logits_and_perplexity(tmp_path, hf_model, fmt):
  out = hf_gpt2.import_hf_gpt2(_save(hf_model, tmp_path / "hf", fmt), str(tmp_path / "out"))
  assert gpt2_scorer.is_gpt2_export(out)
  assert sorted(os.listdir(out)) == ["gpt2_config.json", "params"]
  scorer = gpt2_scorer.load_gpt2_scorer(out)
  assert (scorer.vocab_size, scorer.block_size) == (VOCAB, BLOCK)
  ids = _ids(1)
  with torch.no_grad():
    want = hf_model(torch.as_tensor(ids)).logits
  got = scorer.logits(ids)
  assert got.dtype == np.float32 and got.shape == (3, BLOCK, VOCAB)
  np.testing.assert_allclose(got, want.numpy(), atol=1e-5)

  nll = scorer.token_nll(ids)
  assert nll.dtype == np.float64 and nll.shape == (3, BLOCK - 1)
  want_nll = torch.nn.functional.cross_entropy(  # token t scored from the logits of slot t-1
    want[:, :-1].transpose(1, 2), torch.as_tensor(ids[:, 1:]), reduction="none"
  )
  np.testing.assert_allclose(np.exp(nll.mean(1)), want_nll.mean(1).exp().numpy(), rtol=1e-5)


def test_prefix_scores_do_not_depend_on_later_tokens(scorer):
  ids = _ids(2)
  changed = ids.copy()
  changed[:, 9:] = (changed[:, 9:] + 1) % VOCAB
  np.testing.assert_allclose(
    scorer.token_nll(ids)[:, :8], scorer.token_nll(changed)[:, :8], rtol=1e-6
  )
  np.testing.assert_allclose(scorer.token_nll(ids[:, :5]), scorer.token_nll(ids)[:, :4], rtol=1e-5)


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_out_of_vocab_refused(scorer, bad):
  ids = _ids(3)
  ids[1, 4] = bad
  with pytest.raises(ValueError, match="vocabulary"):
    scorer.token_nll(ids)


def test_too_long_refused(scorer):
  with pytest.raises(ValueError, match="block_size"):
    scorer.token_nll(_ids(4, (2, BLOCK + 1)))


def test_missing_weight_refused(tmp_path, hf_model):
  hf_dir = _save(hf_model, tmp_path / "hf")
  path = os.path.join(hf_dir, "model.safetensors")
  sd = safetensors_numpy.load_file(path)
  del sd["transformer.h.1.attn.c_proj.bias"]
  safetensors_numpy.save_file(sd, path)
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=r"missing key\(s\) h\.1\.attn\.c_proj\.bias"):
    hf_gpt2.import_hf_gpt2(hf_dir, str(out))
  assert not out.exists()


def test_non_empty_out_refused(tmp_path, hf_model):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  with pytest.raises(FileExistsError):
    hf_gpt2.import_hf_gpt2(_save(hf_model, tmp_path / "hf"), str(out))
  assert os.listdir(out) == ["keep.txt"]


def test_load_missing_or_foreign_dir_refused(tmp_path):
  with pytest.raises(FileNotFoundError):
    gpt2_scorer.load_gpt2_scorer(str(tmp_path / "nothing"))
  assert not gpt2_scorer.is_gpt2_export(str(tmp_path))
  with pytest.raises(ValueError, match="not a GPT-2 export"):
    gpt2_scorer.load_gpt2_scorer(str(tmp_path))


def test_cli_scores_other_tokenizers_samples_as_gpt2_text(tmp_path):
  """`import-gpt2` then `eval --generated --scorer`: SentencePiece samples are re-tokenized."""
  import json
  import subprocess
  import sys

  from ao_mdm.data import gpt2

  torch.manual_seed(1)
  config = transformers.GPT2Config(
    n_layer=1, n_embd=8, n_head=2, n_positions=64, vocab_size=gpt2.VOCAB_SIZE
  )
  model = transformers.GPT2LMHeadModel(config).eval()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = lambda *a: subprocess.run(
    [sys.executable, "-m", "ao_mdm.cli.main", *a],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=root,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  out = run("import-gpt2", f"--hf_dir={_save(model, tmp_path / 'hf')}", f"--out={tmp_path / 'sc'}")
  assert out.returncode == 0, out.stderr
  texts = ["We hold these truths to be self-evident.", "The state of the Union is strong."]
  samples = tmp_path / "s.jsonl"
  samples.write_text(
    "".join(
      json.dumps({"text": t, "tokens": [1, 2, 3], "tokenizer": "sentencepiece"}) + "\n"
      for t in texts
    )
  )
  out = run("eval", f"--generated={samples}", f"--scorer={tmp_path / 'sc'}")
  assert out.returncode == 0, out.stderr
  got = json.loads(out.stdout.strip().splitlines()[-1])
  expected = []
  for t in texts:
    ids = torch.tensor([gpt2.GPT2Tokenizer().encode(t)])
    with torch.no_grad():
      logits = model(ids).logits[0, :-1]
    expected.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).exp().item())
  np.testing.assert_allclose(got["gen_ppl"], np.mean(expected), rtol=1e-4)
  # GPT-2-tokenized samples are scored as they are; the padding ids 50257.. are refused.
  samples.write_text(json.dumps({"text": "x", "tokens": [1, 50300, 3], "tokenizer": "gpt2"}) + "\n")
  out = run("eval", f"--generated={samples}", f"--scorer={tmp_path / 'sc'}")
  assert out.returncode != 0 and "50300 is outside the scorer's vocab" in out.stderr


class _RunsCode:
  """Pickled as a call of os.system: what a malicious pytorch_model.bin holds."""

  def __reduce__(self):
    return (os.system, ("echo ran > ran.txt",))


@pytest.mark.slow  # three import-gpt2 processes (about 15 s)
def test_a_damaged_hf_dir_is_one_error_line(tmp_path, hf_model):
  """import-gpt2 on a truncated model.safetensors, a truncated pytorch_model.bin and a .bin whose
  pickle would run code: one `error:` line naming the file, exit 2, nothing run or written."""
  import pickle
  import subprocess
  import sys

  st = _save(hf_model, tmp_path / "st")
  data = open(os.path.join(st, "model.safetensors"), "rb").read()
  open(os.path.join(st, "model.safetensors"), "wb").write(data[:40])
  pt = _save(hf_model, tmp_path / "pt", "bin")
  data = open(os.path.join(pt, "pytorch_model.bin"), "rb").read()
  open(os.path.join(pt, "pytorch_model.bin"), "wb").write(data[: len(data) // 2])
  evil = _save(hf_model, tmp_path / "evil", "bin")
  with open(os.path.join(evil, "pytorch_model.bin"), "wb") as f:
    pickle.dump({"wte.weight": _RunsCode()}, f)
  for hf_dir, file, what in (
    (st, "model.safetensors", "not a readable safetensors file"),
    (pt, "pytorch_model.bin", "not a readable PyTorch state dict"),
    (evil, "pytorch_model.bin", "not a readable PyTorch state dict"),
  ):
    out = subprocess.run(
      [
        sys.executable,
        "-m",
        "ao_mdm.cli.main",
        "import-gpt2",
        f"--hf_dir={hf_dir}",
        f"--out={tmp_path / 'out'}",
      ],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=120,
      env={
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.path.dirname(os.path.dirname(__file__)),
      },
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith(f"error: {os.path.join(hf_dir, file)}: {what} ("), lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "ran.txt").exists()
