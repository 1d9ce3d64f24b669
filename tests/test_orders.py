"""Order sampling: permutations, mixing ratio, fixed and blockwise patterns, bad kinds."""
import jax
import numpy as np
import pytest

from ao_mdm import orders
from ao_mdm.config import base_config


def order_cfg(**kw):
  cfg = base_config().order
  cfg.update(kw)
  return cfg


@pytest.mark.parametrize("kind", orders.ORDER_KINDS)
def test_every_order_is_a_permutation(kind):
  out = np.asarray(orders.make_order_fn(order_cfg(kind=kind), 32)(jax.random.key(0), 64))
  assert out.shape == (64, 32) and out.dtype == np.int32
  np.testing.assert_array_equal(np.sort(out, axis=1), np.broadcast_to(np.arange(32), (64, 32)))


def test_mixed_ratios():
  t, n = 16, 20000
  ident = np.arange(t)
  fn = lambda r: np.asarray(orders.make_order_fn(order_cfg(kind="mixed", random_ratio=r), t)(
      jax.random.key(1), n))
  assert not np.any(np.all(fn(1.0) == ident, axis=1))
  assert np.all(fn(0.0) == ident)
  frac = np.mean(np.all(fn(0.9) == ident, axis=1))
  assert abs(frac - 0.1) < 3 * np.sqrt(0.1 * 0.9 / n), frac


def test_fixed_and_blockwise():
  fixed = np.asarray(orders.make_order_fn(order_cfg(kind="fixed", fixed_seed=3), 32)(
      jax.random.key(0), 4))
  assert np.all(fixed == fixed[0]) and not np.all(fixed[0] == np.arange(32))
  np.testing.assert_array_equal(fixed[0], orders.fixed_permutation(3, 32))
  block = np.asarray(orders.make_order_fn(
      order_cfg(kind="blockwise", block=4, pattern=(0, 2, 3, 1)), 32)(jax.random.key(0), 2))
  for b in range(8):
    np.testing.assert_array_equal(block[:, 4 * b:4 * b + 4], 4 * b + np.array([[0, 2, 3, 1]] * 2))


def test_random_orders_differ_per_row():
  out = np.asarray(orders.random_orders(jax.random.key(0), 8, 64))
  assert len({tuple(r) for r in out}) == 8


def test_bad_order_configs():
  with pytest.raises(ValueError, match="order.kind='zigzag'; accepted: random, l2r"):
    orders.make_order_fn(order_cfg(kind="zigzag"), 16)
  with pytest.raises(ValueError, match="random_ratio=1.5"):
    orders.make_order_fn(order_cfg(kind="mixed", random_ratio=1.5), 16)
  with pytest.raises(ValueError, match="order.block=5 must be >= 1 and divide block_size=16"):
    orders.make_order_fn(order_cfg(kind="blockwise", block=5, pattern=(0, 1, 2, 3, 4)), 16)
  with pytest.raises(ValueError, match="pattern"):
    orders.make_order_fn(order_cfg(kind="blockwise", block=4, pattern=(0, 1, 1, 3)), 16)
