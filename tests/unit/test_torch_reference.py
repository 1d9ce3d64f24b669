"""The PyTorch baseline (ao_mdm/torch_reference.py) against our model and train step.

PyTorch is the independent oracle here: its autograd, torch.optim.AdamW, clip_grad_norm_ and
cross_entropy against our jax.grad, optax chain and integer-label loss, from the same weights.
"""

import jax
import ml_collections
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import orders, specs
from ao_mdm.config import base_config
from ao_mdm.interop import torch_layout
from ao_mdm.perf import bench_train
from ao_mdm.train import step as train_step

torch = pytest.importorskip("torch")
from ao_mdm.interop import torch_reference  # needs torch
from helpers import random_params


def _config(microbatches: int = 1) -> specs.Spec:
  c = base_config()
  c.model.update(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, cond_dim=16)
  c.order.update(kind="mixed", random_ratio=0.5)
  # Chosen so that each part of the step shows far above the tolerance: warmup 1 (step 0 runs
  # at lr 0 and only moves the moments, step 1 at the peak); a weight decay large enough that
  # decaying a leaf outside the mask, or not one inside it, shows; a clip below the gradient
  # norm of both steps; an EMA decay that the (1 + n) / (10 + n) warm-up reaches at step 2.
  c.train.update(
    batch_size=4,
    num_steps=10,
    warmup_steps=1,
    learning_rate=1e-2,
    min_lr=1e-3,
    weight_decay=0.5,
    grad_clip=0.05,
    ema_decay=0.2,
    microbatches=microbatches,
  )
  return specs.parse(c)


def _tokens(config, seed: int = 0) -> np.ndarray:
  b, t = config.train.batch_size, config.model.block_size
  return np.random.default_rng(seed).integers(0, config.model.vocab_size, (b, t)).astype(np.int32)


def test_loss_matches_ours():
  config = _config()
  params, tokens = random_params(config, 1), _tokens(config)
  rng = np.random.default_rng(2)
  order = np.stack(
    [rng.permutation(32), np.arange(32), rng.permutation(32), rng.permutation(32)]
  ).astype(np.int32)
  ours = train_step.sequence_nll(model_lib.make_model(config.model), params, tokens, order)
  model = torch_reference.from_params(params, config.model)
  with torch.no_grad():
    got = torch_reference.loss(
      model, torch.as_tensor(tokens, dtype=torch.long), torch.as_tensor(order, dtype=torch.long)
    )
  np.testing.assert_allclose(float(got), float(np.mean(ours)), rtol=1e-5)
  assert 4.0 < float(got) < 8.0  # about log(256) for a random model, not a degenerate 0


def _step_orders(config, state, tokens_BT) -> np.ndarray:
  """The orders our step draws from its state: micro-batch m (rows m, m + M, ...) from
  fold_in(fold_in(rng, step), m), as in ao_mdm.train.make_train_step."""
  order_fn = orders.make_order_fn(config.order, config.model.block_size)
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  m = int(config.train.microbatches)
  out = np.zeros(tokens_BT.shape, np.int32)
  for i in range(m):
    out[i::m] = np.asarray(order_fn(jax.random.fold_in(key, i), tokens_BT.shape[0] // m))
  return out


@pytest.mark.parametrize("microbatches", [1, 2])
def test_two_train_steps_match_ours(microbatches):
  config = _config(microbatches)
  program = train_step.make_program(config, devices=jax.devices()[:1])
  params = random_params(config, 3)
  state = program.init_state()
  state = state.replace(
    params=jax.device_put(params, program.shardings.params),
    ema_params=jax.device_put(params, program.shardings.ema_params),
  )
  trainer = torch_reference.Trainer(params, config)
  tokens = _tokens(config, 4)
  model = model_lib.make_model(config.model)
  drawn = []
  for step in range(2):
    order = _step_orders(config, state, tokens)
    drawn.append(order)
    before = jax.device_get(state.params)
    state, metrics = program.step(state, program.global_batch(tokens))
    # The orders above are the ones our step used: its loss is ours under them.
    want = float(np.mean(train_step.sequence_nll(model, before, tokens, order)))
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)
    assert float(metrics["grad_norm"]) > config.train.grad_clip  # the clip acts
    got = trainer.step(
      torch.as_tensor(tokens, dtype=torch.long), torch.as_tensor(order, dtype=torch.long)
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    torch_params, torch_ema = trainer.state_dicts()
    for name, ours in (("params", state.params), ("ema", state.ema_params)):
      got_sd = torch_params if name == "params" else torch_ema
      want_sd = torch_layout.to_torch_state_dict(ours, config.model)
      assert sorted(got_sd) == sorted(want_sd)
      for key in want_sd:
        np.testing.assert_allclose(
          got_sd[key], want_sd[key], rtol=1e-4, atol=1e-5, err_msg=f"step {step} {name} {key}"
        )
  assert not np.array_equal(drawn[0], drawn[1])  # fresh orders each step
  moved = torch_layout.to_torch_state_dict(state.params, config.model)
  start = torch_layout.to_torch_state_dict(params, config.model)
  assert np.abs(moved["lm_head.bias"] - start["lm_head.bias"]).max() > 1e-3  # it did train


def test_bench_train_with_torch_baseline(capsys):
  config = _config()
  bench = ml_collections.ConfigDict({"repeats": 2, "matmul_size": 256})
  result = bench_train.bench_train(config, bench, baseline="torch")
  for key in (
    "tokens_per_s",
    "torch_tokens_per_s",
    "ratio_vs_torch",
    "mfu",
    "matmul_peak_flops",
    "torch_threads",
  ):
    assert result[key] > 0, key
  assert result["ratio_vs_torch"] == pytest.approx(
    result["tokens_per_s"] / result["torch_tokens_per_s"]
  )
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert '"torch_tokens_per_s"' in last and '"ratio_vs_torch"' in last
