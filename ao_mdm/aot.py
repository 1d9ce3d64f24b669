"""Ahead-of-time compile of the sharded train step for a TPU topology, on a CPU host.

With `libtpu` installed (`pip install -e '.[tpu]'`), `jax.experimental.topologies` describes TPU
devices without having any; the train step is lowered and compiled for them, and XLA's memory
analysis says whether one step fits per-chip HBM (DESIGN.md section 5).
"""
import collections
import importlib.util
import os
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from ao_mdm import train

GIB = 1024 ** 3
# HBM per chip, by the `device_kind` JAX reports.
HBM_GIB = {"TPU v4": 32.0, "TPU v5 lite": 16.0, "TPU v5e": 16.0, "TPU v5": 95.0,
           "TPU v5p": 95.0, "TPU v6 lite": 32.0, "TPU v6e": 32.0}
TOPOLOGY_EXAMPLES = "v5e:2x2, v5e:4x4, v4:2x2x2, v5p:2x2x1, v6e:4x4"


def tpu_devices(topology: str) -> list:
  """Compile-only TPU devices of `topology` (e.g. 'v5e:4x4'); needs libtpu, no TPU."""
  if importlib.util.find_spec("libtpu") is None:
    raise RuntimeError("ahead-of-time TPU compilation needs libtpu: pip install -e '.[tpu]'")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # Only a compiler is needed here; without this a second JAX process on the host that also
  # loaded libtpu makes the plugin fail on /tmp/libtpu_lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
  except jax.errors.JaxRuntimeError as e:
    if "lockfile" in str(e):
      raise RuntimeError(f"libtpu is locked by another process ({e}); set "
                         "ALLOW_MULTIPLE_LIBTPU_LOAD=1 before starting Python") from e
    raise ValueError(f"invalid TPU topology {topology!r}: {e}. Give GENERATION:SHAPE, "
                     f"e.g. {TOPOLOGY_EXAMPLES}") from e


def hbm_per_device_gib(devices: list) -> float:
  """Per-device HBM: the chip's HBM over the devices (cores) JAX makes per chip."""
  kind = devices[0].device_kind
  if kind not in HBM_GIB:
    raise ValueError(f"unknown TPU device_kind {kind!r}; known: {sorted(HBM_GIB)}")
  per_chip = collections.Counter(tuple(getattr(d, "coords", (d.id,))) for d in devices)
  return HBM_GIB[kind] / max(per_chip.values())


def memory_gib(compiled) -> dict:
  """Per-device memory of a compiled executable, in GiB, from XLA's memory analysis."""
  m = compiled.memory_analysis()
  if m is None:
    raise RuntimeError("the compiled executable has no memory analysis")
  parts = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "aliased": m.alias_size_in_bytes, "temps": m.temp_size_in_bytes,
           "generated_code": m.generated_code_size_in_bytes}
  out = {k: v / GIB for k, v in parts.items()}
  # Donated state is aliased: its outputs reuse the argument buffers.
  out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temps"] + \
      out["generated_code"]
  return out


def compile_for_topology(config: ml_collections.ConfigDict, topology: str,
                         name: str = "config") -> dict:
  """Compile the train step for `topology`; print and return per-device GiB and compile time.

  Raises ValueError (naming `name`) if the step needs more than the chip's HBM.
  """
  devices = tpu_devices(topology)
  program = train.make_program(config, devices)
  t = config.train
  tokens = jax.ShapeDtypeStruct((t.batch_size, config.model.block_size), jnp.int32,
                                sharding=program.batch_sharding)
  hbm = hbm_per_device_gib(devices)
  what = (f"the train step of {name} (L={config.model.n_layer} D={config.model.n_embd}, "
          f"batch {t.batch_size}x{config.model.block_size}, "
          f"train.microbatches={t.microbatches})")
  advice = "raise train.microbatches or shard more (mesh.ici fsdp/tensor)"
  start = time.perf_counter()
  try:
    with jax.set_mesh(program.mesh), nn.logical_axis_rules(program.axis_rules):
      compiled = program.step.jitted.lower(program.abstract_state(), tokens).compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    # The TPU compiler itself refuses programs whose temporaries exceed HBM.
    need, have = (re.findall(r"\(([0-9.]+)G\)", str(e)) + ["?", f"{hbm:.2f}"])[:2]
    raise ValueError(f"{what} does not fit on {topology}: XLA needs {need} GiB of "
                     f"temporaries per device but {have} GiB of HBM are usable; {advice}") from e
  seconds = time.perf_counter() - start
  result = {"topology": topology, "device_kind": devices[0].device_kind,
            "num_devices": len(devices), "mesh": dict(program.mesh.shape),
            "microbatches": int(t.microbatches), "hbm_gib": hbm, "compile_seconds": seconds,
            **memory_gib(compiled)}
  print(format_result(result), flush=True)
  if result["total"] > hbm:
    raise ValueError(f"{what} does not fit on {topology}: it needs {result['total']:.2f} GiB "
                     f"per device but {hbm:.1f} GiB of HBM are available; {advice}")
  return result


def format_result(r: dict) -> str:
  """A small table of the compile figures."""
  mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
  lines = [f"{r['topology']}: {r['num_devices']} x {r['device_kind']}, mesh {mesh}, "
           f"microbatches={r['microbatches']}, compiled in {r['compile_seconds']:.1f} s",
           "per-device memory (GiB):"]
  for key in ("arguments", "outputs", "aliased", "temps", "generated_code", "total"):
    lines.append(f"  {key:<15}{r[key]:9.3f}")
  lines.append(f"  {'HBM':<15}{r['hbm_gib']:9.3f}  ({100 * r['total'] / r['hbm_gib']:.0f}% used)")
  return "\n".join(lines)
