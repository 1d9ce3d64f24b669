"""Roofline models (projections from published chip figures, not measurements): the train
step's time and MFU bounds from a compiled program, and what each cached decode step must read
and compute."""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import hardware, specs
from ao_mdm import model as model_lib
from ao_mdm.decode import policies, protocol
from ao_mdm.perf import hlo


def train_step(compiled, config: specs.Spec, devices: list) -> dict:
  """A projection (not a measurement): lower bound on step time, upper bound on MFU.

  Per device: time >= max(FLOPs / peak, HBM bytes / HBM bandwidth, collective bytes / ICI
  bandwidth). FLOPs are the model's (6N + attention, as MFU counts them) and XLA's cost
  analysis beside them; XLA counts a loop body once, so the larger is used. HBM bytes are
  XLA's (loop bodies once: a lower bound); the HLO operand sum with trip counts (hlo_traffic,
  which also counts whole loop buffers that are only sliced) is an upper estimate, printed
  beside it. Collective bytes come from the HLO with trip counts.
  """
  figures = hardware.chip_figures(devices)
  if figures is None:
    return {}
  peak, hbm_bw, ici_bw = figures
  n = len(devices)
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  tokens = config.train.batch_size * config.model.block_size
  n_params = model_lib.count_params(_shapes(config.model))
  model_flops = tokens * model_lib.flops_per_token(config.model, n_params) / n
  xla_flops = float(cost.get("flops", 0.0))
  hbm_bytes = float(cost.get("bytes accessed", 0.0))
  traffic = hlo.hlo_traffic(compiled.as_text())
  ici_bytes = traffic["collective"]
  times = {
    "compute": max(model_flops, xla_flops) / peak,
    "hbm": hbm_bytes / hbm_bw,
    "ici": ici_bytes / ici_bw,
  }
  step = max(times.values())
  return {
    "model_flops_per_device": model_flops,
    "xla_flops_per_device": xla_flops,
    "xla_over_model_flops": xla_flops / model_flops,
    "hbm_bytes_per_device": hbm_bytes,
    "collective_bytes_per_device": ici_bytes,
    "hbm_bytes_upper_estimate": traffic["hbm"],
    "hbm_s_at_upper_estimate": traffic["hbm"] / hbm_bw,
    "peak_flops": peak,
    "hbm_bandwidth": hbm_bw,
    "ici_bandwidth": ici_bw,
    "step_s_lower_bound": step,
    "bound_by": max(times, key=times.__getitem__),
    "mfu_upper_bound": model_flops / peak / step,
    "tokens_per_s_upper_bound": tokens / step,
  }


def weight_counts(cfg: specs.ModelSpec) -> tuple[int, int]:
  """(block weights, head weights: final AdaLN and head, or the tied embedding) of a model."""
  shapes = _shapes(cfg)
  n_blocks = model_lib.count_params(shapes["blocks"])
  if cfg.arch.tied_head:
    return n_blocks, cfg.vocab_size * cfg.n_embd
  return n_blocks, model_lib.count_params({k: shapes[k] for k in ("final_adaln", "head")})


@functools.cache
def _shapes(cfg: specs.ModelSpec) -> Any:
  """The unboxed param shapes of a model (one trace per spec: the counts below share it)."""
  return nn.unbox(jax.eval_shape(lambda k: model_lib.init_params(cfg, k), jax.random.key(0)))


def decode_weight_counts(cfg: specs.ModelSpec) -> tuple[int, int, int]:
  """(block weights a decode slot multiplies by: all but AdaLN's, whose outputs a decode loop
  makes once per target position; of those, the K and V projections'; head weights)."""
  blocks = _shapes(cfg)["blocks"]
  n_blocks, n_head = weight_counts(cfg)
  n_adaln = model_lib.count_params(blocks["adaln"]) if cfg.arch.adaln else 0
  return n_blocks - n_adaln, 2 * model_lib.count_params(blocks["qkv"]) // 3, n_head


def _itemsize(cfg: specs.ModelSpec) -> int:
  """Bytes of one number in the model's compute dtype (weights and cache are read in it)."""
  return jnp.dtype(model_lib.DTYPES[cfg.dtype]).itemsize


def _cache_bytes(cfg: specs.ModelSpec, batch: int, length: int) -> int:
  """Bytes of every layer's K and V for `length` positions of `batch` rows."""
  return 2 * cfg.n_layer * batch * length * cfg.n_embd * _itemsize(cfg)


def step_costs(cfg: specs.ModelSpec, plan: Any, batch: int) -> list[dict]:
  """What each cache bucket's steps of a parallel plan (its spec's `plan`: chunk widths and
  segments) must do at least, in cfg.dtype: `bytes` read per step (the
  weights it multiplies by: blocks but AdaLN, final AdaLN and head; AdaLN table and embedding
  rows being gathered; plus the K/V cache prefix it attends to) and `flops` per step (2 per
  weight per slot; the last layer past its K/V and the head only for the 1 + W_p queries read;
  attention 4 D per layer, query and key). One dict per plan segment."""
  itemsize = _itemsize(cfg)
  n_slot, n_kv, n_head = decode_weight_counts(cfg)
  layers, d = cfg.n_layer, cfg.n_embd
  w, q = plan.real_width + plan.phantom_width, 1 + plan.phantom_width
  per_slot = (layers - 1) * n_slot / layers + n_kv / layers  # weights of a column not read
  # A slot gathers each layer's row of its AdaLN table: as many numbers as that layer's bias.
  adaln = _shapes(cfg)["blocks"]["adaln"]["bias"] if cfg.arch.adaln else None
  table_bytes = itemsize * batch * w * (model_lib.count_params(adaln) if adaln else 0)
  costs = []
  for first, end, cache_len in plan.segments:
    cache_bytes = _cache_bytes(cfg, batch, cache_len)
    queries = (layers - 1) * w + q  # query rows over all layers
    flops = 2 * batch * (w * per_slot + q * ((n_slot - n_kv) / layers + n_head))
    flops += 4 * d * batch * queries * (cache_len + w)
    costs.append(
      {
        "steps": end - first,
        "cache_len": cache_len,
        "flops": flops,
        "bytes": itemsize * (n_slot + n_head) + table_bytes + cache_bytes,
        "cache_bytes": cache_bytes,
      }
    )
  return costs


def forward_costs(cfg: specs.ModelSpec, batch: int) -> dict:
  """The same counts for one full training forward of [batch, T] (attention over all T x T)."""
  itemsize = _itemsize(cfg)
  n_blocks, n_head = weight_counts(cfg)
  t = cfg.block_size
  attention = 4 * cfg.n_layer * cfg.n_embd * batch * t * t
  return {
    "flops": 2 * batch * t * (n_blocks + n_head) + attention,
    "bytes": itemsize * (n_blocks + n_head),
  }


def step_floors(
  cfg: specs.ModelSpec, plan: Any, b: int, bandwidth: float, peak: float
) -> np.ndarray:
  """Seconds each cached decode step must take at least: max(bytes / bandwidth, FLOPs / peak),
  with the bytes and FLOPs of step_costs."""
  return np.concatenate(
    [
      np.full(c["steps"], max(c["bytes"] / bandwidth, c["flops"] / peak))
      for c in step_costs(cfg, plan, b)
    ]
  )


def speculative_read_ratio(cfg: specs.ModelSpec, k: int, batch: int, head: bool) -> float:
  """Bytes a speculative iteration reads over those of a cached L2R step (S = T), where both
  are bound by reading (an accelerator at small batch): the weights once and the whole K/V
  cache, plus per drafted token of a learned head the head and the model's final AdaLN and
  vocab head again (self-drafting reads nothing more)."""
  t = cfg.block_size
  plan = policies.get("parallel").build(protocol.Batch.unconditional({}, cfg), steps=t).spec.plan
  costs = step_costs(cfg, plan, batch)
  step = sum(c["bytes"] * c["steps"] for c in costs) / sum(c["steps"] for c in costs)
  itemsize = _itemsize(cfg)
  n_slot, _, n_head = decode_weight_counts(cfg)
  iteration = itemsize * (n_slot + n_head) + _cache_bytes(cfg, batch, cfg.block_size)
  if head:
    from ao_mdm.decode import draft

    n_draft = model_lib.count_params(
      jax.eval_shape(lambda: draft.init_head(cfg, jax.random.key(0)))
    )
    iteration += k * itemsize * (n_draft + n_head)
  return iteration / step
