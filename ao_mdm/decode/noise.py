"""Gumbel noise for the draw, bit for bit jax.random.gumbel's, several times faster on CPU.

JAX lowers threefry for the CPU as a rolled loop of five iterations, each reading and writing the
whole [B, Q, V] counter pair; unrolled (as on TPU) it is one fused elementwise pass. Here the
unrolled rounds are a PRNG implementation of their own (jax.extend.random), with threefry's seed,
split and fold_in, so jax.random.gumbel's own transform turns the same bits into the same floats.
tests/unit/test_noise.py compares the two.
"""

import jax
import jax.extend.random as jax_prng
import jax.numpy as jnp
import numpy as np

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # threefry-2x32's, by group of four rounds


def threefry2x32(k1: jax.Array, k2: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple:
  """Threefry-2x32 (20 rounds, Salmon et al. 2011) of the counter pairs (x0, x1) under key
  (k1, k2), written out round by round."""
  ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for group in range(5):
    for r in _ROTATIONS[group % 2]:
      x0 = x0 + x1
      x1 = x0 ^ ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r)))
    x0, x1 = x0 + ks[(group + 1) % 3], x1 + ks[(group + 2) % 3] + np.uint32(group + 1)
  return x0, x1


def _random_bits(key: jax.Array, bit_width: int, shape: tuple) -> jax.Array:
  """JAX's partitionable threefry bits: the pair (0, i) hashed for the i-th number."""
  size = int(np.prod(shape))
  if size >= 2**32:
    raise ValueError(f"noise of {size} numbers: at most 2**32 - 1 are supported")
  count = jax.lax.iota(jnp.uint32, size).reshape(shape)
  hi, lo = threefry2x32(key[0], key[1], jnp.zeros_like(count), count)
  if bit_width == 64:
    return (hi.astype(jnp.uint64) << np.uint64(32)) | lo.astype(jnp.uint64)
  return (hi ^ lo).astype(f"uint{bit_width}")


_THREEFRY = jax_prng.threefry_prng_impl
UNROLLED = jax_prng.define_prng_impl(
  key_shape=(2,),
  seed=_THREEFRY.seed,
  split=_THREEFRY.split,
  fold_in=_THREEFRY.fold_in,
  random_bits=_random_bits,
  name="threefry2x32, unrolled",
  tag="fry_unrolled",
)


def unrolled(key: jax.Array) -> jax.Array:
  """The same threefry key, drawing through the unrolled rounds."""
  return jax.random.wrap_key_data(jax.random.key_data(key), impl=UNROLLED)


def gumbel(key: jax.Array, shape: tuple) -> jax.Array:
  """float32 standard Gumbel noise: jax.random.gumbel(key, shape), bitwise."""
  return jax.random.gumbel(unrolled(key), shape, jnp.float32)
