"""The margin policy (decode/margin.py) against a naive decoder, through both drivers."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from test_confidence import naive_greedy

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import batching, driver, margin, policies, schedules


def margin_np(logits_NV: np.ndarray) -> np.ndarray:
  """Top-1 minus top-2 probability, in numpy."""
  p = np.exp(logits_NV - logits_NV.max(-1, keepdims=True))
  p = np.sort(p / p.sum(-1, keepdims=True), axis=-1)
  return p[..., -1] - p[..., -2]


def _model():
  cfg = specs.default().model.replace(
    vocab_size=32, block_size=12, n_layer=2, n_embd=32, n_head=4, cond_dim=16
  )
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(3)))
  return cfg, jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)


def _want(cfg, params, steps, known) -> tuple:
  prompt = dict(known_positions=[2, 7, 9][:known], known_tokens=[4, 5, 6][:known])
  return prompt, naive_greedy(cfg, params, steps, margin_np, **prompt)


@pytest.mark.parametrize("steps,known", [(5, 3), pytest.param(12, 0, marks=pytest.mark.slow)])
def test_margin_equals_naive_full_forwards(steps, known):
  """Greedy, the static loop (policies' `margin`, as `ao-mdm sample --mode=margin` runs it)."""
  cfg, params = _model()
  prompt, (want_tokens, want_order) = _want(cfg, params, steps, known)
  out = policies.get("margin").sample(
    params, cfg, batch_size=2, steps=steps, temperature=0.0, **prompt
  )
  np.testing.assert_array_equal(out.order, [want_order] * 2)
  np.testing.assert_array_equal(out.tokens, [want_tokens] * 2)


@pytest.mark.slow  # compiles the step at every cache and query bucket (about 20 s)
@pytest.mark.parametrize("steps,known", [(5, 3), (12, 0)])
def test_margin_in_the_continuous_batcher_equals_naive_alone_and_beside_others(steps, known):
  cfg, params = _model()
  prompt, (want_tokens, want_order) = _want(cfg, params, steps, known)
  width = int(np.diff(schedules.schedule_counts(12, known, steps, "linear")).max())
  spec = margin.DecoderSpec(model=cfg, width=width, real_width=width)
  request = batching.Request(
    tuple(prompt["known_positions"]), tuple(prompt["known_tokens"]), steps, temperature=0.0
  )
  others = [
    batching.Request((0,), (1,), schedules.steps_within(12, 1, width), seed=5),
    batching.Request(steps=schedules.steps_within(12, 0, width), seed=6),
  ]
  batcher = batching.Batcher(params, spec, batch=3, max_steps=12)
  for requests in ([request], [request, *others], [*others, request]):
    mine = driver.decode_all(batcher, requests)[requests.index(request)]
    np.testing.assert_array_equal(mine.order, want_order)
    np.testing.assert_array_equal(mine.tokens, want_tokens)


def test_margin_ranks_by_the_gap_between_the_two_best_tokens():
  """Not by the top probability: [0.5, 0.5, 0] has the larger top-1 but a zero margin."""
  logits = np.log(np.asarray([[0.5, 0.5, 1e-9], [0.4, 0.3, 0.3]]))
  spec = margin.DecoderSpec(model=_model()[0])
  got = np.asarray(spec.confidence(logits[None]))[0]
  np.testing.assert_allclose(got, margin_np(logits), atol=1e-6)
  np.testing.assert_allclose(margin_np(np.log([[0.5, 0.3, 0.2]])), [0.2], atol=1e-6)
