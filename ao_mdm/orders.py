"""Generation orders (docs/design.md, "Orders and evaluation"), sampled on device from a key."""

from collections.abc import Callable
from typing import Any

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


def prompt_first(
  key: jax.Array,
  prompt_len_B: jax.Array,
  length_B: jax.Array,
  t: int,
  cfg: specs.OrderSpec,
  step: Any = 0,
) -> jax.Array:
  """[B, t] orders that take positions [0, p) first (the prompt, in cfg.prompt's order), then
  [p, n) (the response, in cfg.kind's order: l2r, random or mixed), then the padding [n, t) left to
  right. So slots [p, n) are exactly the response's, and each sees the whole prompt.
  """
  k_prompt, k_response, k_coin = jax.random.split(key, 3)
  b = prompt_len_B.shape[0]
  pos_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
  p_B1, n_B1 = prompt_len_B[:, None], length_B[:, None]
  in_prompt, in_response = pos_BT < p_B1, (pos_BT >= p_B1) & (pos_BT < n_B1)
  l2r_BT = pos_BT / t  # within a part, a rank in [0, 1)
  prompt_BT = l2r_BT if cfg.prompt == "l2r" else jax.random.uniform(k_prompt, (b, t))
  response_BT = jax.random.uniform(k_response, (b, t))
  if cfg.kind == "l2r":
    response_BT = l2r_BT
  elif cfg.kind == "mixed":
    ramp = int(cfg.ramp_steps)
    chance = cfg.random_ratio if ramp <= 0 else cfg.random_ratio * jnp.clip(step / ramp, 0, 1)
    response_BT = jnp.where(jax.random.bernoulli(k_coin, chance, (b, 1)), response_BT, l2r_BT)
  rank_BT = jnp.where(in_prompt, prompt_BT, jnp.where(in_response, 1 + response_BT, 2 + l2r_BT))
  return jnp.argsort(rank_BT, axis=1).astype(jnp.int32)


def response_slots(prompt_len_B: jax.Array, length_B: jax.Array, t: int) -> jax.Array:
  """[B, t] bool: the slots of a prompt-first order that hold the response (the loss's)."""
  s_1T = jnp.arange(t)[None, :]
  return (s_1T >= prompt_len_B[:, None]) & (s_1T < length_B[:, None])


def is_identity(order_BT: jax.Array) -> jax.Array:
  """Per-row flag: is this order left-to-right?"""
  return jnp.all(order_BT == jnp.arange(order_BT.shape[1]), axis=1)
