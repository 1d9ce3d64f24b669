"""Tests for ao_mdm.gpt2_scorer against a tiny random Hugging Face GPT-2 (the oracle)."""

import os

import numpy as np
import pytest

from ao_mdm.eval import gpt2_scorer
from ao_mdm.interop import hf_gpt2
from helpers import HF_BLOCK, HF_VOCAB, save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

VOCAB, BLOCK = HF_VOCAB, HF_BLOCK  # conftest.hf_model's sizes


@pytest.fixture(scope="module")
def scorer(hf_model, tmp_path_factory):
  hf_dir = save_hf(hf_model, tmp_path_factory.mktemp("hf"))
  return gpt2_scorer.load_gpt2_scorer(
    hf_gpt2.import_hf_gpt2(hf_dir, str(tmp_path_factory.mktemp("out") / "gpt2"))
  )


def _ids(seed: int = 0, shape=(3, BLOCK)) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, VOCAB, shape)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_matches_torch_logits_and_perplexity(tmp_path, hf_model, fmt):
  out = hf_gpt2.import_hf_gpt2(save_hf(hf_model, tmp_path / "hf", fmt), str(tmp_path / "out"))
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
  hf_dir = save_hf(hf_model, tmp_path / "hf")
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
    hf_gpt2.import_hf_gpt2(save_hf(hf_model, tmp_path / "hf"), str(out))
  assert os.listdir(out) == ["keep.txt"]


def test_load_missing_or_foreign_dir_refused(tmp_path):
  with pytest.raises(FileNotFoundError):
    gpt2_scorer.load_gpt2_scorer(str(tmp_path / "nothing"))
  assert not gpt2_scorer.is_gpt2_export(str(tmp_path))
  with pytest.raises(ValueError, match="not a GPT-2 export"):
    gpt2_scorer.load_gpt2_scorer(str(tmp_path))
