"""Generation orders (docs/design.md, "Orders and evaluation"), sampled on device from a key."""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ao_mdm import specs

OrderFn = Callable[..., jax.Array]  # (key, batch, step=0) -> order_BT int32


def identity(batch: int, t: int) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))


def random_orders(key: jax.Array, batch: int, t: int) -> jax.Array:
  """A uniform random permutation of 0..t-1 per row."""
  return jnp.argsort(jax.random.uniform(key, (batch, t)), axis=1).astype(jnp.int32)


def _mixed(cfg: specs.OrderSpec, t: int) -> OrderFn:
  """Random orders with probability random_ratio per row, else L2R; the probability grows from 0
  over ramp_steps training steps (a curriculum from L2R)."""
  ratio, ramp = float(cfg.random_ratio), int(cfg.ramp_steps)

  def mixed(key, batch, step=0):
    k_perm, k_coin = jax.random.split(key)
    p = ratio if ramp <= 0 else ratio * jnp.clip(step / ramp, 0.0, 1.0)
    use_random_B1 = jax.random.bernoulli(k_coin, p, (batch, 1))
    return jnp.where(use_random_B1, random_orders(k_perm, batch, t), identity(batch, t))

  return mixed


def _one_permutation(cfg: specs.OrderSpec, t: int) -> OrderFn:
  """The spec's one permutation (fixed or blockwise) for every row."""
  perm = cfg.permutation(t)
  return lambda key, batch, step=0: jnp.broadcast_to(jnp.asarray(perm), (batch, t))


# Each order kind (order.kind) by name: (spec, t) -> fn(key, batch, step=0) -> [batch, t] orders.
ORDERS: dict[str, Callable[[specs.OrderSpec, int], OrderFn]] = {
  "random": lambda cfg, t: lambda key, batch, step=0: random_orders(key, batch, t),
  "l2r": lambda cfg, t: lambda key, batch, step=0: identity(batch, t),
  "mixed": _mixed,
  "fixed": _one_permutation,
  "blockwise": _one_permutation,
}


def make_order_fn(cfg: specs.OrderSpec, t: int) -> OrderFn:
  """Return fn(key, batch, step=0) -> [batch, t] int32 orders for an order spec.

  Only mixed orders depend on the training step (order.ramp_steps: a curriculum from L2R).
  """
  return ORDERS[cfg.kind](cfg, t)


def is_identity(order_BT: jax.Array) -> jax.Array:
  """Per-row flag: is this order left-to-right?"""
  return jnp.all(order_BT == jnp.arange(order_BT.shape[1]), axis=1)
