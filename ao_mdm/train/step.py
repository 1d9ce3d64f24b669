"""The jitted train step (gradient accumulation inside, orders drawn on device) and
`make_program`, the one constructor of the sharded training program (docs/design.md, "Training")."""

from collections.abc import Callable
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ao_mdm import model as model_lib
from ao_mdm import orders, sharding, specs
from ao_mdm.train import state as train_state
from ao_mdm.train.state import TrainState


def sequence_nll(
  model: model_lib.AOGPT, params: Any, tokens_BT: jax.Array, order_BT: jax.Array
) -> jax.Array:
  """Mean NLL per sequence under the given order, float32, from integer labels."""
  return jnp.mean(model_lib.slot_nll(model, params, tokens_BT, order_BT), axis=1)


SHARE_KEYS = ("loss_sum", "count", "l2r_sum", "l2r_count", "ao_sum", "ao_count")


def _split_shares(nll_B: jax.Array, l2r_B: jax.Array) -> dict:
  """Sums and counts for the overall, L2R-order and any-order (non-identity) losses."""
  l2r = l2r_B.astype(jnp.float32)
  return {
    "loss_sum": jnp.sum(nll_B),
    "count": jnp.float32(nll_B.shape[0]),
    "l2r_sum": jnp.sum(nll_B * l2r),
    "l2r_count": jnp.sum(l2r),
    "ao_sum": jnp.sum(nll_B * (1 - l2r)),
    "ao_count": jnp.sum(1 - l2r),
  }


def make_train_step(config: specs.Spec) -> Callable:
  """(state, tokens_BT) -> (state, metrics); gradient accumulation inside via lax.scan."""
  model = model_lib.make_model(config.model)
  tx = train_state.make_optimizer(config.train)
  order_fn = orders.make_order_fn(config.order, config.model.block_size)
  n_micro = config.train.microbatches
  ema_decay = config.train.ema_decay
  schedule = train_state.learning_rate_schedule(config.train)

  def micro_loss(params, tokens_bT, key, step):
    order_bT = order_fn(key, tokens_bT.shape[0], step)
    nll_b = sequence_nll(model, params, tokens_bT, order_bT)
    shares = _split_shares(nll_b, orders.is_identity(order_bT))
    return shares["loss_sum"], shares

  def step(state: TrainState, tokens_BT: jax.Array):
    b, t = tokens_BT.shape
    # Micro-batch m takes rows m, m + M, ...: every micro-batch stays spread over the data axes.
    tokens_MbT = tokens_BT.reshape(b // n_micro, n_micro, t).swapaxes(0, 1)
    tokens_MbT = nn.with_logical_constraint(tokens_MbT, (None, "batch", "length"))
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    grad_fn = jax.grad(micro_loss, has_aux=True)

    def accumulate(carry, xs):
      tokens_bT, m = xs
      grads, shares = grad_fn(state.params, tokens_bT, jax.random.fold_in(key, m), state.step)
      return jax.tree.map(jnp.add, carry, (grads, shares)), None

    zeros = (
      jax.tree.map(jnp.zeros_like, state.params),
      {k: jnp.zeros((), jnp.float32) for k in SHARE_KEYS},
    )
    (grad_sum, shares), _ = jax.lax.scan(accumulate, zeros, (tokens_MbT, jnp.arange(n_micro)))
    # Every sequence has T tokens, so weighting by token count is weighting by sequence.
    grads = jax.tree.map(lambda g: g / shares["count"], grad_sum)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n = (state.step + 1).astype(jnp.float32)
    decay = jnp.minimum(ema_decay, (1.0 + n) / (10.0 + n))
    ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, state.ema_params, params)
    metrics = {
      "loss": shares["loss_sum"] / shares["count"],
      # NaN when the batch holds no sequence of that kind (left out of the log).
      "loss_l2r": shares["l2r_sum"]
      / jnp.where(shares["l2r_count"] > 0, shares["l2r_count"], jnp.nan),
      "loss_any_order": shares["ao_sum"]
      / jnp.where(shares["ao_count"] > 0, shares["ao_count"], jnp.nan),
      "l2r_fraction": shares["l2r_count"] / shares["count"],
      "grad_norm": optax.global_norm(grads),
      "learning_rate": schedule(state.step),
    }
    new_state = state.replace(
      step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema
    )
    return new_state, metrics

  return step


@dataclasses.dataclass(frozen=True)
class Program:
  """The sharded training program of a config: one constructor for train, bench, compile, tests.

  `step(state, tokens_BT)` runs the jitted train step on `mesh` with the state donated;
  `jitted` is its jax.jit object (for lowering ahead of time). `abstract_state`: the
  state's ShapeDtypeStructs carrying their shardings (restore and AOT targets).
  """

  config: specs.Spec
  mesh: jax.sharding.Mesh
  axis_rules: tuple
  shardings: TrainState  # NamedSharding per leaf
  abstract_state: TrainState
  batch_sharding: jax.sharding.NamedSharding
  step: Callable
  jitted: Any

  def init_state(self) -> TrainState:
    return train_state.create_state(self.config, self.mesh, self.axis_rules, self.shardings)

  def check_fits(self) -> None:
    """Refuses, before anything is allocated, a train state larger than a device's memory
    (params, EMA and both Adam moments; activations come on top)."""
    abstract = self.abstract_state
    need = sum(
      int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
      for a in jax.tree.leaves(abstract)
    )
    device, where = self.mesh.devices.flat[0], "each device"
    if device.platform == "cpu":  # the host's devices share its memory
      import psutil

      have, need, where = (
        psutil.virtual_memory().available,
        need * jax.local_device_count(),
        "this host",
      )
    else:
      have = (device.memory_stats() or {}).get("bytes_limit", 0)
    if have and need > have:
      raise ValueError(
        f"the train state of this config needs {need / 2**30:.1f} GiB on {where} "
        f"({model_lib.count_params(abstract.params):,} parameters, with the EMA and both Adam "
        f"moments), more than the {have / 2**30:.1f} GiB available; use a smaller model or "
        "shard it over more devices (config.mesh)"
      )

  def global_batch(self, local_bT: np.ndarray) -> jax.Array:
    """This process's rows of the global batch -> the global array on the mesh."""
    return sharding.global_batch(local_bT, self.batch_sharding)


def make_program(config: specs.Spec, devices: list | None = None) -> Program:
  """Build the mesh over `devices` (default: all) and jit the step."""
  train = config.train
  mesh = sharding.make_mesh(config.mesh, devices=devices)
  axis_rules = sharding.rules(config.mesh)
  dp = sharding.data_parallel_size(mesh, axis_rules)
  if train.batch_size % (dp * train.microbatches):
    raise ValueError(
      f"train.batch_size={train.batch_size} must be divisible by the "
      f"data-parallel size {dp} times train.microbatches={train.microbatches}"
    )
  shardings, abstract = train_state.sharded_shapes(config, mesh, axis_rules)
  batch = sharding.batch_sharding(mesh, axis_rules)
  jitted = jax.jit(
    make_train_step(config),
    in_shardings=(shardings, batch),
    out_shardings=(shardings, sharding.replicated(mesh)),
    donate_argnums=0,
  )

  def step(state, tokens_BT):
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules):
      return jitted(state, tokens_BT)

  return Program(config, mesh, axis_rules, shardings, abstract, batch, step, jitted)
