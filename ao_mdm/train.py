"""The jitted train and eval steps and the training loop (DESIGN.md section 5)."""
import json
import math
import os
import signal
import time
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from ao_mdm import checkpoints
from ao_mdm import model as model_lib
from ao_mdm import orders
from ao_mdm import sharding
from ao_mdm import train_state
from ao_mdm.train_state import TrainState


def validate_train_config(config: ml_collections.ConfigDict) -> None:
  """Raise one clear ValueError for training settings that cannot work."""
  t = config.train
  model_lib.validate_model_config(config.model)
  orders.validate_order_config(config.order, config.model.block_size)
  for key in ("batch_size", "num_steps", "microbatches", "log_every"):
    if int(t[key]) < 1:
      raise ValueError(f"train.{key}={t[key]} must be >= 1")
  if int(t.lr_decay_steps) < 0:
    raise ValueError(f"train.lr_decay_steps={t.lr_decay_steps} must be >= 0 (0: num_steps)")
  if t.batch_size % t.microbatches:
    raise ValueError(f"train.batch_size={t.batch_size} is not divisible by "
                     f"train.microbatches={t.microbatches}")
  if not 0.0 <= t.ema_decay < 1.0:
    raise ValueError(f"train.ema_decay={t.ema_decay} must be in [0, 1)")


def sequence_nll(model: nn.Module, params: Any, tokens_BT: jax.Array,
                 order_BT: jax.Array) -> jax.Array:
  """Mean NLL per sequence under the given order, float32, from integer labels."""
  return jnp.mean(model_lib.slot_nll(model, params, tokens_BT, order_BT), axis=1)


SHARE_KEYS = ("loss_sum", "count", "l2r_sum", "l2r_count", "ao_sum", "ao_count")


def _split_shares(nll_B: jax.Array, l2r_B: jax.Array) -> dict:
  """Sums and counts for the overall, L2R-order and any-order (non-identity) losses."""
  l2r = l2r_B.astype(jnp.float32)
  return {"loss_sum": jnp.sum(nll_B), "count": jnp.float32(nll_B.shape[0]),
          "l2r_sum": jnp.sum(nll_B * l2r), "l2r_count": jnp.sum(l2r),
          "ao_sum": jnp.sum(nll_B * (1 - l2r)), "ao_count": jnp.sum(1 - l2r)}


def make_train_step(config: ml_collections.ConfigDict) -> Callable:
  """(state, tokens_BT) -> (state, metrics); gradient accumulation inside via lax.scan."""
  model = model_lib.make_model(config.model)
  tx = train_state.make_optimizer(config.train)
  order_fn = orders.make_order_fn(config.order, config.model.block_size)
  n_micro = int(config.train.microbatches)
  ema_decay = float(config.train.ema_decay)
  schedule = train_state.learning_rate_schedule(config.train)

  def micro_loss(params, tokens_bT, key):
    order_bT = order_fn(key, tokens_bT.shape[0])
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
      grads, shares = grad_fn(state.params, tokens_bT, jax.random.fold_in(key, m))
      return jax.tree.map(jnp.add, carry, (grads, shares)), None

    zeros = (jax.tree.map(jnp.zeros_like, state.params),
             {k: jnp.zeros((), jnp.float32) for k in SHARE_KEYS})
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
        "loss_l2r": shares["l2r_sum"] / jnp.where(shares["l2r_count"] > 0, shares["l2r_count"], jnp.nan),
        "loss_any_order": shares["ao_sum"] / jnp.where(shares["ao_count"] > 0, shares["ao_count"], jnp.nan),
        "l2r_fraction": shares["l2r_count"] / shares["count"],
        "grad_norm": optax.global_norm(grads),
        "learning_rate": schedule(state.step),
    }
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              ema_params=ema)
    return new_state, metrics

  return step


def jit_train_step(config, mesh, axis_rules, shardings) -> Callable:
  """The train step jitted with explicit shardings and the state donated."""
  step = make_train_step(config)
  batch = sharding.batch_sharding(mesh, axis_rules)
  jitted = jax.jit(step, in_shardings=(shardings, batch),
                   out_shardings=(shardings, sharding.replicated(mesh)), donate_argnums=0)

  def run(state, tokens_BT):
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules):
      return jitted(state, tokens_BT)
  run.jitted = jitted
  return run


def make_eval_fn(config: ml_collections.ConfigDict, mesh, axis_rules) -> Callable:
  """(params, tokens_BT, key) -> {l2r, random} mean NLL of the batch, jitted."""
  model = model_lib.make_model(config.model)
  t = config.model.block_size

  @jax.jit
  def evaluate(params, tokens_BT, key):
    b = tokens_BT.shape[0]
    l2r = sequence_nll(model, params, tokens_BT, orders.identity(b, t))
    rnd = sequence_nll(model, params, tokens_BT, orders.random_orders(key, b, t))
    return {"l2r": jnp.mean(l2r), "random": jnp.mean(rnd)}

  def run(params, tokens_BT, key):
    with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules):
      return evaluate(params, tokens_BT, key)
  return run


def format_metrics(m: dict) -> str:
  return " ".join(f"{k}={float(v):.4g}" for k, v in m.items())


def evaluate_blocks(eval_fn: Callable, params: Any, blocks_NT: np.ndarray, batch_size: int,
                    seed: int, batch_sharding) -> dict:
  """Mean L2R and random-order NLL over whole batches of `blocks_NT`."""
  n = (len(blocks_NT) // batch_size) * batch_size
  if n == 0:
    raise ValueError(f"{len(blocks_NT)} evaluation blocks are fewer than one batch of "
                     f"{batch_size}")
  totals = {"l2r": 0.0, "random": 0.0}
  procs = jax.process_count()
  for i in range(0, n, batch_size):
    rows = blocks_NT[i:i + batch_size]  # every process holds them all; each feeds its share
    tokens = sharding.global_batch(rows.reshape(procs, -1, rows.shape[1])[jax.process_index()],
                                   batch_sharding)
    out = eval_fn(params, tokens, jax.random.fold_in(jax.random.key(seed), i))
    totals = {k: totals[k] + float(out[k]) for k in totals}
  return {k: v / (n // batch_size) for k, v in totals.items()}


def _model_differences(saved: ml_collections.ConfigDict, current: ml_collections.ConfigDict) -> list:
  keys = ("variant", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "cond_dim")
  return [f"model.{k}: checkpoint {saved[k]} vs config {current[k]}" for k in keys
          if saved.get(k) != current.get(k)]


def _restore_latest(mgr, config, target, data_iter, workdir: str):
  """Restore the newest checkpoint that loads; report and skip broken ones. None if none."""
  for step in sorted(mgr.all_steps(), reverse=True):
    try:
      saved = checkpoints.read_config(workdir, step)
    except Exception as e:  # pylint: disable=broad-except
      _log(f"checkpoint {mgr.directory / str(step)} cannot be read ({type(e).__name__}: {e}); "
           "trying the previous one")
      continue
    diffs = _model_differences(saved.model, config.model)
    if diffs:
      raise ValueError(f"--workdir {workdir} holds a checkpoint of a different model: "
                       + "; ".join(diffs) + ". Use a new work dir or the matching config.")
    try:
      return step, checkpoints.restore(mgr, step, target, data_iter)
    except Exception as e:  # pylint: disable=broad-except
      _log(f"checkpoint {mgr.directory / str(step)} failed to restore ({type(e).__name__}: "
           f"{e}); trying the previous one")
  return None, None


def _log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


class _Preemption:
  """Remembers a SIGTERM so that training saves at the next step boundary and exits 0."""

  def __init__(self):
    self.requested = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)


def _metric_writer(workdir: str):
  from clu import metric_writers  # pylint: disable=g-import-not-at-top  (imports TensorFlow)
  return metric_writers.create_default_writer(
      os.path.join(workdir, "tensorboard"), just_logging=jax.process_index() > 0)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       init_from: Optional[str] = None) -> dict:
  """Train on config.data, log, evaluate and checkpoint to workdir; return the eval losses.

  Resumes from the newest complete checkpoint in workdir; otherwise starts from scratch or,
  with init_from, from the params of an export or imported checkpoint (a warm start).
  """
  from clu import periodic_actions  # pylint: disable=g-import-not-at-top
  from ao_mdm.data import datasets, pipeline, tokenizer as tok_lib  # pylint: disable=g-import-not-at-top

  validate_train_config(config)
  t = config.train
  mesh = sharding.make_mesh(config.mesh)
  axis_rules = sharding.rules(config.mesh)
  dp = sharding.data_parallel_size(mesh, axis_rules)
  if t.batch_size % (dp * t.microbatches):
    raise ValueError(f"train.batch_size={t.batch_size} must be divisible by the data-parallel "
                     f"size {dp} times train.microbatches={t.microbatches}")
  tfds_dir = datasets.resolve_tfds_dir(config.data.tfds_dir)
  tokenizer = tok_lib.get_tokenizer(config.data, config.model.vocab_size, workdir)
  tok_lib.check_vocab(tokenizer, config.model.vocab_size)
  data_iter = pipeline.train_iterator(
      config.data, tokenizer, block_size=config.model.block_size, global_batch_size=t.batch_size,
      seed=config.seed, tfds_dir=tfds_dir)
  eval_sets = {
      split: pipeline.eval_blocks(config.data, tokenizer, block_size=config.model.block_size,
                                  split=split, tfds_dir=tfds_dir,
                                  max_blocks=t.eval_batches * t.batch_size)
      for split in ("train", "validation")}

  shardings = train_state.state_shardings(config, mesh, axis_rules)
  state = train_state.create_state(config, mesh, axis_rules)
  mgr = checkpoints.train_manager(workdir, t.keep_checkpoints)
  target = checkpoints.abstract_like(jax.eval_shape(lambda: state), shardings)
  start, restored = _restore_latest(mgr, config, target, data_iter, workdir)
  if restored is not None:
    state = restored
    _log(f"resumed from step {start} in {workdir}")
  elif init_from:
    state = _warm_start(state, config, init_from, shardings)
    _log(f"initialised params from {init_from}")
  train_step = jit_train_step(config, mesh, axis_rules, shardings)
  eval_fn = make_eval_fn(config, mesh, axis_rules)
  batch = sharding.batch_sharding(mesh, axis_rules)
  run_eval = lambda params, splits=("train", "validation"): {
      split: evaluate_blocks(eval_fn, params, eval_sets[split], t.batch_size, config.seed, batch)
      for split in splits}

  writer = _metric_writer(workdir)
  if jax.process_index() == 0:
    writer.write_hparams({k: v for k, v in config.train.items()})
  report = periodic_actions.ReportProgress(num_train_steps=t.num_steps, writer=writer)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  tokens_per_step = t.batch_size * config.model.block_size
  flops_per_step = tokens_per_step * model_lib.flops_per_token(
      config.model, model_lib.count_params(state.params))
  peak = t.peak_flops_per_device * jax.device_count()
  if peak <= 0 and jax.default_backend() == "cpu":  # CPU devices share one host's cores
    peak = sharding.matmul_peak(1024, model_lib.DTYPES[config.model.dtype]) * jax.process_count()
    _log(f"measured matmul peak {peak / 1e9:.1f} GFLOP/s (for MFU; set "
         "train.peak_flops_per_device to skip)")

  def log_metrics(step: int, values: dict, seconds: Optional[float]) -> None:
    values = {k: float(v) for k, v in values.items()}
    for share in ("loss_l2r", "loss_any_order"):  # NaN: the batch held no sequence of that kind
      if math.isnan(values[share]):
        del values[share]
    if seconds:
      values["tokens_per_s"] = tokens_per_step / seconds
      if peak > 0:
        values["mfu"] = flops_per_step / seconds / peak
    writer.write_scalars(step, values)
    if jax.process_index() == 0:
      with open(metrics_path, "a") as f:
        strict = {k: v if math.isfinite(v) else None for k, v in values.items()}  # JSON: no NaN
        f.write(json.dumps({"step": step, **strict}) + "\n")
    _log(f"step {step}: {format_metrics(values)}")

  results = {}
  if start is None:
    results["initial"] = run_eval(state.params)
    _log(f"step 0 eval: {_format_eval(results['initial'])}")
  first = int(state.step)
  preemption = _Preemption()
  pending, window = None, None  # (step, metrics) of the previous step; (time, step) of a read
  try:
    for step in range(first, t.num_steps):
      tokens = sharding.global_batch(next(data_iter), batch)
      state, metrics = train_step(state, tokens)
      if pending is not None:  # the previous step's metrics, read while this step runs
        window = _maybe_log(pending, window, t, log_metrics)
        report(pending[0])
      pending = (step + 1, metrics)
      done = step + 1
      if t.eval_every and done % t.eval_every == 0 and done < t.num_steps:
        ev = run_eval(state.ema_params, ("validation",))["validation"]
        scalars = {"eval/l2r_loss": ev["l2r"], "eval/any_order_loss": ev["random"]}
        writer.write_scalars(done, scalars)
        if jax.process_index() == 0:
          with open(metrics_path, "a") as f:
            f.write(json.dumps({"step": done, **scalars}) + "\n")
        _log(f"step {done} eval (EMA): validation l2r={ev['l2r']:.4f} random={ev['random']:.4f}")
      stop = preemption.requested or mgr.reached_preemption(done)
      if stop or done % t.checkpoint_every == 0 or done == t.num_steps:
        checkpoints.save(mgr, done, state, data_iter, config, force=stop)
      if stop:
        mgr.wait_until_finished()
        _log(f"preempted: saved a checkpoint at step {done} in {workdir}; exiting")
        return {"preempted_at": done}
    if pending is not None:
      _maybe_log(pending, window, t, log_metrics, force=True)
  finally:
    preemption.restore()
    mgr.wait_until_finished()
    writer.flush()
  results["final_ema"] = run_eval(state.ema_params)
  _log(f"final eval (EMA params): {_format_eval(results['final_ema'])}")
  return results


def _maybe_log(pending: tuple, window: Optional[tuple], t, log_metrics: Callable,
               force: bool = False) -> tuple:
  """Log step metrics every log_every steps; tokens/s over the steps since the last read.

  The first read only starts the clock, so compilation never counts.
  """
  done, values = pending
  due = force or done % t.log_every == 0 or done == t.num_steps
  if not due and window is not None:
    return window
  values = jax.device_get(values)
  now = time.perf_counter()
  if due:
    rate_window = None if window is None or done == window[1] else (now - window[0]) / (done - window[1])
    log_metrics(done, values, rate_window)
  return now, done


def _warm_start(state: TrainState, config, init_from: str, shardings) -> TrainState:
  """Replace params and EMA params with those of an export (same model shape required)."""
  saved, params = checkpoints.load_params(init_from)
  diffs = _model_differences(saved.model, config.model)
  if diffs:
    raise ValueError(f"--init_from {init_from} holds a different model: " + "; ".join(diffs))
  params = jax.device_put(params, shardings.params)
  return state.replace(params=params, ema_params=jax.tree.map(jnp.copy, params))


def _format_eval(r: dict) -> str:
  return "  ".join(f"{split}: l2r={v['l2r']:.4f} random={v['random']:.4f}" for split, v in r.items())
