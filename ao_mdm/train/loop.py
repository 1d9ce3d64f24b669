"""The training loop: logging, validation, checkpoints, preemption (docs/design.md,
"Training"); the step itself is train/step.py."""

from collections.abc import Callable
import json
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import hardware, profiler, sharding, specs
from ao_mdm import model as model_lib
from ao_mdm.checkpoint import checkpoints, layout
from ao_mdm.data import pairs, sudoku
from ao_mdm.eval import perplexity, scoring
from ao_mdm.runtime import interrupts
from ao_mdm.storage import fs, gcs
from ao_mdm.train import cluster, finetune, grpo, records
from ao_mdm.train import step as train_step


def format_metrics(m: dict) -> str:
  return " ".join(f"{k}={float(v):.4g}" for k, v in m.items())


def _on_process_0(log: Callable[[str], None]) -> Callable[[str], None]:
  """`log` on process 0; nothing on the others (each line once per run, not once per host)."""
  return log if jax.process_index() == 0 else lambda message: None


class _StartClock:
  """Wall seconds of each phase of a start, from the process's own start to the first step
  (what a restart after a preemption costs; `ao-mdm bench restart` reads them)."""

  def __init__(self) -> None:
    import psutil

    self.last = psutil.Process().create_time()
    self.phases: dict = {}

  def mark(self, phase: str) -> None:
    now = time.time()
    self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
    self.last = now


def train_and_evaluate(
  config: specs.Spec,
  workdir: str,
  init_from: str | None = None,
  start_over: bool = False,
  log: Callable[[str], None] = print,
  stop: interrupts.StopRequest | None = None,
) -> dict:
  """Train on config.data, log, evaluate and checkpoint to workdir; return the eval losses.

  Resumes from the newest readable checkpoint in workdir (newer unreadable ones are moved
  aside); otherwise starts from scratch or, with init_from, from the params of an export or
  imported checkpoint (a warm start). If no checkpoint reads, it stops unless `start_over`.
  One run per work dir (checkpoints.WorkdirLock). Progress goes to `log`, on process 0 only.
  SIGTERM and Ctrl-C (`stop`, made here unless given: the command line makes it before joining
  the other processes) save a checkpoint at a step boundary that every process agrees on.
  """
  own_stop = stop is None
  stop = interrupts.StopRequest() if stop is None else stop
  try:
    return _train_and_evaluate(config, workdir, init_from, start_over, _on_process_0(log), stop)
  finally:
    if own_stop:
      stop.restore()


def _train_and_evaluate(
  config: specs.Spec,
  workdir: str,
  init_from: str | None,
  start_over: bool,
  say: Callable[[str], None],
  stop: interrupts.StopRequest,
) -> dict:
  clock = _StartClock()
  cluster.note_checkpoint(workdir, cluster.UNLISTED)  # what a stop names until steps are listed
  clock.mark("process_and_imports")
  jax.devices()
  clock.mark("jax")
  if init_from and layout.has_checkpoints(workdir):
    raise ValueError(
      f"--init_from {init_from} given, but --workdir {workdir} already holds "
      "checkpoints; to resume that run, drop --init_from; to warm-start, give a "
      "new --workdir"
    )
  program = train_step.make_program(config)
  program.check_fits()
  clock.mark("program")
  init_params = _init_params(config, init_from, say) if init_from else None
  lock = checkpoints.WorkdirLock(workdir, log=say) if jax.process_index() == 0 else None
  release = lock.release if lock else lambda: None
  try:
    with interrupts.on_interrupt(release):  # a new work dir holding only the lock goes too
      return _train(program, workdir, init_params, init_from, start_over, lock, clock, say, stop)
  except TimeoutError as e:  # storage stopped answering: say what is saved, and exit at once
    raise gcs.Stuck(f"{e}; training stopped: {cluster.newest_checkpoint()}") from None
  finally:
    release()


def _train(
  program: train_step.Program,
  workdir: str,
  init_params: Any,
  init_from: str | None,
  start_over: bool,
  lock: checkpoints.WorkdirLock | None,
  clock: _StartClock,
  say: Callable[[str], None],
  stop: interrupts.StopRequest,
) -> dict:
  from jax.experimental import multihost_utils

  from ao_mdm.data import pipeline
  from ao_mdm.data import tokenizer as tok_lib

  config, train = program.config, program.config.train
  if config.data.pairs:  # fine-tuning: rows of prompt/response pairs
    pair_data = finetune.PairData(config, workdir, init_from, say)
    source: pipeline.RowSource = pair_data.train
  elif config.data.dataset == sudoku.NAME:  # generated grids, one a row
    sudoku.check_run(config)
    tokenizer = tok_lib.run_tokenizer(config, workdir)  # checks the model's vocab
    source = sudoku.Grids(sudoku.ROWS, config.seed)
    n_eval = train.eval_batches * train.batch_size
    eval_sets = {  # validation: held-out grids, which no training row is
      "train": source.rows(range(n_eval)),
      "validation": sudoku.Grids(n_eval, config.seed, "heldout").rows(range(n_eval)),
    }
    train_counts = lambda: np.bincount(eval_sets["train"].ravel(), minlength=tokenizer.vocab_size)
  else:
    tokenizer = tok_lib.run_tokenizer(config, workdir)
    splits = {
      split: _prepared(config.data, tokenizer, split, say) for split in ("train", "validation")
    }
    source = splits["train"].blocks(config.model.block_size)
    eval_sets = {
      split: pipeline.eval_blocks(
        prepared_split, config.model.block_size, max_blocks=train.eval_batches * train.batch_size
      )
      for split, prepared_split in splits.items()
    }
    train_counts = splits["train"].token_counts
  grpo_on = bool(config.grpo.reward)  # a step's batch: answers drawn to B / group prompts
  data_iter = pipeline.train_iterator(
    source,
    global_batch_size=train.batch_size // (config.grpo.group if grpo_on else 1),
    seed=config.seed,
  )
  clock.mark("data")
  if jax.process_index() == 0:
    checkpoints.clean_workdir(workdir, say)
  multihost_utils.sync_global_devices("work dir cleaned")
  mgr = checkpoints.train_manager(workdir, train.keep_checkpoints)
  cluster.note_checkpoint(workdir, mgr.latest_step())  # what a stop while restoring names

  def check(saved, _):
    diffs = saved.model.shape_differences(config.model)
    if diffs:
      raise ValueError(
        f"--workdir {workdir} holds a checkpoint of a different model: "
        + "; ".join(diffs)
        + ". Use a new work dir or the matching config."
      )

  skipped: list[int] = []
  found = checkpoints.restore_newest(
    mgr,
    lambda step, _: checkpoints.restore(mgr, step, program.abstract_state, data_iter),
    check,
    log=say,
    skipped=skipped,
  )
  if found is None and skipped and not start_over:
    raise ValueError(
      f"no checkpoint in {mgr.directory} can be read (steps {', '.join(map(str, skipped))}, "
      "each listed above); they are left as they are. To train from step 0 anyway, run again "
      f"with --start_over (they are first moved to {layout.SET_ASIDE}/)"
    )
  if skipped:  # so that checkpointing goes on past them
    if jax.process_index() == 0:
      for step in skipped:
        checkpoints.set_aside(workdir, str(step), "unreadable", say)
      if found is None:  # --start_over: a run from step 0 starts its records anew too
        for name in (layout.METRICS, layout.TENSORBOARD):
          if fs.exists(fs.join(workdir, name)):
            checkpoints.set_aside(workdir, name, "start-over", say, under="")
    multihost_utils.sync_global_devices("unreadable checkpoints set aside")
    checkpoints.probed(str(mgr.directory), mgr.reload)
  start = None
  if found is not None:
    start, _, state = found
    cluster.note_checkpoint(workdir, start)
    say(f"resumed from step {start} in {workdir}")
    if jax.process_index() == 0:
      records.drop_after(workdir, start)
  else:
    cluster.note_checkpoint(workdir, None)
    state = program.init_state()
    if init_params is not None:
      params = jax.device_put(init_params, program.shardings.params)
      state = state.replace(params=params, ema_params=jax.tree.map(jnp.copy, params))
      say(f"initialised params from {init_from}")
  rollouts = None
  if grpo_on:
    reference = grpo.reference_params(
      config, workdir, init_params, found is not None, program.shardings.params, say
    )
    rollouts = grpo.Rollouts(config, pair_data.tokenizer, reference, program.batch_sharding)
  clock.mark("restore")
  # Validation goes through the scorer of `ao-mdm eval`, on the training mesh.
  scorer = scoring.Scorer(state.ema_params, config.model, config.mesh)

  eval_batch = train.batch_size // train.microbatches
  if config.data.pairs:  # the responses' NLL given their prompts

    def run_eval(params, splits=("train", "validation")):
      scorer.set_params(params)
      return pair_data.evaluate(scorer, splits, seed=config.seed, batch_size=eval_batch)

  else:
    counts = _unigram_counts(train_counts, workdir)
    unigram = {split: perplexity.unigram_nll(counts, b) for split, b in eval_sets.items()}

    def run_eval(params, splits=("train", "validation")):
      scorer.set_params(params)
      out = {}
      for split in splits:
        r = perplexity.evaluate_blocks(
          scorer, eval_sets[split], seed=config.seed, batch_size=eval_batch
        )
        out[split] = {"l2r": r["l2r_nll"], "random": r["any_order_nll"], "unigram": unigram[split]}
      return out

  run_log = records.RunLog(
    workdir,
    active=jax.process_index() == 0,
    wandb_project=train.wandb_project,
    config=config.to_dict(),
  )
  run_log.text(int(state.step), "config", f"```\n{json.dumps(config.to_dict(), indent=2)}\n```")
  table = sharding.parameter_table(state.params, shardings=True)
  run_log.text(int(state.step), "parameters", f"```\n{table}\n```")
  say(table)
  n_params = model_lib.count_params(state.params)
  work = records.StepWork(  # GRPO makes grpo.updates passes over a batch
    lambda width: model_lib.flops_per_token(config.model, n_params, width) * config.grpo.updates,
    train.batch_size,
    pairs.EXTRA if config.data.pairs else 0,
  )
  peak = train.peak_flops_per_device * jax.device_count()
  if peak <= 0 and jax.default_backend() == "cpu":  # CPU devices share one host's cores
    peak = hardware.matmul_peak(1024, model_lib.DTYPES[config.model.dtype]) * jax.process_count()
    say(
      f"measured matmul peak {peak / 1e9:.1f} GFLOP/s, best of 5 (for MFU; set "
      "train.peak_flops_per_device to skip)"
    )
  elif peak <= 0:
    peak = hardware.peak_flops(jax.devices()) * jax.device_count()
    kind = jax.devices()[0].device_kind
    say(
      f"MFU against {peak / jax.device_count() / 1e12:.0f} TFLOP/s per {kind} (dense bf16)"
      if peak
      else f"no peak FLOP/s known for {kind}: no MFU (set train.peak_flops_per_device)"
    )

  def log_metrics(step: int, values: dict, seconds: float | None) -> None:
    nonlocal peak
    finite.check(saved)
    values = {k: float(v) for k, v in values.items()}
    for share in ("loss_l2r", "loss_any_order"):  # NaN: the batch held no sequence of that kind
      if math.isnan(values[share]):
        del values[share]
    tokens, flops = work.read(step)
    if seconds:
      values["step_s"] = seconds
      values["tokens_per_s"] = tokens / seconds
      values["tokens_per_s_per_device"] = tokens / seconds / jax.device_count()
      if 0 < peak < flops / seconds:  # the start-up measurement was low (a busy machine)
        peak = flops / seconds
        say(f"MFU is against {peak / 1e9:.1f} GFLOP/s from now on, the rate this step ran at")
      if peak > 0:
        values["mfu"] = flops / seconds / peak
    run_log.scalars(step, values)
    run_log.flush()
    say(f"step {step}: {format_metrics(values)}")

  results = {}
  if start is None:
    results["initial"] = run_eval(state.params)
    say(f"step 0 eval: {_format_eval(results['initial'])}")
  first = int(state.step)
  clock.mark("setup")
  agree = cluster.StopAgreement(program.mesh)
  profile = profiler.Window(
    fs.join(workdir, layout.PROFILE), train.profile_start_step, train.profile_steps, say
  )
  pending, window = None, None  # (step, metrics) of the previous step; (time, step) of a read
  means = records.WindowMeans()  # what a logged step shows: the means since the last one
  saved = None  # the step of the last checkpoint written, checked at the next save
  finite = records.FirstNonFinite()  # read before each log, eval and save
  try:
    for step in range(first, train.num_steps):
      batch, drawn = next(data_iter), dict[str, float]()
      if rollouts is not None:  # the answers to these prompts, already global
        batch, drawn = rollouts(state.params, batch, step)
      else:
        batch = program.global_batch(batch)
      with profile.step(step):
        state, metrics = program.step(state, batch)
      metrics = {**metrics, **drawn}
      work.add(step + 1, batch)
      finite.add(step + 1, metrics)
      profile.after(step, metrics)
      if step == first:  # the start, phase by phase, once its first step has run
        jax.block_until_ready(metrics)
        clock.mark("first_step")
        run_log.scalars(step + 1, {f"startup/{k}_s": v for k, v in clock.phases.items()})
        say(
          f"first step {sum(clock.phases.values()):.1f} s after the process started: "
          + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in clock.phases.items())
        )
      if pending is not None:  # the previous step's metrics, read while this step runs
        window = _maybe_log(pending, window, train, log_metrics, means)
      pending = (step + 1, metrics)
      done = step + 1
      if train.eval_every and done % train.eval_every == 0 and done < train.num_steps:
        finite.check(saved)
        ev = run_eval(state.ema_params, ("validation",))["validation"]
        scalars = {"eval/l2r_loss": ev["l2r"], "eval/any_order_loss": ev["random"]}
        run_log.scalars(done, scalars)
        run_log.flush()
        say(f"step {done} eval (EMA): validation l2r={ev['l2r']:.4f} random={ev['random']:.4f}")
      # Every process gets the same code: a stop asked anywhere stops all at this step.
      code = agree(cluster.LEASE_LOST if lock is not None and lock.lost else stop.code)
      if code == cluster.LEASE_LOST:
        raise OSError(
          f"another process took over the lock of --workdir {workdir} (this run "
          "stalled past its lease); stopping rather than write beside it"
        )
      stopping = code > 0
      if stopping or done % train.checkpoint_every == 0 or done == train.num_steps:
        # The saved step's record goes first: a kill after the save cannot lose it (the
        # restart begins after that step). The save waits for the step anyway.
        window = _maybe_log(pending, window, train, log_metrics, means, force=stopping)
        pending = None
        finite.check(saved, done, (state.params, state.ema_params))
        if saved is not None:
          checkpoints.check_saved(mgr, saved)
          cluster.note_checkpoint(workdir, saved)
        if not checkpoints.save(mgr, done, state, data_iter, config, force=stopping):
          raise OSError(
            f"Orbax declined to save step {done} in {mgr.directory} (a step "
            "directory at or above it?); training stops rather than go on unsaved"
          )
        saved = done
      if stopping:
        checkpoints.check_saved(mgr, done)
        cluster.note_checkpoint(workdir, done)
        how = "interrupted" if code == interrupts.STOP_INT else "preempted"
        say(f"{how}: saved a checkpoint at step {done} in {workdir}; exiting")
        return {"preempted_at": done, "exit_code": 130 if code == interrupts.STOP_INT else 0}
    if pending is not None:
      _maybe_log(pending, window, train, log_metrics, means, force=True)
    if saved is not None:
      checkpoints.check_saved(mgr, saved)
      cluster.note_checkpoint(workdir, saved)
  finally:
    profile.close()
    checkpoints.wait_for_saves(mgr)
    run_log.flush()
    run_log.close()
  results["final_ema"] = run_eval(state.ema_params)
  say(f"final eval (EMA params): {_format_eval(results['final_ema'])}")
  v = results["final_ema"]["validation"]
  say(
    f"validation perplexity: any-order {math.exp(v['random']):.1f}, L2R "
    f"{math.exp(v['l2r']):.1f}, unigram {math.exp(v['unigram']):.1f} (any-order / unigram = "
    f"{math.exp(v['random'] - v['unigram']):.2f})"
  )
  return results


def _maybe_log(
  pending: tuple,
  window: tuple | None,
  train: specs.TrainSpec,
  log_metrics: Callable,
  means: records.WindowMeans,
  force: bool = False,
) -> tuple:
  """Adds a step's metrics to the window's means and logs them every log_every steps, with
  tokens/s over the steps since the last read.

  The first read only starts the clock, so compilation never counts.
  """
  done, values = pending
  means.add(values)
  due = force or done % train.log_every == 0 or done == train.num_steps
  if not due and window is not None:
    return window
  jax.block_until_ready(values)
  now = time.perf_counter()
  if due:
    rate_window = (
      None if window is None or done == window[1] else (now - window[0]) / (done - window[1])
    )
    log_metrics(done, means.read(), rate_window)
  return now, done


def _init_params(config: specs.Spec, init_from: str, say: Callable[[str], None]) -> Any:
  """The params of an export or import, refused unless the model shape matches the config."""
  saved, params = checkpoints.load_params(  # read straight into the training mesh's layout
    init_from, log=say, shardings=lambda c: sharding.param_shardings(c.model, config.mesh)
  )
  diffs = saved.model.shape_differences(config.model)
  if diffs:
    raise ValueError(f"--init_from {init_from} holds a different model: " + "; ".join(diffs))
  return params


def _format_eval(r: dict) -> str:
  return "  ".join(
    f"{split}: l2r={v['l2r']:.4f} random={v['random']:.4f} (unigram {v['unigram']:.4f})"
    for split, v in r.items()
  )


def _unigram_counts(train_counts: Callable[[], np.ndarray], workdir: str) -> np.ndarray:
  """Token counts of the training split (from its preparation), saved with the run and its
  export so that `ao-mdm eval` reports the same baseline."""
  path = fs.join(workdir, perplexity.UNIGRAM_FILE)
  if fs.isfile(path):
    return fs.read_npy(path)
  counts = train_counts()
  if jax.process_index() == 0:
    fs.write_npy(path, counts)
  return counts


def _prepared(data_config: specs.DataSpec, tokenizer, split: str, say: Callable[[str], None]):
  """The prepared split, prepared here first if needed (each process its range of shards)."""
  from jax.experimental import multihost_utils

  from ao_mdm.data import prepare

  return prepare.ensure(
    data_config,
    tokenizer,
    split,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    barrier=multihost_utils.sync_global_devices,
    all_true=lambda x: bool(np.all(multihost_utils.process_allgather(np.asarray(x)))),
    log=say,
  )
