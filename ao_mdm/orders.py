"""Generation orders (docs/design.md, "Orders and evaluation"), sampled on device from a key."""
import functools
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

ORDER_KINDS = ("random", "l2r", "mixed", "fixed", "blockwise")
OrderFn = Callable[..., jax.Array]  # (key, batch, step=0) -> order_BT int32


def identity(batch: int, t: int) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))


def random_orders(key: jax.Array, batch: int, t: int) -> jax.Array:
  """A uniform random permutation of 0..t-1 per row."""
  return jnp.argsort(jax.random.uniform(key, (batch, t)), axis=1).astype(jnp.int32)


PAPER_ORDERS_FILE = os.path.join(os.path.dirname(__file__), "data", "paper_orders.json")


@functools.cache
def paper_orders() -> dict:
  """The authors' literal fixed permutations of the order study (Fig. 2a), by name."""
  with open(PAPER_ORDERS_FILE) as f:
    return {k: tuple(v) for k, v in json.load(f)["orders"].items()}


def fixed_permutation(spec: str, t: int) -> np.ndarray:
  """The one permutation of a `fixed` order: "seed:N" (drawn from seed N) or a shipped name."""
  if spec.startswith("seed:") and spec[5:].isdigit():
    return np.random.default_rng(int(spec[5:])).permutation(t).astype(np.int32)
  shipped = paper_orders()
  if spec not in shipped:
    raise ValueError(f"order.fixed={spec!r}; accepted: seed:N or one of {', '.join(shipped)}")
  perm = np.asarray(shipped[spec], np.int32)
  if len(perm) != t:
    raise ValueError(f"order.fixed={spec!r} is a permutation of {len(perm)} positions; "
                     f"model.block_size={t}")
  return perm


def blockwise_permutation(block: int, pattern: tuple, t: int) -> np.ndarray:
  """Left-to-right over blocks of `block` positions, `pattern` within each block."""
  return (np.arange(0, t, block)[:, None] + np.asarray(pattern)[None, :]).reshape(-1).astype(np.int32)


def validate_order_config(cfg: ml_collections.ConfigDict, t: int) -> None:
  """Raise one clear ValueError for an order config that cannot be used with length t."""
  if cfg.kind not in ORDER_KINDS:
    raise ValueError(f"order.kind={cfg.kind!r}; accepted: {', '.join(ORDER_KINDS)}")
  if cfg.kind == "mixed" and not 0.0 <= cfg.random_ratio <= 1.0:
    raise ValueError(f"order.random_ratio={cfg.random_ratio} must be in [0, 1]")
  if cfg.ramp_steps < 0 or (cfg.ramp_steps > 0 and cfg.kind != "mixed"):
    raise ValueError(f"order.ramp_steps={cfg.ramp_steps} must be 0, or >= 1 with "
                     f"order.kind='mixed' (got kind={cfg.kind!r})")
  if cfg.kind == "fixed":
    fixed_permutation(cfg.fixed, t)
  if cfg.kind == "blockwise":
    if cfg.block < 1 or t % cfg.block:
      raise ValueError(f"order.block={cfg.block} must be >= 1 and divide block_size={t}")
    if sorted(cfg.pattern) != list(range(cfg.block)):
      raise ValueError(f"order.pattern={tuple(cfg.pattern)} must be a permutation of "
                       f"0..{cfg.block - 1}")


def make_order_fn(cfg: ml_collections.ConfigDict, t: int) -> OrderFn:
  """Return fn(key, batch, step=0) -> [batch, t] int32 orders for an order config.

  Only mixed orders depend on the training step (order.ramp_steps: a curriculum from L2R).
  """
  validate_order_config(cfg, t)
  if cfg.kind == "random":
    return lambda key, batch, step=0: random_orders(key, batch, t)
  if cfg.kind == "l2r":
    return lambda key, batch, step=0: identity(batch, t)
  if cfg.kind == "mixed":
    ratio, ramp = float(cfg.random_ratio), int(cfg.ramp_steps)

    def mixed(key, batch, step=0):
      k_perm, k_coin = jax.random.split(key)
      p = ratio if ramp <= 0 else ratio * jnp.clip(step / ramp, 0.0, 1.0)
      use_random_B1 = jax.random.bernoulli(k_coin, p, (batch, 1))
      return jnp.where(use_random_B1, random_orders(k_perm, batch, t), identity(batch, t))
    return mixed
  if cfg.kind == "fixed":
    perm = fixed_permutation(cfg.fixed, t)
  else:
    perm = blockwise_permutation(int(cfg.block), tuple(cfg.pattern), t)
  return lambda key, batch, step=0: jnp.broadcast_to(jnp.asarray(perm), (batch, t))


def is_identity(order_BT: jax.Array) -> jax.Array:
  """Per-row flag: is this order left-to-right?"""
  return jnp.all(order_BT == jnp.arange(order_BT.shape[1]), axis=1)
