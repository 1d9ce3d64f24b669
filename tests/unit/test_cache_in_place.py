"""The decode loops update the K/V cache in place: their compiled programs copy no cache array.

A copy of the cache per step reads and writes all of it again (on this CPU it cost more than
attention itself); XLA inserts one when a layer's cache is sliced out of a larger buffer for a
matmul, or read after a write that nothing orders before it.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import batching, confidence, parallel, protocol, schedules, speculative

T, H, K = 32, 2, 16


def _model():
  cfg = specs.default().model.replace(
    block_size=T, vocab_size=64, n_layer=2, n_embd=H * K, n_head=H
  )
  return cfg, nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))


def cache_copies(hlo: str, b: int) -> list[str]:
  """Copies of a cache-shaped array ([B, H, K, P] or [B, H, P, K]) of a loop's state."""
  shape = rf"f32\[{b},{H},(?:{K},\d+|\d+,{K})\]"
  return re.findall(rf"%copy[.\d]* = {shape}\S* copy\(%get-tuple-element[^)]*\)", hlo)


def _compiled(name: str, b: int = 3, steps: int = 8) -> str:
  cfg, params = _model()
  tokens, known = jnp.zeros((b, T), jnp.int32), jnp.zeros((b, T), bool)
  draw = (jax.random.key(1), jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))
  if name == "parallel":  # S = 8: four cache buckets, 4 tokens per step
    counts = schedules.schedule_counts(T, 0, steps, "linear").tolist()
    spec = parallel.DecoderSpec(
      model=cfg, plan=parallel.Plan.make(np.array(counts)), order="random"
    )
    fn = protocol.decoder(spec, spec.row_plan(counts, steps))
    args = (params, tokens, known, *draw)
  elif name == "confidence":
    counts = schedules.schedule_counts(T, 0, 8, "linear").tolist()
    spec = confidence.DecoderSpec(model=cfg, width=4, real_width=4)
    fn = protocol.decoder(spec, spec.row_plan(counts, 8))
    args = (params, tokens, known, *draw)
  else:
    fn = protocol.decoder(speculative.DecoderSpec(model=cfg, k=3), speculative.RowPlan((0, T, 3)))
    args = (params, tokens, known, *draw)
  return fn.lower(*args).compile().as_text()


@pytest.mark.parametrize("name", ["parallel", "confidence", "speculative"])
def test_decode_loop_copies_no_cache_array(name):
  hlo = _compiled(name)
  assert re.search(rf"f32\[3,{H},{K},\d+\]", hlo), "no cache-shaped array: the test is stale"
  assert cache_copies(hlo, 3) == []


def test_one_row_one_token_a_step_copies_no_cache_array():
  # Batch 1, S = T: one write a layer, which model.cache_write pads with a dropped one.
  assert cache_copies(_compiled("parallel", b=1, steps=T), 1) == []


def test_cache_copies_finds_a_copy_of_loop_state():
  # The pattern the tests above must not find, as XLA prints it.
  hlo = f"  %copy.913 = f32[3,{H},{T},{K}]{{3,2,1,0}} copy(%get-tuple-element.3593)"
  assert len(cache_copies(hlo, 3)) == 1


@pytest.mark.parametrize("rows", [2, 3])
def test_the_served_step_and_insert_copy_no_cache_array(rows):
  """The continuous batcher's steps and insert (the server's, GRPO's rollouts), at both of its
  state sizes, take the state donated: without it each copied every layer's cache in full (4
  copies here)."""
  cfg, params = _model()
  b = batching.Batcher.continuing(params, cfg, batch=3, tokens_per_step=2)
  b._resize(rows)
  b._hold(T)
  full = rf"f32\[{rows},{H},(?:{K},{T}|{T},{K})\]"  # the whole cache, as the step holds it
  copies = lambda hlo: re.findall(rf"%\S+ = {full}\S* copy\(", hlo)
  step = (
    b._advance.lower(b._stepped, b.state, protocol.Shape(T), jnp.int32(4), jnp.asarray(True))
    .compile()
    .as_text()
  )
  assert re.search(full, step) and copies(step) == []
  zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
  kv = b._prefill(b.params, zeros(1, T), zeros(1, T), 8)
  insert = b._insert.lower(
    b.state, zeros(1), zeros(1, T), zeros(1, T), zeros(1),
    jax.random.split(jax.random.key(0), 1), (jnp.ones(1), jnp.ones(1), zeros(1)),
    parallel.RowPlan(zeros(1, T + 1), zeros(1, T + 1)), kv,
  ).compile().as_text()  # fmt: skip
  assert re.search(full, insert) and copies(insert) == []
