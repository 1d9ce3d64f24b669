"""Ahead-of-time compile for a TPU topology, on a CPU host: the sharded train step, or the
cached sampler (`ao-mdm compile --program=sample`).

With `libtpu` installed (`pip install -e '.[tpu]'`), `jax.experimental.topologies` describes TPU
devices without having any; the program is lowered and compiled for them, XLA's memory analysis
says whether it fits per-chip HBM (docs/launching.md), and a roofline from the chip's published
figures projects its time (docs/performance.md).
"""

from collections.abc import Callable
import importlib.util
import math
import os
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from ao_mdm import hardware, specs
from ao_mdm import model as model_lib
from ao_mdm.decode import common, policies, protocol
from ao_mdm.perf import roofline
from ao_mdm.runtime import quiet
from ao_mdm.train import step as train_step

TOPOLOGY_EXAMPLES = "v5e:1, v5e:2x2, v5e:4x4, v4:2x2x2, v5p:2x2x1, v6e:4x4"


def tpu_devices(topology: str) -> list:
  """Compile-only TPU devices of `topology` (e.g. 'v5e:4x4', or 'v5e:1' for one chip); needs
  libtpu, no TPU."""
  if importlib.util.find_spec("libtpu") is None:
    raise ImportError("ahead-of-time TPU compilation needs libtpu: pip install -e '.[tpu]'")
  from jax.experimental import topologies

  # Only a compiler is needed here; without this a second JAX process on the host that also
  # loaded libtpu makes the plugin fail on /tmp/libtpu_lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  name, options = topology, {}
  gen, _, shape = topology.partition(":")
  dims = [int(x) for x in shape.split("x")] if re.fullmatch(r"\d+(x\d+)*", shape) else []
  if dims and math.prod(dims) < 4:  # smaller than libtpu's default host (2x2): one small host
    name = f"{gen}:{'x'.join(map(str, dims + [1] * (len(dims) == 1)))}"
    options = {"chips_per_host_bounds": tuple((dims + [1, 1, 1])[:3])}
  try:
    with quiet.silenced_stderr():  # libtpu's start-up warnings about the host it is not on
      return list(
        topologies.get_topology_desc(platform="tpu", topology_name=name, **options).devices
      )
  except jax.errors.JaxRuntimeError as e:
    if "lockfile" in str(e):
      raise OSError(
        f"libtpu is locked by another process ({e}); set "
        "ALLOW_MULTIPLE_LIBTPU_LOAD=1 before starting Python"
      ) from e
    raise ValueError(
      f"invalid TPU topology {topology!r}: {e}. Give GENERATION:SHAPE, e.g. {TOPOLOGY_EXAMPLES}"
    ) from e


def memory_gib(compiled) -> dict:
  """Per-device memory of a compiled executable, in GiB, from XLA's memory analysis."""
  m = compiled.memory_analysis()
  if m is None:
    raise RuntimeError("the compiled executable has no memory analysis")
  parts = {
    "arguments": m.argument_size_in_bytes,
    "outputs": m.output_size_in_bytes,
    "aliased": m.alias_size_in_bytes,
    "temps": m.temp_size_in_bytes,
    "generated_code": m.generated_code_size_in_bytes,
  }
  out = {k: v / hardware.GIB for k, v in parts.items()}
  # Donated state is aliased: its outputs reuse the argument buffers.
  out["total"] = (
    out["arguments"] + out["outputs"] - out["aliased"] + out["temps"] + out["generated_code"]
  )
  return out


def compile_sampler(
  config: specs.Spec,
  topology: str,
  name: str = "config",
  *,
  batch_size: int = 8,
  steps: int = 64,
  schedule: str = "linear",
  dtype: str = "float32",
  log: Callable[[str], None] = print,
) -> dict:
  """Compile one unconditional generation of the cached sampler (every cache bucket of its plan)
  for one device of `topology`; log and return its memory and roofline projection.

  Per bucket and in total: the bytes the steps must read (weights + K/V cache prefix), their
  FLOPs and max(bytes / HBM bandwidth, FLOPs / peak), from roofline.step_costs, next to one full
  forward of the same batch. Peak is the chip's bf16 figure for both dtypes (XLA's default
  precision multiplies float32 in bf16 passes on TPU); per-step overheads are not modelled.
  """
  devices = tpu_devices(topology)
  device = devices[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  cfg = common.with_dtype({}, config.model, dtype)[1]
  abstract = jax.eval_shape(
    lambda: common.with_dtype(
      nn.unbox(model_lib.init_params(config.model, jax.random.key(0))), config.model, dtype
    )[0]
  )
  t = cfg.block_size
  options = dict(steps=steps, schedule=schedule, order="random")
  st = policies.get("parallel").build(protocol.Batch.unconditional({}, cfg), **options)
  decoder, plan = protocol.decoder(st.spec, st.plan), st.spec.plan
  on_device = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  args = (
    jax.tree.map(on_device, abstract),
    on_device(jax.ShapeDtypeStruct((batch_size, t), jnp.int32)),
    on_device(jax.ShapeDtypeStruct((batch_size, t), jnp.bool_)),
    on_device(jax.eval_shape(lambda: jax.random.key(0))),
    *(on_device(jax.ShapeDtypeStruct((), d)) for d in (jnp.float32, jnp.float32, jnp.int32)),
  )
  start = time.perf_counter()
  compiled = decoder.lower(*args).compile()
  hbm = hardware.hbm_per_device_gib(devices)
  result = {
    "topology": topology,
    "device_kind": device.device_kind,
    "name": name,
    "batch_size": batch_size,
    "steps": steps,
    "schedule": schedule,
    "dtype": dtype,
    "block_size": t,
    "buckets": len(plan.segments),
    "hbm_gib": hbm,
    "compile_seconds": time.perf_counter() - start,
    **memory_gib(compiled),
  }
  figures = hardware.chip_figures(devices)
  if figures:
    peak, hbm_bw, _ = figures
    seconds = lambda c: max(c["bytes"] / hbm_bw, c["flops"] / peak)
    bound = lambda c: "hbm" if c["bytes"] / hbm_bw >= c["flops"] / peak else "compute"
    buckets = [
      {**c, "step_s": seconds(c), "bound": bound(c)}
      for c in roofline.step_costs(cfg, plan, batch_size)
    ]
    forward = roofline.forward_costs(cfg, batch_size)
    total = {k: sum(c[k] * c["steps"] for c in buckets) for k in ("bytes", "flops", "step_s")}
    result.update(
      peak_flops=peak,
      hbm_bandwidth=hbm_bw,
      buckets_detail=buckets,
      generation_bytes=total["bytes"],
      generation_flops=total["flops"],
      generation_s=total["step_s"],
      forward_bytes=forward["bytes"],
      forward_flops=forward["flops"],
      forward_s=seconds(forward),
      forward_bound=bound(forward),
    )
    result["generation_over_forward"] = result["generation_s"] / result["forward_s"]
    result["tokens_per_s"] = batch_size * t / result["generation_s"]
  log(format_sampler(result))
  if result["total"] > hbm:
    raise ValueError(
      f"the sampler of {name} (batch {batch_size}, {dtype}) does not fit on "
      f"{topology}: it needs {result['total']:.2f} GiB per device but "
      f"{hbm:.1f} GiB of HBM are available; lower --batch_size"
    )
  return result


def format_sampler(r: dict) -> str:
  """The sampler compile as a small table: memory, then the roofline per bucket and in total."""
  lines = [
    f"{r['topology']}: the cached sampler of {r['name']} on one {r['device_kind']}, batch "
    f"{r['batch_size']} x T={r['block_size']}, S={r['steps']} {r['schedule']} steps, "
    f"{r['dtype']}, {r['buckets']} cache buckets, compiled in "
    f"{r['compile_seconds']:.1f} s",
    f"per-device memory: {r['total']:.3f} GiB of {r['hbm_gib']:.1f} (arguments "
    f"{r['arguments']:.3f}, temps {r['temps']:.3f})",
  ]
  if "buckets_detail" not in r:
    return "\n".join(lines + ["(no published figures for this chip: no projection)"])
  lines += [
    "roofline projection (a bound from published chip figures, not a measurement):",
    f"  {'cache read':>10} {'steps':>6} {'bytes/step':>11} {'FLOPs/step':>11} "
    f"{'step >=':>10}  bound",
  ]
  for c in r["buckets_detail"]:
    lines.append(
      f"  {c['cache_len']:>10} {c['steps']:>6} {c['bytes']:>11.3e} {c['flops']:>11.3e} "
      f"{c['step_s'] * 1e6:>8.1f} us  {c['bound']}"
    )
  lines += [
    f"  generation: {r['generation_bytes']:.3e} bytes, {r['generation_flops']:.3e} FLOPs, "
    f">= {r['generation_s'] * 1e3:.2f} ms ({r['tokens_per_s']:,.0f} tokens/s)",
    f"  one full forward of the batch: {r['forward_bytes']:.3e} bytes, "
    f"{r['forward_flops']:.3e} FLOPs, >= {r['forward_s'] * 1e3:.2f} ms "
    f"({r['forward_bound']}-bound); generation / forward = "
    f"{r['generation_over_forward']:.2f}x",
  ]
  return "\n".join(lines)


def compile_for_topology(
  config: specs.Spec, topology: str, name: str = "config", log: Callable[[str], None] = print
) -> dict:
  """Compile the train step for `topology`; log and return per-device GiB and compile time.

  Raises ValueError (naming `name`) if the step needs more than the chip's HBM.
  """
  devices = tpu_devices(topology)
  program = train_step.make_program(config, devices)
  train = config.train
  tokens = jax.ShapeDtypeStruct(
    (train.batch_size, train_step.row_width(config)), jnp.int32, sharding=program.batch_sharding
  )
  hbm = hardware.hbm_per_device_gib(devices)
  what = (
    f"the train step of {name} (L={config.model.n_layer} D={config.model.n_embd}, "
    f"batch {train.batch_size}x{config.model.block_size}, "
    f"train.microbatches={train.microbatches})"
  )
  advice = "raise train.microbatches or shard more (mesh.ici fsdp/tensor)"
  start = time.perf_counter()
  try:
    with jax.set_mesh(program.mesh), nn.logical_axis_rules(program.axis_rules):
      compiled = program.jitted.lower(program.abstract_state, tokens).compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    # The TPU compiler itself refuses programs whose temporaries exceed HBM.
    need, have = (re.findall(r"\(([0-9.]+)G\)", str(e)) + ["?", f"{hbm:.2f}"])[:2]
    raise ValueError(
      f"{what} does not fit on {topology}: XLA needs {need} GiB of "
      f"temporaries per device but {have} GiB of HBM are usable; {advice}"
    ) from e
  seconds = time.perf_counter() - start
  result = {
    "topology": topology,
    "device_kind": devices[0].device_kind,
    "num_devices": len(devices),
    "mesh": dict(program.mesh.shape),
    "microbatches": int(train.microbatches),
    "hbm_gib": hbm,
    "compile_seconds": seconds,
    "attention": model_lib.attention_kind(
      config.model, devices[0].platform, config.model.block_size
    ),
    **memory_gib(compiled),
  }
  result["projection"] = roofline.train_step(compiled, config, devices)
  log(format_result(result))
  if result["total"] > hbm:
    raise ValueError(
      f"{what} does not fit on {topology}: it needs {result['total']:.2f} GiB "
      f"per device but {hbm:.1f} GiB of HBM are available; {advice}"
    )
  return result


def format_result(r: dict) -> str:
  """A small table of the compile figures."""
  mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
  lines = [
    f"{r['topology']}: {r['num_devices']} x {r['device_kind']}, mesh {mesh}, "
    f"microbatches={r['microbatches']}, {r['attention']} attention, compiled in "
    f"{r['compile_seconds']:.1f} s",
    "per-device memory (GiB):",
  ]
  for key in ("arguments", "outputs", "aliased", "temps", "generated_code", "total"):
    lines.append(f"  {key:<15}{r[key]:9.3f}")
  lines.append(f"  {'HBM':<15}{r['hbm_gib']:9.3f}  ({100 * r['total'] / r['hbm_gib']:.0f}% used)")
  p = r.get("projection")
  if p:
    lines += [
      "roofline projection per device (a bound from published chip figures, not a measurement):",
      f"  FLOPs (6N + attention) {p['model_flops_per_device']:.3e}, XLA cost analysis "
      f"{p['xla_flops_per_device']:.3e} ({p['xla_over_model_flops']:.2f}x)",
      f"  HBM bytes {p['hbm_bytes_per_device']:.3e} (XLA, lower bound; HLO upper estimate "
      f"{p['hbm_bytes_upper_estimate']:.3e} = {p['hbm_s_at_upper_estimate'] * 1e3:.0f} ms), "
      f"collective bytes (HLO) {p['collective_bytes_per_device']:.3e}",
      f"  step >= {p['step_s_lower_bound'] * 1e3:.1f} ms ({p['bound_by']}-bound), MFU <= "
      f"{p['mfu_upper_bound']:.0%}, tokens/s <= {p['tokens_per_s_upper_bound']:,.0f}",
    ]
  return "\n".join(lines)
