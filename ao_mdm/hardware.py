"""What a device can do: the published figures of TPU chips by the `device_kind` JAX reports
(HBM size, peak FLOP/s, HBM and ICI bandwidth), and the matmul peak and read bandwidth of this
host's device, measured."""
import collections
import time
from typing import Any

import jax
import jax.numpy as jnp

GIB = 1024 ** 3
# HBM per chip, by the `device_kind` JAX reports.
HBM_GIB = {"TPU v4": 32.0, "TPU v5 lite": 16.0, "TPU v5e": 16.0, "TPU v5": 95.0,
           "TPU v5p": 95.0, "TPU v6 lite": 32.0, "TPU v6e": 32.0}
# Per chip: peak bf16 FLOP/s, HBM bytes/s, bidirectional ICI bytes/s. Sources: Google Cloud TPU
# docs, cloud.google.com/tpu/docs/v5e (197 TFLOPs, 819 GBps, 400 GBps), /v5p (459 TFLOPs,
# 2765 GBps, 1200 GBps), /v6e (918 TFLOPs, 1638 GBps, 800 GBps).
CHIP_SPECS = {"TPU v5 lite": (197e12, 819e9, 400e9), "TPU v5e": (197e12, 819e9, 400e9),
              "TPU v5": (459e12, 2765e9, 1200e9), "TPU v5p": (459e12, 2765e9, 1200e9),
              "TPU v6 lite": (918e12, 1638e9, 800e9), "TPU v6e": (918e12, 1638e9, 800e9)}


def hbm_per_device_gib(devices: list) -> float:
  """Per-device HBM: the chip's HBM over the devices (cores) JAX makes per chip."""
  kind = devices[0].device_kind
  if kind not in HBM_GIB:
    raise ValueError(f"unknown TPU device_kind {kind!r}; known: {sorted(HBM_GIB)}")
  per_chip = collections.Counter(tuple(getattr(d, "coords", (d.id,))) for d in devices)
  return HBM_GIB[kind] / max(per_chip.values())


def chip_figures(devices: list) -> tuple:
  """(peak bf16 FLOP/s, HBM bytes/s, ICI bytes/s) per device, or None for an unknown chip."""
  kind = devices[0].device_kind
  if kind not in CHIP_SPECS:
    return None
  per_chip = collections.Counter(tuple(getattr(d, "coords", (d.id,))) for d in devices)
  cores = max(per_chip.values())  # devices per chip share its figures
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
