"""benchmarks/draft_overlap.py: its early predictions are the any-order queries it claims to be."""

import importlib.util
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from helpers import ROOT

spec = importlib.util.spec_from_file_location(
  "draft_overlap", os.path.join(ROOT, "benchmarks", "draft_overlap.py")
)
draft_overlap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(draft_overlap)


@pytest.mark.parametrize("ahead", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_q_predicts_the_target_without_the_tokens_before_it(ahead):
  cfg = specs.default().model.replace(
    vocab_size=16, block_size=10, n_layer=2, n_embd=32, n_head=4, cond_dim=16
  )
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  params = jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, params)
  got = draft_overlap.early_predictions(params, cfg, samples=3, ahead=ahead, seed=1)
  forward = jax.jit(
    lambda order: model_lib.make_model(cfg).apply(
      {"params": params}, jnp.asarray(got["tokens"]), order
    )
  )
  l2r = forward(jnp.arange(10)[None].repeat(3, 0))
  assert len(got["positions"]) >= 2
  for j, pos in enumerate(got["positions"]):
    # Naive: an order that knows x_0 .. x_{pos-ahead-1}, then queries pos (later slots are
    # causal and change nothing).
    first = list(range(pos - ahead)) + [pos]
    order = jnp.asarray(first + [i for i in range(10) if i not in first])[None].repeat(3, 0)
    logits = forward(order)[:, pos - ahead]
    np.testing.assert_allclose(got["q"][:, j], jax.nn.softmax(logits, -1), atol=2e-5)
    np.testing.assert_allclose(got["p"][:, j], jax.nn.softmax(l2r[:, pos], -1), atol=2e-5)
