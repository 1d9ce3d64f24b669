"""The training loop end to end on the embedded corpus, at a very small size."""
import jax
import numpy as np
import pytest

from ao_mdm import checkpoints, train
from ao_mdm.config import base_config


def small_config(tfds_dir, steps=30):
  c = base_config()
  c.model.update(vocab_size=512, block_size=32, n_layer=2, n_embd=32, n_head=2)
  c.train.update(batch_size=8, num_steps=steps, warmup_steps=5, log_every=10,
                 checkpoint_every=10, eval_batches=2, learning_rate=1e-2, min_lr=1e-3)
  c.data.tfds_dir = tfds_dir
  return c


def test_train_reduces_loss_and_resumes(data_dir, tmp_path, capsys):
  cfg = small_config(data_dir, steps=20)
  workdir = str(tmp_path / "run")
  first = train.train_and_evaluate(cfg, workdir)
  for split in ("train", "validation"):
    for kind in ("l2r", "random"):
      assert first["final_ema"][split][kind] < first["initial"][split][kind] - 0.5
  out = capsys.readouterr().out
  assert "step 10:" in out and "tokens_per_s=" in out and "final eval" in out
  # A longer run in the same work dir continues from the saved step.
  cfg.train.num_steps = 30
  second = train.train_and_evaluate(cfg, workdir)
  assert "initial" not in second
  assert "resumed from step 20" in capsys.readouterr().out
  config, ema = checkpoints.load_params(workdir)
  assert config.train.num_steps == 30
  assert jax.tree.structure(ema) == jax.tree.structure(train.abstract_params(cfg))


def test_export_roundtrip(data_dir, tmp_path):
  cfg = small_config(data_dir, steps=2)
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(cfg, workdir)
  _, ema = checkpoints.load_params(workdir, "ema")
  out = checkpoints.export(workdir, str(tmp_path / "export"))
  config, exported = checkpoints.load_params(out)
  assert (config.model.n_embd, config.model.vocab_size) == (32, 512)
  jax.tree.map(np.testing.assert_array_equal, ema, exported)
  with pytest.raises(FileExistsError, match="not empty"):
    checkpoints.export(workdir, out)


def test_bad_train_configs(data_dir, tmp_path):
  cfg = small_config(data_dir)
  cfg.train.microbatches = 3
  with pytest.raises(ValueError, match="train.batch_size=8 is not divisible by train.microbatches=3"):
    train.train_and_evaluate(cfg, str(tmp_path))
  cfg = small_config(data_dir)
  cfg.order.kind = "spiral"
  with pytest.raises(ValueError, match="order.kind='spiral'"):
    train.train_and_evaluate(cfg, str(tmp_path))
