"""What the stop agreement of a multi-process run (train/cluster.py) costs per step: two local
processes of 2 CPU devices train configs/bench_train.py's model (or --config's) and time blocks of
steps with the agreement at every boundary against blocks without, alternating, and the
agreement alone back to back (its latency when no step hides it); process 0 prints one JSON
line (docs/performance.md, "Multi-process runs").

  python benchmarks/stop_agreement_cost.py [--config=configs/bench_train.py] [--steps=40]
      [--rounds=4]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args) -> None:
  import importlib.util

  import jax
  import numpy as np

  from ao_mdm import specs
  from ao_mdm.train import cluster
  from ao_mdm.train import step as train_step

  cluster.join(f"127.0.0.1:{args.port}", 2, args.process_id)
  module_spec = importlib.util.spec_from_file_location("config", args.config)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = specs.parse(module.get_config())
  program = train_step.make_program(config)
  state = program.init_state()
  agree = cluster.StopAgreement(program.mesh)
  rows = config.train.batch_size // jax.process_count()
  local = (
    np.random.default_rng(args.process_id)
    .integers(0, config.model.vocab_size, (rows, config.model.block_size))
    .astype(np.int32)
  )
  tokens = program.global_batch(local)

  def block(with_agreement: bool) -> float:
    nonlocal state
    start = time.perf_counter()
    for _ in range(args.steps):
      state, metrics = program.step(state, tokens)
      if with_agreement:
        agree(0)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / args.steps

  block(True), block(False)  # compiles both
  times = {"with": [], "without": []}
  for _ in range(args.rounds):
    times["without"].append(block(False))
    times["with"].append(block(True))
  start = time.perf_counter()
  for _ in range(50):  # the agreement alone, back to back: its latency, nothing to hide it
    agree(0)
  agree(0)
  alone_s = (time.perf_counter() - start) / 51
  if jax.process_index() == 0:
    step_s = {k: statistics.median(v) for k, v in times.items()}
    print(
      json.dumps(
        {
          "step_s_without": step_s["without"],
          "step_s_with": step_s["with"],
          "agreement_s_per_step": step_s["with"] - step_s["without"],
          "relative": step_s["with"] / step_s["without"] - 1,
          "agreement_alone_s": alone_s,
          "steps_per_block": args.steps,
          "rounds": args.rounds,
          "config": args.config,
        }
      ),
      flush=True,
    )
  cluster.finish(0)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "bench_train.py"))
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--process_id", type=int, default=None)
  parser.add_argument("--port", type=int, default=None)
  args = parser.parse_args()
  if args.process_id is not None:
    worker(args)
    return
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
  }
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        __file__,
        f"--config={args.config}",
        f"--steps={args.steps}",
        f"--rounds={args.rounds}",
        f"--process_id={i}",
        f"--port={port}",
      ],
      env=env,
      cwd=ROOT,
    )
    for i in range(2)
  ]
  sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
  main()
