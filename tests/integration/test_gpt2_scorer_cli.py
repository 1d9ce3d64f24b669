"""`ao-mdm import-gpt2` and `eval --generated --scorer`: another tokenizer's samples scored as
GPT-2 text; a damaged Hugging Face directory is one error line and runs no code."""

import json
import os
import pickle

import numpy as np
import pytest

from helpers import ROOT, ao_mdm, save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.slow  # a GPT-2 scoring process (about 15 s)
def test_cli_scores_other_tokenizers_samples_as_gpt2_text(tmp_path):
  """`import-gpt2` then `eval --generated --scorer`: SentencePiece samples are re-tokenized."""
  from ao_mdm.data import gpt2

  torch.manual_seed(1)
  config = transformers.GPT2Config(
    n_layer=1, n_embd=8, n_head=2, n_positions=64, vocab_size=gpt2.VOCAB_SIZE
  )
  model = transformers.GPT2LMHeadModel(config).eval()
  out = ao_mdm(
    "import-gpt2", f"--hf_dir={save_hf(model, tmp_path / 'hf')}", f"--out={tmp_path / 'sc'}"
  )
  assert out.returncode == 0, out.stderr
  texts = ["We hold these truths to be self-evident.", "The state of the Union is strong."]
  samples = tmp_path / "s.jsonl"
  samples.write_text(
    "".join(
      json.dumps({"text": t, "tokens": [1, 2, 3], "tokenizer": "sentencepiece"}) + "\n"
      for t in texts
    )
  )
  out = ao_mdm("eval", f"--generated={samples}", f"--scorer={tmp_path / 'sc'}")
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
  out = ao_mdm("eval", f"--generated={samples}", f"--scorer={tmp_path / 'sc'}")
  assert out.returncode != 0 and "50300 is outside the scorer's vocab" in out.stderr


class _RunsCode:
  """Pickled as a call of os.system: what a malicious pytorch_model.bin holds."""

  def __reduce__(self):
    return (os.system, ("echo ran > ran.txt",))


@pytest.mark.slow  # three import-gpt2 processes (about 15 s)
def test_a_damaged_hf_dir_is_one_error_line(tmp_path, hf_model):
  """import-gpt2 on a truncated model.safetensors, a truncated pytorch_model.bin and a .bin whose
  pickle would run code: one `error:` line naming the file, exit 2, nothing run or written."""
  st = save_hf(hf_model, tmp_path / "st")
  data = open(os.path.join(st, "model.safetensors"), "rb").read()
  open(os.path.join(st, "model.safetensors"), "wb").write(data[:40])
  pt = save_hf(hf_model, tmp_path / "pt", "bin")
  data = open(os.path.join(pt, "pytorch_model.bin"), "rb").read()
  open(os.path.join(pt, "pytorch_model.bin"), "wb").write(data[: len(data) // 2])
  evil = save_hf(hf_model, tmp_path / "evil", "bin")
  with open(os.path.join(evil, "pytorch_model.bin"), "wb") as f:
    pickle.dump({"wte.weight": _RunsCode()}, f)
  for hf_dir, file, what in (
    (st, "model.safetensors", "not a readable safetensors file"),
    (pt, "pytorch_model.bin", "not a readable PyTorch state dict"),
    (evil, "pytorch_model.bin", "not a readable PyTorch state dict"),
  ):
    out = ao_mdm(
      "import-gpt2",
      f"--hf_dir={hf_dir}",
      f"--out={tmp_path / 'out'}",
      cwd=tmp_path,
      timeout=120,
      env={"PYTHONPATH": str(ROOT)},
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith(f"error: {os.path.join(hf_dir, file)}: {what} ("), lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "ran.txt").exists()
