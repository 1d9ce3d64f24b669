"""`ao-mdm bench train`: the sharded train step's steady-state time, tokens/s and MFU, and with
--baseline=torch the same model, step and batch in plain PyTorch, in one run."""

from collections.abc import Callable
import importlib.util
import json
import os
import statistics
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from ao_mdm import hardware, specs
from ao_mdm import model as model_lib
from ao_mdm.train import step as train_step

BASELINES = ("torch",)


def bench_train(
  config: specs.Spec,
  bench: ml_collections.ConfigDict | None = None,
  baseline: str | None = None,
  log: Callable[[str], None] = print,
) -> dict:
  """Steady-state step time, tokens/s and MFU of the sharded train step; logs them, then JSON.

  Any training config works; its `bench` section (repeats, matmul_size) is optional. With
  baseline="torch" the same model and step in plain PyTorch (eager, float32, all cores; see
  interop/torch_reference.py) then trains from the same initial params on the same batch, and the
  result adds its tokens/s and our speed over it.
  """
  if baseline not in (None, *BASELINES):
    raise ValueError(f"baseline={baseline!r}; accepted: {', '.join(BASELINES)} (or None)")
  if baseline and jax.process_count() > 1:
    raise ValueError(
      f"baseline={baseline!r} runs in a single process; got {jax.process_count()} processes"
    )
  if baseline:  # refuse a config the PyTorch step cannot run before ours runs
    _torch_reference().check_train_config(config)
  program = train_step.make_program(config)
  state, step = program.init_state(), program.step
  initial_params = jax.device_get(state.params) if baseline else None  # the step donates state
  b, t = config.train.batch_size, config.model.block_size
  local_tokens = (
    np.random.default_rng(0)
    .integers(0, config.model.vocab_size, (b // jax.process_count(), t))
    .astype(np.int32)
  )
  tokens = program.global_batch(local_tokens)
  start = time.perf_counter()
  for _ in range(2):
    state, metrics = step(state, tokens)
  jax.block_until_ready(metrics)
  warmup_s = time.perf_counter() - start
  bench = bench or ml_collections.ConfigDict({"repeats": 10, "matmul_size": 2048})
  times = []
  for _ in range(int(bench.repeats)):
    start = time.perf_counter()
    state, metrics = step(state, tokens)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times)
  n_params = model_lib.count_params(state.params)
  flops_per_token = model_lib.flops_per_token(config.model, n_params)
  peak = hardware.matmul_peak(int(bench.matmul_size), model_lib.DTYPES[config.model.dtype])
  tokens_per_s = b * t / step_s
  result = {
    "tokens_per_s": tokens_per_s,
    "mfu": flops_per_token * tokens_per_s / (peak * jax.device_count()),
    "matmul_peak_flops": peak,
    "step_s": step_s,
    "warmup_and_compile_s": warmup_s,
    "flops_per_token": flops_per_token,
    "params": n_params,
    "devices": jax.device_count(),
    "batch_size": b,
    "block_size": t,
  }
  log(
    f"train step: {step_s * 1e3:.1f} ms, {tokens_per_s:.0f} tokens/s, "
    f"MFU {result['mfu']:.1%} of the measured matmul peak {peak / 1e9:.1f} GFLOP/s "
    f"per device ({jax.device_count()} devices)"
  )
  if baseline:
    del state, metrics
    result.update(_torch_baseline(config, initial_params, local_tokens, int(bench.repeats), log))
    result["ratio_vs_torch"] = tokens_per_s / result["torch_tokens_per_s"]
    log(f"ours / PyTorch: {result['ratio_vs_torch']:.2f}x")
  log(json.dumps(result))
  return result


def _torch_reference():
  """ao_mdm.interop.torch_reference, or one clear ImportError when PyTorch is not installed."""
  if importlib.util.find_spec("torch") is None:
    raise ImportError("--baseline=torch needs PyTorch: pip install -e '.[torch]'")
  from ao_mdm.interop import torch_reference

  return torch_reference


def _torch_baseline(
  config: specs.Spec, params: Any, tokens_BT: np.ndarray, repeats: int, log: Callable[[str], None]
) -> dict:
  """The PyTorch eager float32 step from the same params on the same batch: 2 warm-up steps,
  then the median of `repeats` steps, orders drawn in each step, on all the cores JAX uses."""
  import torch

  torch_reference = _torch_reference()
  threads = len(os.sched_getaffinity(0))
  torch.set_num_threads(threads)
  trainer = torch_reference.Trainer(params, config)
  times = torch_reference.time_steps(
    trainer, tokens_BT, torch_reference.order_ratio(config.order), warmup=2, repeats=repeats
  )
  step_s = statistics.median(times)
  tokens_per_s = tokens_BT.size / step_s
  log(
    f"PyTorch {torch.__version__} eager float32 train step: {step_s * 1e3:.1f} ms, "
    f"{tokens_per_s:.0f} tokens/s ({threads} threads)"
  )
  return {"torch_tokens_per_s": tokens_per_s, "torch_step_s": step_s, "torch_threads": threads}
