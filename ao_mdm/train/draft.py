"""Training a learned draft head (decode/draft.py) with the base model frozen: `ao-mdm
train-draft` fits it to the base's conditionals (KL) on the run's training data, in L2R and
random orders, chained over several drafts as speculative decoding feeds it."""

from collections.abc import Callable
import dataclasses
import time
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ao_mdm import model as model_lib
from ao_mdm import orders, specs
from ao_mdm.decode import draft as draft_lib
from ao_mdm.decode import options


@dataclasses.dataclass(frozen=True)
class Settings:
  """`ao-mdm train-draft` settings; --steps, --batch_size, --seed and --order set four."""

  num_steps: int = options.DRAFT_TRAINING["steps"]
  batch_size: int = options.DRAFT_TRAINING["batch_size"]
  seed: int = 0
  learning_rate: float = 3e-3
  warmup_steps: int = 50
  chain: int = 4  # draft steps unrolled in training, each fed the head's previous output
  l2r_fraction: float = 0.5  # sequences in L2R order, the rest in random orders (--order: 1 or 0)
  log_every: int = 100
  eval_batches: int = 4  # validation batches for the acceptance figures


def chain_losses(
  model: nn.Module,
  params: Any,
  head_params: Any,
  tokens_BT: jax.Array,
  order_BT: jax.Array,
  steps: int,
) -> tuple:
  """([J] mean KL(p || q), [J] mean sum_x min(p, q)) of draft j = 1..J against the base's
  conditional p at slot s + j, the chain starting from the base's hidden state at every slot s
  (teacher-forced tokens, the head's own hidden states)."""
  out = model.apply({"params": params}, tokens_BT, order_BT, return_hidden=True)
  logits_BTV, h_BTD = jax.lax.stop_gradient(cast(tuple[jax.Array, jax.Array], out))
  logp_BTV = jax.nn.log_softmax(logits_BTV)
  prev_tok_BT, prev_pos_BT = model_lib.slot_inputs(tokens_BT, order_BT)
  t = tokens_BT.shape[1]
  f, kls, overlaps = h_BTD, [], []
  for j in range(1, steps + 1):
    # f[:, s] predicted the token at order[s + j - 1], which is slot s + j's input.
    f, logits = draft_lib.step(
      model,
      params,
      head_params,
      f[:, : t - j],
      prev_tok_BT[:, j:],
      prev_pos_BT[:, j:],
      order_BT[:, j:],
    )
    logq, logp = jax.nn.log_softmax(logits), logp_BTV[:, j:]
    p = jnp.exp(logp)
    kls.append(jnp.mean(jnp.sum(p * (logp - logq), -1)))
    overlaps.append(jnp.mean(jnp.sum(jnp.minimum(p, jnp.exp(logq)), -1)))
  return jnp.stack(kls), jnp.stack(overlaps)


def mixed_orders(key: jax.Array, batch: int, t: int, l2r_fraction: float) -> jax.Array:
  """Per row: L2R with probability l2r_fraction, else a uniform random order."""
  k_pick, k_order = jax.random.split(key)
  l2r_B1 = (jax.random.uniform(k_pick, (batch,)) < l2r_fraction)[:, None]
  return jnp.where(l2r_B1, jnp.arange(t, dtype=jnp.int32), orders.random_orders(k_order, batch, t))


def check_settings(s: Settings, t: int) -> None:
  for name in ("num_steps", "batch_size", "log_every", "eval_batches"):
    if getattr(s, name) < 1:
      raise ValueError(f"train-draft {name}={getattr(s, name)} must be >= 1")
  if not 1 <= s.chain <= t - 1:
    raise ValueError(f"train-draft chain={s.chain} must be in [1, {t - 1}] (T - 1)")
  if not 0 <= s.l2r_fraction <= 1:
    raise ValueError(f"train-draft l2r_fraction={s.l2r_fraction} must be in [0, 1]")


def fit(
  cfg: specs.ModelSpec,
  params: Any,
  batches: Callable[[], np.ndarray],
  validation_BT: np.ndarray,
  s: Settings,
  log: Callable[[str], None] = print,
) -> tuple:
  """(head params, validation figures): s.num_steps AdamW steps on batches() with the base
  `params` frozen, then sum_x min(p, q) per draft on validation_BT in L2R and random orders."""
  check_settings(s, cfg.block_size)
  model = model_lib.make_model(cfg)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, s.learning_rate, s.warmup_steps, max(s.num_steps, s.warmup_steps + 1), s.learning_rate / 10
  )
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.0)
  )
  key = jax.random.key(s.seed)
  head_params = draft_lib.init_head(cfg, jax.random.fold_in(key, 0))
  opt_state = tx.init(head_params)

  @jax.jit
  def train_step(head_params, opt_state, params, tokens_BT, key):
    order_BT = mixed_orders(key, tokens_BT.shape[0], tokens_BT.shape[1], s.l2r_fraction)

    def loss(head_params):
      kl_J, overlap_J = chain_losses(model, params, head_params, tokens_BT, order_BT, s.chain)
      return kl_J.mean(), overlap_J

    (kl, overlap_J), grads = jax.value_and_grad(loss, has_aux=True)(head_params)
    updates, opt_state = tx.update(grads, opt_state, head_params)
    return optax.apply_updates(head_params, updates), opt_state, kl, overlap_J

  @jax.jit
  def overlaps(head_params, params, tokens_BT, order_BT):
    return chain_losses(model, params, head_params, tokens_BT, order_BT, s.chain)[1]

  start = time.perf_counter()
  for i in range(s.num_steps):
    tokens_BT = jnp.asarray(batches())
    head_params, opt_state, kl, overlap_J = train_step(
      head_params, opt_state, params, tokens_BT, jax.random.fold_in(key, i + 1)
    )
    if i == 0:  # the rate leaves out the compile; a first line says training has begun
      jax.block_until_ready(kl)
      log(
        f"train-draft step 1/{s.num_steps}: KL {float(kl):.4f} (compiled and ran in "
        f"{time.perf_counter() - start:.1f} s); progress every {s.log_every} steps"
      )
      start = time.perf_counter()
    if (i + 1) % s.log_every == 0 or i + 1 == s.num_steps:
      rate = i / max(time.perf_counter() - start, 1e-9)
      log(
        f"train-draft step {i + 1}/{s.num_steps}: KL {float(kl):.4f}, sum min(p, q) per draft "
        f"{' / '.join(f'{x:.3f}' for x in np.asarray(overlap_J))} (this batch), "
        f"{rate:.1f} steps/s"
      )
  figures = {}
  b, t = s.batch_size, cfg.block_size
  eval_key = jax.random.fold_in(key, s.num_steps + 1)
  for name in ("l2r", "random"):
    sums = []
    for i in range(0, len(validation_BT), b):
      tokens_BT = jnp.asarray(validation_BT[i : i + b])
      order_BT = mixed_orders(
        jax.random.fold_in(eval_key, i), len(tokens_BT), t, 1.0 if name == "l2r" else 0.0
      )
      sums.append(np.asarray(overlaps(head_params, params, tokens_BT, order_BT)) * len(tokens_BT))
    figures[name] = (np.sum(sums, 0) / len(validation_BT)).tolist()
  return head_params, figures


def describe(figures: dict) -> str:
  return "; ".join(f"{name}: " + " / ".join(f"{x:.3f}" for x in v) for name, v in figures.items())


def train_head(
  config: specs.Spec, params: Any, tokenizer: Any, s: Settings, log: Callable[[str], None] = print
) -> tuple:
  """(head params, validation figures, validation blocks) of a head fit to a run's `params` on
  its training split (prepared first if needed), validated on its validation split."""
  from ao_mdm.data import pipeline, prepare

  cfg, t = config.model, config.model.block_size
  check_settings(s, t)
  splits = {
    name: prepare.ensure(config.data, tokenizer, name, log=log) for name in ("train", "validation")
  }
  data = pipeline.train_iterator(
    splits["train"].blocks(t),
    global_batch_size=s.batch_size,
    seed=s.seed,
    process_index=0,
    process_count=1,
  )
  validation_BT = pipeline.eval_blocks(
    splits["validation"], t, max_blocks=s.eval_batches * s.batch_size
  )
  n_head = model_lib.count_params(
    jax.eval_shape(lambda: draft_lib.init_head(cfg, jax.random.key(0)))
  )
  log(
    f"training a draft head ({n_head:,} parameters): {s.num_steps} steps of {s.batch_size} x "
    f"{t} tokens, chain {s.chain}"
  )
  head_params, figures = fit(cfg, params, lambda: next(data), validation_BT, s, log)
  return head_params, figures, len(validation_BT)
