"""decode/noise.py's unrolled threefry gives jax.random's numbers bit for bit: the draws (and so
the golden outputs) do not change with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ao_mdm.decode import noise


@pytest.mark.parametrize("shape", [(), (3,), (5, 7), (2, 3, 4), (16, 8192)])
@pytest.mark.parametrize("seed", [0, 1, 2**31 + 5])
def test_bits_and_gumbel_equal_jax_random(shape, seed):
  key = jax.random.fold_in(jax.random.key(seed), 11)
  fast = noise.unrolled(key)
  for width in (8, 16, 32):
    dtype = f"uint{width}"
    np.testing.assert_array_equal(
      jax.random.bits(fast, shape, dtype), jax.random.bits(key, shape, dtype)
    )
  np.testing.assert_array_equal(
    jax.jit(noise.gumbel, static_argnums=1)(key, shape), jax.random.gumbel(key, shape)
  )
  np.testing.assert_array_equal(jax.random.uniform(fast, shape), jax.random.uniform(key, shape))


def test_batched_keys_as_the_engine_draws():
  """vmap over per-row keys folded with a per-row step, as engine.draw does."""
  keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(3), r))(jnp.arange(6))
  steps = jnp.array([0, 5, 1, 9, 2, 2])

  def draws(gumbel):
    return jax.jit(jax.vmap(lambda k, i: gumbel(jax.random.fold_in(k, i), (4, 257))))(keys, steps)

  ours = draws(noise.gumbel)
  np.testing.assert_array_equal(ours, draws(lambda k, s: jax.random.gumbel(k, s)))
  assert not np.array_equal(ours[4], ours[5])  # two rows at one step draw different numbers


def test_split_and_fold_in_are_threefry_s():
  key = jax.random.key(42)
  fast = noise.unrolled(key)
  for a, b in [
    (jax.random.split(fast, 3), jax.random.split(key, 3)),
    (jax.random.fold_in(fast, 7), jax.random.fold_in(key, 7)),
  ]:
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


def test_too_many_numbers_is_refused():
  with pytest.raises(ValueError, match="2\\*\\*32"):
    jax.jit(lambda k: noise.gumbel(k, (2**16, 2**16))).lower(jax.random.key(0))
