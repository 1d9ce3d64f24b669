"""`ao-mdm bench restart`: what a restart costs before training goes on, cold and warm.

A run of the config trains until its first logged step, then gets SIGTERM (it saves and exits,
as on a preemption). It is started again twice more: once with an empty compilation cache
(cold) and once with the cache that start filled (warm); each start records, phase by phase,
the wall time from its process's start to its first new step (train/loop.py). Then `ao-mdm
sample` on the run, once with an empty cache and once warm. One JSON line at the end.
"""

from collections.abc import Callable
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from ao_mdm import specs
from ao_mdm.checkpoint import layout
from ao_mdm.storage import fs


def _train_argv(config_file: str, workdir: str, cache: str) -> list:
  return [
    sys.executable,
    "-m",
    "ao_mdm.cli.main",
    "train",
    f"--config={config_file}",
    f"--workdir={workdir}",
    f"--compile_cache={cache}",
    "--config.train.num_steps=1000000",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
  ]


def _startup(workdir: str, after: int) -> dict:
  """The newest start's phases recorded in metrics.jsonl (seconds), if its step is > after."""
  path = fs.join(workdir, layout.METRICS)
  if not fs.isfile(path):
    return {}
  found = {}
  for line in fs.read_text(path).splitlines():
    r = json.loads(line)
    if r["step"] > after and any(k.startswith("startup/") for k in r):
      found = {k[len("startup/") : -len("_s")]: v for k, v in r.items() if k.startswith("startup/")}
  return found


def _start_and_stop(command: list, workdir: str, after: int, timeout: float) -> tuple[dict, int]:
  """Starts `command`, waits for its first step past `after`, stops it with SIGTERM; returns
  its start's phases and the step it saved."""
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + timeout
  phases: dict = {}
  while not phases and proc.poll() is None and time.time() < deadline:
    time.sleep(0.2)
    phases = _startup(workdir, after)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=timeout)
  if not phases:
    raise RuntimeError(f"the run stopped or hung before its first step: {err[-2000:]}")
  saved = [line for line in out.splitlines() if "saved a checkpoint at step" in line]
  return phases, int(saved[-1].split("at step ")[1].split()[0]) if saved else after


def _timed(command: list) -> float:
  start = time.perf_counter()
  subprocess.run(command, check=True, capture_output=True, text=True)
  return time.perf_counter() - start


def bench_restart(config: specs.Spec, config_file: str, log: Callable[[str], None] = print) -> dict:
  """Cold and warm restarts and `sample` calls of config_file's run; logs each, then one JSON
  line."""
  del config  # the runs load config_file themselves, as a user's would
  root = tempfile.mkdtemp(prefix="ao_mdm_bench_restart_")
  workdir, cache = os.path.join(root, "run"), os.path.join(root, "xla_cache")
  results: dict[str, Any] = {}
  try:
    log("first start (fills the work dir and the data preparation)")
    _, step = _start_and_stop(_train_argv(config_file, workdir, cache), workdir, 0, 1800)
    for name in ("cold", "warm"):
      if name == "cold":
        fs.rmtree(cache)
      phases, step = _start_and_stop(_train_argv(config_file, workdir, cache), workdir, step, 1800)
      results[f"restart_{name}"] = {**phases, "total": sum(phases.values())}
      log(
        f"{name} restart: first step {results[f'restart_{name}']['total']:.1f} s after the "
        "process started: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
      )
    sample = [
      sys.executable,
      "-m",
      "ao_mdm.cli.main",
      "sample",
      f"--checkpoint={workdir}",
      "--num_samples=1",
      f"--compile_cache={cache}",
    ]
    fs.rmtree(cache)
    results["sample_cold_s"] = _timed(sample)
    results["sample_warm_s"] = _timed(sample)
    log(
      f"sample: {results['sample_cold_s']:.1f} s with an empty cache, "
      f"{results['sample_warm_s']:.1f} s the second time"
    )
  finally:
    fs.rmtree(root)
  results["summary"] = {
    "warm_over_cold_restart": results["restart_warm"]["total"] / results["restart_cold"]["total"],
    "warm_over_cold_sample": results["sample_warm_s"] / results["sample_cold_s"],
  }
  log(json.dumps(results))
  return results
