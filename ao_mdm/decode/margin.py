"""The margin policy (Kim et al. 2025, "Train for the worst, plan for the best"): each step
commits the positions whose top-1 minus top-2 probability is largest, an order planned from the
model's own certainty. It is an adaptive order (confidence.DecoderSpec: its state, insert and
step) with its own score; registered in policies.py as `margin`."""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ao_mdm.decode import confidence, protocol


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderSpec(confidence.DecoderSpec):
  """Candidates ranked by the margin between their two most probable tokens."""

  def confidence(self, logits_BUV: jax.Array) -> jax.Array:
    top2 = jax.lax.top_k(jax.nn.softmax(logits_BUV.astype(jnp.float32), axis=-1), 2)[0]
    return top2[..., 0] - top2[..., 1]


static = functools.partial(confidence.static, rule=DecoderSpec)
sample = functools.partial(protocol.sample, static)
continuing = functools.partial(confidence.continuing, rule=DecoderSpec)
