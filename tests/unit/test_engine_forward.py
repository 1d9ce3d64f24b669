"""DecodeModel.forward with cols_BQ: its last layer runs only those columns (every column's K/V is
still made and written), and what it returns is exactly the full chunk's hidden states there.
The same, bitwise, on the params a decode loop holds (DecodeModel.loop_params: the layers split,
each Dense kernel [outputs, inputs], the AdaLN tables made once), whose outputs, with a cache or
without, and prefills are the stacked params' within float32 rounding."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import common, engine

T, B, W, Q = 32, 3, 7, 4


@pytest.mark.parametrize("variant", ["ao", "sigma"])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("cached", [True, False])
def test_forward_at_columns_equals_full_forward_there(variant, dtype, cached):
  cfg = specs.default().model.replace(
    variant=variant, block_size=T, vocab_size=64, n_layer=2, n_embd=32, n_head=2, cond_dim=32
  )
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  params, cfg = common.with_dtype(params, cfg, dtype)
  dm = engine.DecodeModel.of(cfg)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (B, T)), jnp.int32)
  order = jnp.asarray(np.stack([rng.permutation(T) for _ in range(B)]), jnp.int32)
  known = jnp.asarray([5, 9, 12], jnp.int32)
  cache = engine.KVCache.empty(cfg, B)
  slots_12 = jnp.broadcast_to(jnp.arange(12), (B, 12))
  kv = dm.prefill(params, tokens, order, 12)
  cache = cache.write(kv, jnp.where(slots_12 < known[:, None], slots_12, T)) if cached else None
  slots = known[:, None] + jnp.arange(W)
  tok, pos = engine.slot_inputs(tokens, order, slots)
  target = jnp.take_along_axis(order, jnp.minimum(slots + 1, T - 1), 1)
  sees = jnp.asarray(rng.integers(0, W, (B, W)), jnp.int32)
  chunk = engine.Chunk(tok, pos, target, sees, known)
  write = jnp.where(slots < T, slots, T)[:, :3] if cached else None
  cols = jnp.asarray([[0, 2, 5, 6], [6, 1, 1, 3], [4, 5, 6, 0]], jnp.int32)
  cache_len = T if cached else None
  # Either form, with a cache or without (a prefill's forward).
  forms = [params, dm.loop_params(params)]
  outputs = []
  for p in forms:
    h, c, kv, new_cache = dm.forward(p, cache, chunk, cache_len, write)
    h_q, c_q, kv_q, new_cache_q = dm.forward(p, cache, chunk, cache_len, write, cols)
    assert h_q.shape == (B, Q, cfg.n_embd)
    np.testing.assert_array_equal(h_q, jnp.take_along_axis(h, cols[..., None], 1))
    np.testing.assert_array_equal(dm.logits(p, h_q, c_q), dm.logits(p, *_at(h, c, cols)))
    for a, b in zip(jax.tree.leaves((kv, new_cache)), jax.tree.leaves((kv_q, new_cache_q))):
      np.testing.assert_array_equal(a, b)  # every column's K/V, and the cache written with them
    outputs.append([h, dm.logits(p, h, c), kv, new_cache, dm.prefill(p, tokens, order, 12)])
  # The loop's kernels [outputs, inputs] round differently, within float32's precision.
  tol = 1e-5 if dtype == "float32" else 2e-2
  for a, b in zip(*(jax.tree.leaves(o) for o in outputs)):
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol)


def _at(h, c, cols):
  """The hidden states and conditioning of the full chunk at cols (what forward(cols) returns)."""
  h = jnp.take_along_axis(h, cols[..., None], 1)
  return h, c and (c[0], jnp.take_along_axis(c[1], cols, 1))
