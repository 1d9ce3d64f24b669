"""What a device can do: the published figures of TPU chips by the `device_kind` JAX reports
(HBM size, peak FLOP/s, HBM and ICI bandwidth), and the matmul peak and read bandwidth of this
host's device, measured."""

import collections
import time
from typing import Any

import jax
import jax.numpy as jnp

GIB = 1024**3
# HBM per chip, by the `device_kind` JAX reports.
HBM_GIB = {
  "TPU v4": 32.0,
  "TPU v5 lite": 16.0,
  "TPU v5e": 16.0,
  "TPU v5": 95.0,
  "TPU v5p": 95.0,
  "TPU v6 lite": 32.0,
  "TPU v6e": 32.0,
}
# Per chip: peak bf16 FLOP/s, HBM bytes/s, bidirectional ICI bytes/s. Sources: Google Cloud TPU
# docs, cloud.google.com/tpu/docs/v5e (197 TFLOPs, 819 GBps, 400 GBps), /v5p (459 TFLOPs,
# 2765 GBps, 1200 GBps), /v6e (918 TFLOPs, 1638 GBps, 800 GBps).
CHIP_SPECS = {
  "TPU v5 lite": (197e12, 819e9, 400e9),
  "TPU v5e": (197e12, 819e9, 400e9),
  "TPU v5": (459e12, 2765e9, 1200e9),
  "TPU v5p": (459e12, 2765e9, 1200e9),
  "TPU v6 lite": (918e12, 1638e9, 800e9),
  "TPU v6e": (918e12, 1638e9, 800e9),
}
# Dense bf16 FLOP/s per device, what MFU is measured against on accelerators. TPUs: the chip
# (Google Cloud TPU docs, cloud.google.com/tpu/docs/v4: 275 TFLOPs; v5e, v5p, v6e as above).
# NVIDIA GPUs: the datasheets' bf16 Tensor Core figure without sparsity (half the headline
# one): H100 SXM and H200 989 TFLOPS, H100 PCIe 756, H100 NVL 835, A100 (SXM4) 312, L4 121.
PEAK_FLOPS = {
  "TPU v4": 275e12,
  **{kind: spec[0] for kind, spec in CHIP_SPECS.items()},
  "NVIDIA H100 80GB HBM3": 989e12,
  "NVIDIA H100 PCIe": 756e12,
  "NVIDIA H100 NVL": 835e12,
  "NVIDIA H200": 989e12,
  "NVIDIA A100-SXM4-80GB": 312e12,
  "NVIDIA A100-SXM4-40GB": 312e12,
  "NVIDIA L4": 121e12,
}


def hbm_per_device_gib(devices: list) -> float:
  """Per-device HBM: the chip's HBM over the devices (cores) JAX makes per chip."""
  kind = devices[0].device_kind
  if kind not in HBM_GIB:
    raise ValueError(f"unknown TPU device_kind {kind!r}; known: {sorted(HBM_GIB)}")
  return HBM_GIB[kind] / devices_per_chip(devices)


def devices_per_chip(devices: list) -> int:
  """How many JAX devices share one chip (TPU megacores, v4 and v5p, show as one device)."""
  per_chip = collections.Counter(tuple(getattr(d, "coords", (d.id,))) for d in devices)
  return max(per_chip.values())


def peak_flops(devices: list) -> float:
  """Dense bf16 FLOP/s of one of `devices` from PEAK_FLOPS, or 0 for a kind not listed."""
  kind = devices[0].device_kind
  peak = PEAK_FLOPS.get(kind, 0.0)
  return peak / devices_per_chip(devices) if kind.startswith("TPU") else peak


def chip_figures(devices: list) -> tuple[float, ...] | None:
  """(peak bf16 FLOP/s, HBM bytes/s, ICI bytes/s) per device, or None for an unknown chip."""
  kind = devices[0].device_kind
  if kind not in CHIP_SPECS:
    return None
  cores = devices_per_chip(devices)  # devices per chip share its figures
  return tuple(x / cores for x in CHIP_SPECS[kind])


def _best_seconds(fn: Any, arg: Any, repeats: int) -> float:
  """Best wall time of `repeats` calls of the jitted fn(arg), after one that compiles."""
  jax.block_until_ready(fn(arg))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(arg))
    times.append(time.perf_counter() - start)
  return min(times)


def matmul_peak(size: int, dtype: Any, repeats: int = 5) -> float:
  """Measured FLOP/s of one device on an N x N x N matmul (best of `repeats`), for MFU."""
  a = jax.random.normal(jax.random.key(0), (size, size), dtype)
  return 2.0 * size**3 / _best_seconds(jax.jit(lambda x: x @ x), a, repeats)


def read_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
  """Measured bytes/s of one device summing an n_bytes float32 array (best of `repeats`)."""
  x = jnp.ones((n_bytes // 4,), jnp.float32)
  return x.nbytes / _best_seconds(jax.jit(jnp.sum), x, repeats)
