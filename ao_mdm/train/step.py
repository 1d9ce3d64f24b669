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
from ao_mdm.data import pairs
from ao_mdm.eval import responses
from ao_mdm.train import state as train_state
from ao_mdm.train.state import TrainState


def sequence_nll(
  model: model_lib.AOGPT, params: Any, tokens_BT: jax.Array, order_BT: jax.Array
) -> jax.Array:
  """Mean NLL per sequence under the given order, float32, from integer labels."""
  return jnp.mean(model_lib.slot_nll(model, params, tokens_BT, order_BT), axis=1)


def split_shares(nll_B: jax.Array, count_B: jax.Array, l2r_B: jax.Array) -> dict:
  """Sums and counts for the overall, L2R-order and any-order (non-identity) losses: nll_B is
  each row's NLL summed over its count_B counted slots (a mean over 1 for a whole sequence)."""
  l2r = l2r_B.astype(jnp.float32)
  return {
    "loss_sum": jnp.sum(nll_B),
    "count": jnp.sum(count_B),
    "l2r_sum": jnp.sum(nll_B * l2r),
    "l2r_count": jnp.sum(count_B * l2r),
    "ao_sum": jnp.sum(nll_B * (1 - l2r)),
    "ao_count": jnp.sum(count_B * (1 - l2r)),
  }


def row_width(config: specs.Spec) -> int:
  """Columns of a batch row: T tokens, and with data.pairs a prompt length and a length."""
  return config.model.block_size + (pairs.EXTRA if config.data.pairs else 0)


def make_micro_loss(config: specs.Spec) -> Callable:
  """(params, rows_bX, key, step) -> (summed NLL, shares). A sequence counts once, as its mean
  NLL under a drawn order; a pair (data.pairs) counts each response token, under a prompt-first
  order, and none of its prompt's."""
  model = model_lib.make_model(config.model)
  t = config.model.block_size
  if not config.data.pairs:
    order_fn = orders.make_order_fn(config.order, t)

    def sequence_loss(params, tokens_bT, key, step):
      order_bT = order_fn(key, tokens_bT.shape[0], step)
      nll_b = sequence_nll(model, params, tokens_bT, order_bT)
      shares = split_shares(nll_b, jnp.ones_like(nll_b), orders.is_identity(order_bT))
      return shares["loss_sum"], shares

    return sequence_loss

  def response_loss(params, rows_bX, key, step):
    tokens_bT, prompt_b, length_b = pairs.split_rows(rows_bX)
    t = tokens_bT.shape[1]  # rows may be narrower than the block (pairs.narrowed)
    order_bT = orders.prompt_first(key, prompt_b, length_b, t, config.order, step)
    counted_bT = orders.response_slots(prompt_b, length_b, t)
    nll_bT = model_lib.slot_nll(model, params, tokens_bT, order_bT)
    nll_b = jnp.sum(jnp.where(counted_bT, nll_bT, 0.0), axis=1)
    count_b = jnp.sum(counted_bT, axis=1).astype(jnp.float32)
    shares = split_shares(nll_b, count_b, orders.is_identity(order_bT))
    return shares["loss_sum"], shares

  return response_loss


def token_loss(batch: dict, logp_BT: jax.Array, clip: float, kl: float) -> tuple:
  """GRPO (train/grpo.py): per answer the mean over its drawn tokens of the clipped ratio loss
  plus kl x the KL estimate exp(ref - logp) - (ref - logp) - 1; the summed KL, clipped counts."""
  counted_BT = batch["counted"]
  ratio_BT = jnp.exp(logp_BT - batch["old"])
  adv_B1 = batch["advantage"]
  surrogate_BT = jnp.minimum(ratio_BT * adv_B1, jnp.clip(ratio_BT, 1 - clip, 1 + clip) * adv_B1)
  log_ref_ratio_BT = batch["ref"] - logp_BT
  kl_BT = jnp.exp(log_ref_ratio_BT) - log_ref_ratio_BT - 1
  loss_BT = (-surrogate_BT + kl * kl_BT) * counted_BT
  n_B = jnp.maximum(counted_BT.sum(1), 1.0)
  clipped_BT = (jnp.abs(ratio_BT - 1) > clip) * counted_BT
  return loss_BT.sum(1) / n_B, {
    "kl_sum": jnp.sum(kl_BT * counted_BT),
    "clipped_sum": jnp.sum(clipped_BT),
    "token_count": jnp.sum(counted_BT),
  }


def answers_logprobs(config: specs.Spec) -> Callable:
  """(params, answers) -> [B, T] each drawn token's exact log-probability under the params, as
  the decoder drew it (eval/responses.answer_logprobs)."""
  model = model_lib.make_model(config.model)
  sequential = config.grpo.tokens_per_step == 1 or config.grpo.policy == "speculative"

  def logprobs(params, batch):
    first = None if sequential else batch["first"]
    return responses.answer_logprobs(model, params, batch["tokens"], batch["order"], first)

  return logprobs


def make_grpo_loss(config: specs.Spec) -> Callable:
  """(params, answers, key, step) -> (summed per-answer loss, shares): token_loss of the
  answers' exact log-probabilities under the params."""
  logprobs, g = answers_logprobs(config), config.grpo

  def loss(params, batch, key, step):
    del key, step
    loss_B, extra = token_loss(batch, logprobs(params, batch), g.clip, g.kl)
    shares = split_shares(loss_B, jnp.ones_like(loss_B), jnp.zeros_like(loss_B))
    return shares["loss_sum"], {**shares, **extra}

  return loss


def make_train_step(config: specs.Spec) -> Callable:
  """(state, batch) -> (state, metrics); gradient accumulation inside via lax.scan. A batch is
  [B, T] sequences, [B, T + 2] pair rows with data.pairs (data/pairs.py), or GRPO's answers (a
  dict of [B, ...] arrays, train/grpo.py), on which it makes grpo.updates optimiser updates."""
  updates = config.grpo.updates if config.grpo.reward else 1
  tx = train_state.make_optimizer(config.train, updates)
  micro_loss = make_grpo_loss(config) if config.grpo.reward else make_micro_loss(config)
  n_micro = config.train.microbatches
  ema_decay = config.train.ema_decay
  schedule = train_state.learning_rate_schedule(config.train)

  def update(state: TrainState, batch, u):
    """One optimiser update from the batch's gradient (micro-batch m: rows m, m + M, ..., so
    that every micro-batch stays spread over the data axes)."""
    split = lambda x: x.reshape(x.shape[0] // n_micro, n_micro, *x.shape[1:]).swapaxes(0, 1)
    micro = jax.tree.map(
      lambda x: nn.with_logical_constraint(split(x), (None, "batch", "length")[: x.ndim + 1]),
      batch,
    )
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    key = key if updates == 1 else jax.random.fold_in(key, u)
    grad_fn = jax.grad(micro_loss, has_aux=True)

    def accumulate(carry, xs):
      batch_b, m = xs
      grads, shares = grad_fn(state.params, batch_b, jax.random.fold_in(key, m), state.step)
      return jax.tree.map(jnp.add, carry, (grads, shares)), None

    first = jax.tree.map(lambda x: x[0], micro)
    share_shapes = jax.eval_shape(micro_loss, state.params, first, key, state.step)[1]
    zeros = (
      jax.tree.map(jnp.zeros_like, state.params),
      jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), share_shapes),
    )
    (grad_sum, shares), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(n_micro)))
    # Whole sequences count one each (all have T tokens); pairs count their response tokens.
    grads = jax.tree.map(lambda g: g / shares["count"], grad_sum)
    step_updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, step_updates)
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
    if "token_count" in shares:  # GRPO: the mean KL to the reference, the clipped ratios' share
      tokens = jnp.maximum(shares["token_count"], 1.0)
      metrics.update(kl=shares["kl_sum"] / tokens, clip_fraction=shares["clipped_sum"] / tokens)
    return state.replace(params=params, opt_state=opt_state, ema_params=ema), metrics

  old_logprobs = answers_logprobs(config) if config.grpo.reward else None

  def step(state: TrainState, batch):
    if old_logprobs is not None:  # GRPO's ratio is to the params that drew the answers
      batch = {**batch, "old": jax.lax.stop_gradient(old_logprobs(state.params, batch))}
    if updates == 1:
      state, metrics = update(state, batch, 0)
    else:  # metrics of the last update
      state, stacked = jax.lax.scan(lambda s, u: update(s, batch, u), state, jnp.arange(updates))
      metrics = jax.tree.map(lambda m: m[-1], stacked)
    return state.replace(step=state.step + 1), metrics

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
