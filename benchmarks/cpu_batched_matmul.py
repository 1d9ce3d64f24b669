"""The decode step's attention products on XLA:CPU against its matmul peak, per cache bucket.

  python benchmarks/cpu_batched_matmul.py [--batch=8] [--steps=64]

For configs/bench_sampler.py's model, a batch of B and S parallel steps: the two batched products
`model.attention` runs against each cache bucket's prefix P (scores q k over the chunk's W queries,
then p v), their FLOP rate and the process's CPU time over wall time (1.0: one core busy), beside
`hardware.matmul_peak`. Then the step's share: all layers' products (the last one for the 1 + W_p
columns read) averaged over the steps, as measured and at the peak. Prints a markdown table.
"""

import argparse
import importlib.util
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _timed(fn, *args, repeats: int = 5, calls: int = 20) -> tuple[float, float]:
  """(best wall seconds per call, CPU seconds over wall seconds of that round)."""
  import jax

  jax.block_until_ready(fn(*args))
  best = None
  for _ in range(repeats):
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
      jax.block_until_ready(fn(*args))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if best is None or wall < best[0]:
      best = (wall, cpu)
  return best[0] / calls, best[1] / best[0]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--steps", type=int, default=64)
  args = parser.parse_args()
  import jax
  import jax.numpy as jnp

  from ao_mdm import hardware, specs
  from ao_mdm.decode import parallel, schedules

  module_spec = importlib.util.spec_from_file_location("config", "configs/bench_sampler.py")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  cfg = specs.parse(module.get_config()).model
  b, h, t = args.batch, cfg.n_head, cfg.block_size
  k = cfg.n_embd // h
  plan = parallel.Plan.make(schedules.schedule_counts(t, 0, args.steps, "linear"))
  w, q = plan.real_width + plan.phantom_width, 1 + plan.phantom_width
  scores = jax.jit(lambda q, key: jnp.einsum("bhqk,bhkp->bhqp", q, key))
  values = jax.jit(lambda p, v: jnp.einsum("bhqp,bhpk->bhqk", p, v))
  peak = hardware.matmul_peak(2048, jnp.float32)
  print(
    f"B = {b}, S = {args.steps}, W = {w}, H = {h}, K = {k}; matmul peak {peak / 1e9:.0f} GFLOP/s"
  )
  print("| P | scores GFLOP/s | CPU / wall | values GFLOP/s | CPU / wall |")
  print("|---|---|---|---|---|")
  step_s = floor_s = 0.0
  for first, end, p in plan.segments:
    layer_s = {}
    for rows in sorted({w, q}):
      x = jax.random.normal(jax.random.key(0), (b, h, rows, k))
      keys = jax.random.normal(jax.random.key(1), (b, h, k, p))
      probs = jax.random.uniform(jax.random.key(2), (b, h, rows, p))
      vals = jax.random.normal(jax.random.key(3), (b, h, p, k))
      (s_sec, s_cpu), (v_sec, v_cpu) = _timed(scores, x, keys), _timed(values, probs, vals)
      layer_s[rows] = s_sec + v_sec
      if rows == w:
        flops = 2 * b * h * w * k * p
        rates = (flops / s_sec / 1e9, s_cpu, flops / v_sec / 1e9, v_cpu)
        print(f"| {p} | {rates[0]:.0f} | {rates[1]:.2f} | {rates[2]:.0f} | {rates[3]:.2f} |")
    step_s += (end - first) * ((cfg.n_layer - 1) * layer_s[w] + layer_s[q])
    floor_s += (end - first) * 4 * b * h * k * p * ((cfg.n_layer - 1) * w + q) / peak
  print(
    f"per step: {step_s / args.steps * 1e3:.2f} ms in these products, "
    f"{floor_s / args.steps * 1e3:.2f} ms at the peak"
  )


if __name__ == "__main__":
  main()
