"""bf16 decoding (params and K/V cache in bfloat16, logits and draw in float32) against float32."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import common, confidence, engine, parallel, speculative

T, V = 32, 16


def clear_margin_model():
  """A tiny AO-GPT whose greedy decisions are far from ties: random blocks (at init scale), but
  each token's embedding is a scaled one-hot and the head maps it to a fixed successor token, so
  the top logit of every prediction leads by a wide margin while the blocks (and the cache) still
  shift it."""
  cfg = specs.default().model.replace(
    block_size=T, vocab_size=V, n_layer=2, n_embd=64, n_head=4, cond_dim=64
  )
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(3)))
  successor = np.roll(np.arange(V), -5)
  params["token_embed"] = jnp.zeros((V, 64)).at[np.arange(V), np.arange(V)].set(5.0)
  params["head"]["kernel"] = jnp.zeros((64, V)).at[np.arange(V), successor].set(0.1)
  # The final AdaLN scales the logits by 1 + silu(a) with `a` rising with the target position:
  # how confident a prediction is depends clearly on its position (the confidence mode's order).
  params["target_embed"] = jnp.zeros((T, 64)).at[:, 0].set(jnp.linspace(0.0, 3.0, T))
  params["final_adaln"]["kernel"] = jnp.zeros((64, 2, 64)).at[0, 1].set(1.0)
  params["final_adaln"]["bias"] = jnp.zeros((2, 64))
  return cfg, params


def test_with_dtype_casts_params_and_config():
  cfg, params = clear_margin_model()
  p16, c16 = common.with_dtype(params, cfg, "bfloat16")
  assert c16.dtype == "bfloat16" and cfg.dtype == "float32"  # the caller's config is unchanged
  assert {x.dtype for x in jax.tree.leaves(p16)} == {jnp.dtype(jnp.bfloat16)}
  p32, _ = common.with_dtype(params, cfg, "float32")
  assert all(
    a is b or np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(params))
  )
  with pytest.raises(ValueError, match="dtype='float16'; accepted: float32, bfloat16"):
    common.with_dtype(params, cfg, "float16")


def test_bf16_cache_is_bf16():
  cfg, params = clear_margin_model()
  p16, c16 = common.with_dtype(params, cfg, "bfloat16")
  tokens = jnp.zeros((2, T), jnp.int32)
  order = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  known = jnp.full((2,), 4, jnp.int32)
  kv = engine.DecodeModel.of(c16).prefill(p16, tokens, order, 4)
  slots = jnp.broadcast_to(jnp.arange(4), (2, 4))
  cache = engine.KVCache.empty(c16, 2).write(kv, jnp.where(slots < known[:, None], slots, T))
  assert len(cache.k) == len(cache.v) == cfg.n_layer
  assert all(x.dtype == jnp.bfloat16 for x in cache.k + cache.v)
  for k in cache.k:
    assert bool(jnp.any(k[..., :4] != 0)) and not bool(jnp.any(k[..., 4:] != 0))


def test_bf16_greedy_equals_fp32_greedy_where_margins_are_clear():
  """Every greedy token of the parallel sampler (with known tokens scattered) equals fp32's,
  on a model whose fp32 decisions all have a top-1 margin far above the bf16 logit error."""
  cfg, params = clear_margin_model()
  common = dict(
    batch_size=4,
    steps=8,
    temperature=0.0,
    seed=1,
    known_positions=[0, 5, 6, 20],
    known_tokens=[3, 1, 4, 1],
    order="random",
    return_logits=True,
  )
  out32 = parallel.sample(params, cfg, **common)
  out16 = parallel.sample(params, cfg, dtype="bfloat16", **common)
  unknown = np.ones(T, bool)
  unknown[common["known_positions"]] = False
  top2 = np.sort(out32.logits[:, unknown], axis=-1)[..., -2:]
  margin = float(np.min(top2[..., 1] - top2[..., 0]))
  error = float(np.max(np.abs(out16.logits[:, unknown] - out32.logits[:, unknown])))
  assert error > 0  # the bf16 path ran: its logits differ
  assert margin > 10 * error, (margin, error)
  np.testing.assert_array_equal(out16.order, out32.order)
  np.testing.assert_array_equal(out16.tokens, out32.tokens)


@pytest.mark.parametrize(
  "mode", ["speculative", pytest.param("confidence", marks=pytest.mark.slow)]
)
def test_bf16_greedy_equals_fp32_greedy_in_other_modes(mode):
  cfg, params = clear_margin_model()
  if mode == "speculative":
    run = lambda dtype: speculative.sample(
      params, cfg, batch_size=3, draft=3, temperature=0.0, dtype=dtype
    )
  else:
    run = lambda dtype: confidence.sample(
      params, cfg, batch_size=3, steps=8, temperature=0.0, dtype=dtype
    )
  out32, out16 = run("float32"), run("bfloat16")
  np.testing.assert_array_equal(out16.tokens, out32.tokens)
  np.testing.assert_array_equal(out16.order, out32.order)
