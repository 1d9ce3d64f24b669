"""`ao-mdm bench sample`: the cached samplers against a full forward and the no-cache sampler,
and speculative decoding against sequential decoding, figures and ratios from one run."""

from collections.abc import Callable
import dataclasses
import json
import statistics
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ao_mdm import hardware, orders, specs
from ao_mdm import model as model_lib
from ao_mdm.decode import common, policies, protocol, schedules
from ao_mdm.perf import roofline


def _timed(fn: Callable[[int], Any], repeats: int) -> tuple[float, list]:
  """Median wall time of the calls fn(0) .. fn(repeats - 1), each waited for, and their outputs."""
  times, outs = [], []
  for i in range(repeats):
    start = time.perf_counter()
    outs.append(jax.block_until_ready(fn(i)))
    times.append(time.perf_counter() - start)
  return statistics.median(times), outs


def _compile(jitted, *args) -> tuple[Any, float]:
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  return compiled, time.perf_counter() - start


def bench_sample(
  config: specs.Spec,
  bench: ml_collections.ConfigDict,
  dtypes: tuple = ("float32", "bfloat16"),
  log: Callable[[str], None] = print,
) -> dict:
  """Per decoding dtype: full forward and cached sampler at each S (float32 also the no-cache
  sampler), in one run; logs each figure, then JSON.

  Per S also the cached step time and its floor (see step_floors), from the matmul peak and
  read bandwidth measured in the same run (the peak in float32).
  """
  b, t = int(bench.batch_size), config.model.block_size
  repeats = int(bench.repeats)
  params32 = nn.unbox(model_lib.init_params(config.model, jax.random.key(0)))
  tokens = jnp.asarray(
    np.random.default_rng(0).integers(0, config.model.vocab_size, (b, t)), jnp.int32
  )
  order = orders.random_orders(jax.random.key(1), b, t)
  peak = hardware.matmul_peak(2048, jnp.float32)
  bandwidth = hardware.read_bandwidth()
  log(
    f"measured matmul peak {peak / 1e9:.1f} GFLOP/s (float32), read bandwidth "
    f"{bandwidth / 1e9:.1f} GB/s"
  )
  zeros, known = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, t), bool)
  parallel = policies.get("parallel")
  scalars = (jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))
  results: dict[str, Any] = {
    "matmul_peak_flops": peak,
    "read_bytes_per_s": bandwidth,
    "batch_size": b,
    "block_size": t,
    "schedule": bench.schedule,
    "dtypes": {},
  }
  for dtype in dtypes:
    params, cfg = common.with_dtype(params32, config.model, dtype)
    forward = jax.jit(lambda p, x, o, cfg=cfg: model_lib.make_model(cfg).apply({"params": p}, x, o))
    fwd, fwd_compile = _compile(forward, params, tokens, order)
    full_forward_s, _ = _timed(lambda _: fwd(params, tokens, order), repeats)
    log(f"{dtype}: full forward B={b} T={t}: {full_forward_s:.4f} s (compile {fwd_compile:.1f} s)")
    out: dict[str, Any] = {
      "full_forward_s": full_forward_s,
      "full_forward_compile_s": fwd_compile,
      "steps": {},
    }
    for steps in bench.steps:
      row: dict[str, Any] = {}
      for use_cache in (True, False) if dtype == "float32" else (True,):
        # No cache: the first no_cache_max_steps steps (up to the position they reach), each
        # recomputing all T slots, timed and scaled to `steps`.
        run_steps = steps if use_cache else min(steps, bench.no_cache_max_steps)
        end = int(schedules.schedule_counts(t, 0, int(steps), bench.schedule)[run_steps])
        options = dict(steps=run_steps, schedule=bench.schedule, order="random")
        batch = protocol.Batch.unconditional(params, cfg, end)
        st = parallel.build(batch, **options, use_cache=use_cache)
        spec = st.spec
        if not use_cache:
          spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, real_width=t))
        args = (params, zeros, known, jax.random.key(2), *scalars)
        compiled, compile_s = _compile(protocol.decoder(spec, st.plan), *args)
        elapsed, _ = _timed(lambda _: compiled(*args), repeats if use_cache else 1)
        scale = steps / run_steps
        if use_cache:
          floors = roofline.step_floors(cfg, spec.plan, b, bandwidth, peak)
          floor_ms = 1e3 * float(np.mean(floors))
          row.update(
            sampler_s=elapsed,
            compile_s=compile_s,
            step_ms=1e3 * elapsed / steps,
            step_floor_ms=floor_ms,
            sampler_over_full_forward=elapsed / full_forward_s,
          )
        else:
          row.update(
            no_cache_s=elapsed * scale,
            no_cache_compile_s=compile_s,
            no_cache_extrapolated=scale != 1,
            no_cache_over_sampler=elapsed * scale / row["sampler_s"],
          )
      line = (
        f"{dtype} S={steps}: sampler {row['sampler_s']:.4f} s "
        f"({row['sampler_over_full_forward']:.2f}x full forward, compile "
        f"{row['compile_s']:.1f} s; step {row['step_ms']:.2f} ms, floor "
        f"{row['step_floor_ms']:.2f} ms)"
      )
      if "no_cache_s" in row:
        line += (
          f"; no-cache {row['no_cache_s']:.3f} s"
          f"{' (extrapolated)' if row['no_cache_extrapolated'] else ''} "
          f"= {row['no_cache_over_sampler']:.1f}x the sampler"
        )
      fp32 = results["dtypes"].get("float32", {}).get("steps", {}).get(str(steps))
      if fp32:
        row["float32_over_this"] = fp32["sampler_s"] / row["sampler_s"]
        line += f"; float32 / {dtype} {row['float32_over_this']:.2f}x"
      out["steps"][str(steps)] = row
      log(line)
    results["dtypes"][dtype] = out
  log(json.dumps(results))
  return results


def infill_context(params: Any, cfg: specs.ModelSpec, seed: int = 0) -> tuple:
  """(positions, tokens) of the speculative bench's infill: the first and last quarter of one
  L2R sample of the model (temperature 1), so the middle half is decoded around real context."""
  t = cfg.block_size
  l2r = policies.get("parallel").sample(params, cfg, batch_size=1, steps=t, order="l2r", seed=seed)
  row = l2r.tokens[0]
  positions = [p for p in range(t) if p < t // 4 or p >= t - t // 4]
  return positions, [int(row[p]) for p in positions]


def bench_speculative(
  bench: ml_collections.ConfigDict,
  params: Any,
  cfg: specs.ModelSpec,
  dtype: str = "float32",
  draft_head: Any = None,
  log: Callable[[str], None] = print,
) -> dict:
  """Speculative decoding against cached sequential decoding in the same order (one token per
  forward), same model, temperature 1 and top-p 1, all decoded in `dtype`: per batch size
  (bench.speculative_batches), order (L2R from scratch; infill: the middle half in a random
  order, see infill_context), drafter (the model itself; the learned head, if given) and k
  (bench.drafts): forwards per sequence, tokens per forward, first-draft acceptance and its
  expectation sum min(p, q), and wall time, over bench.seeds batches (one sequence varies a
  lot: counts are the mean; times: see `paired`)."""

  params, cfg = common.with_dtype(params, cfg, dtype)  # once, outside the timed calls
  if draft_head is not None:
    draft_head = common.with_dtype(draft_head, cfg, dtype)[0]
  seeds, t = int(bench.seeds), cfg.block_size
  repeats = int(bench.get("repeats", 1))
  if seeds < 1:
    raise ValueError(f"bench.seeds={seeds} must be >= 1")
  positions, ids = infill_context(params, cfg)
  layouts = {
    "l2r": {"order": "l2r"},
    "infill": {"order": "random", "known_positions": positions, "known_tokens": ids},
  }
  drafters = {"self": None, **({"head": draft_head} if draft_head is not None else {})}

  def paired(base, spec):
    """Seconds of base and spec: the median over seeds of the best of `bench.repeats` rounds,
    each round timing every seed's two calls in turn (the host's load drifts: times taken
    apart can differ by 2x); and spec's outputs of the first round."""
    base(0), spec(0)  # compiles
    best = {"base": [np.inf] * seeds, "spec": [np.inf] * seeds}
    outs = []
    for r in range(repeats):
      for seed in range(seeds):
        best["base"][seed] = min(best["base"][seed], _timed(lambda _: base(seed), 1)[0])
        elapsed, out = _timed(lambda _: spec(seed), 1)
        best["spec"][seed] = min(best["spec"][seed], elapsed)
        outs += out if r == 0 else []
    return statistics.median(best["base"]), statistics.median(best["spec"]), outs

  results: dict[str, Any] = {
    "block_size": t,
    "seeds": seeds,
    "dtype": dtype,
    "infill_known": len(positions),
    "rows": [],
  }
  for b in bench.speculative_batches:
    for layout, known in layouts.items():
      unknown = t - len(known.get("known_positions", ()))
      sequential = lambda seed, b=b, known=known, unknown=unknown: policies.get("parallel").sample(
        params, cfg, batch_size=b, steps=unknown, seed=seed, dtype=dtype, **known
      )
      log(
        f"B={b} {layout}: {unknown} unknown positions, sequential decoding {unknown} "
        "forwards per sequence"
      )
      for drafter, head in drafters.items():
        for k in bench.drafts:
          base_s, elapsed, outs = paired(
            sequential,
            lambda seed, b=b, known=known, k=k, head=head: policies.get("speculative").sample(
              params,
              cfg,
              batch_size=b,
              draft=int(k),
              seed=seed,
              dtype=dtype,
              draft_head=head,
              **known,
            ),
          )
          total = {name: float(np.sum([o.stats[name] for o in outs])) for name in outs[0].stats}
          forwards = total["forwards"] / (b * seeds)
          row = {
            "batch_size": b,
            "order": layout,
            "drafter": drafter,
            "draft": int(k),
            "seconds": elapsed,
            "sequential_s": base_s,
            "forwards_per_sequence": forwards,
            "tokens_per_forward": unknown / forwards,
            "batch_forwards": total["iterations"] / seeds,
            "first_draft_acceptance": total["first_accepted"] / total["first_drafts"],
            "first_draft_overlap": total["first_overlap"] / total["first_drafts"],
            "speedup": base_s / elapsed,
            "read_ratio": roofline.speculative_read_ratio(cfg, int(k), b, head is not None),
          }
          row["read_bound_speedup"] = row["tokens_per_forward"] / row["read_ratio"]
          results["rows"].append(row)
          log(
            f"  {drafter}, k={k}: {row['tokens_per_forward']:.2f} tokens per forward "
            f"({forwards:.1f} per sequence, the batch ran {row['batch_forwards']:.1f}); first "
            f"drafts accepted {row['first_draft_acceptance']:.3f} (sum min(p, q) "
            f"{row['first_draft_overlap']:.3f}); {elapsed:.3f} s against {base_s:.3f} s: "
            f"{row['speedup']:.2f}x the speed of sequential decoding (bound by reading: "
            f"{row['read_bound_speedup']:.2f}x)"
          )
  log(json.dumps(results))
  return results
