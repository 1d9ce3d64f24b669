"""Order sampling: permutations, mixing ratio, fixed and blockwise patterns, bad kinds."""

import dataclasses

import jax
import numpy as np
import pytest

from ao_mdm import orders, specs


def order_cfg(**kw):
  return dataclasses.replace(specs.default().order, **kw)


@pytest.mark.parametrize("kind", specs.ORDER_KINDS)
def test_every_order_is_a_permutation(kind):
  out = np.asarray(orders.make_order_fn(order_cfg(kind=kind), 32)(jax.random.key(0), 64))
  assert out.shape == (64, 32) and out.dtype == np.int32
  np.testing.assert_array_equal(np.sort(out, axis=1), np.broadcast_to(np.arange(32), (64, 32)))


def test_mixed_ratios():
  t, n = 16, 20000
  ident = np.arange(t)
  fn = lambda r: np.asarray(
    orders.make_order_fn(order_cfg(kind="mixed", random_ratio=r), t)(jax.random.key(1), n)
  )
  assert not np.any(np.all(fn(1.0) == ident, axis=1))
  assert np.all(fn(0.0) == ident)
  frac = np.mean(np.all(fn(0.9) == ident, axis=1))
  assert abs(frac - 0.1) < 3 * np.sqrt(0.1 * 0.9 / n), frac


def test_mixed_ramp_starts_left_to_right():
  t, n = 16, 20000
  fn = orders.make_order_fn(order_cfg(kind="mixed", random_ratio=0.9, ramp_steps=100), t)
  l2r = lambda step: np.mean(
    np.all(np.asarray(fn(jax.random.key(2), n, step)) == np.arange(t), axis=1)
  )
  assert l2r(0) == 1.0
  for step, want in [(50, 1 - 0.45), (100, 0.1), (400, 0.1)]:
    assert abs(l2r(step) - want) < 3 * np.sqrt(want * (1 - want) / n), (step, l2r(step))


def test_fixed_and_blockwise():
  fixed = np.asarray(
    orders.make_order_fn(order_cfg(kind="fixed", fixed="seed:3"), 32)(jax.random.key(0), 4)
  )
  assert np.all(fixed == fixed[0]) and not np.all(fixed[0] == np.arange(32))
  np.testing.assert_array_equal(fixed[0], order_cfg(kind="fixed", fixed="seed:3").permutation(32))
  block = np.asarray(
    orders.make_order_fn(order_cfg(kind="blockwise", block=4, pattern=(0, 2, 3, 1)), 32)(
      jax.random.key(0), 2
    )
  )
  for b in range(8):
    np.testing.assert_array_equal(block[:, 4 * b : 4 * b + 4], 4 * b + np.array([[0, 2, 3, 1]] * 2))


def test_the_order_registry_holds_the_specs_kinds():
  assert list(orders.ORDERS) == list(specs.ORDER_KINDS)


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
  with pytest.raises(ValueError, match="order.ramp_steps=10 must be 0, or >= 1 with"):
    orders.make_order_fn(order_cfg(kind="random", ramp_steps=10), 16)
  with pytest.raises(ValueError, match="order.ramp_steps=-1"):
    orders.make_order_fn(order_cfg(kind="mixed", ramp_steps=-1), 16)


def test_shipped_paper_orders_are_the_authors_literal_permutations():
  """order1..3 come from config_order/train_AOGPT_order{1,2,3}.py, not from a seed."""
  shipped = specs.paper_orders()
  assert set(shipped) == {"order1", "order2", "order3"}
  for perm in shipped.values():
    assert sorted(perm) == list(range(1024))
  # Entries read off the authors' files by hand.
  assert shipped["order1"][:5] == (846, 277, 451, 87, 776)
  assert shipped["order1"][-3:] == (98, 334, 471)
  assert shipped["order2"][:3] == (201, 296, 500) and shipped["order3"][:3] == (740, 764, 750)
  fn = orders.make_order_fn(order_cfg(kind="fixed", fixed="order2"), 1024)
  np.testing.assert_array_equal(
    np.asarray(fn(jax.random.key(0), 2)), np.asarray([shipped["order2"]] * 2)
  )
  with pytest.raises(ValueError, match="order.fixed='order2' is a permutation of 1024 positions"):
    orders.make_order_fn(order_cfg(kind="fixed", fixed="order2"), 128)
  with pytest.raises(ValueError, match="order.fixed='order9'; accepted: seed:N or one of order1"):
    orders.make_order_fn(order_cfg(kind="fixed", fixed="order9"), 1024)


def test_paper_configs_build_and_validate():
  from ao_mdm import paper
  from ao_mdm.train import state as train_state

  for name in paper.NAMES:
    specs.parse(paper.paper_config(name))  # every section checked as it is built
  study = specs.parse(paper.paper_config("order_small_order3"))
  assert (study.order.kind, study.order.fixed) == ("fixed", "order3")
  # model_sigmaGPT.forward takes mode 'AR' or 'Random' only: the authors' baseline saw random ones.
  for name in ("sigma_small", "sigma_medium"):
    assert paper.paper_config(name).order.kind == "random"
  assert specs.parse(paper.paper_config("ao_small")).order.random_ratio == 0.9
  # The order study stops at 20k steps of a 500k cosine: the lr has barely decayed at its end.
  lr = train_state.learning_rate_schedule(study.train)(study.train.num_steps)
  assert 0.99 * study.train.learning_rate < float(lr) < study.train.learning_rate
  with pytest.raises(ValueError, match="unknown paper config 'ao_large'"):
    paper.paper_config("ao_large")
