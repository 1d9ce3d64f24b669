"""The scorer: jitted per-slot NLLs of a model placed on a mesh, what every perplexity and the
validation during training are computed from."""

from collections.abc import Callable
import functools
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from ao_mdm import model as model_lib
from ao_mdm import sharding, specs


class Scorer:
  """Jitted per-slot NLLs of a model on a mesh: params replicated or sharded by the rules.

  `ao-mdm eval` and the validation during training both score through this class, in `dtype`
  (float32 by default, as the authors evaluate, whatever the model trains in).
  """

  def __init__(
    self,
    params: Any,
    cfg: specs.ModelSpec,
    mesh_spec: specs.MeshSpec | None = None,
    dtype: str = "float32",
  ):
    self.cfg = cfg.replace(dtype=dtype)
    self.model = model_lib.make_model(self.cfg)
    self.mesh, self.rules, self._param_shardings = sharding.placement(cfg, mesh_spec)
    self.dp = sharding.data_parallel_size(self.mesh, self.rules)
    self.set_params(params)

  def set_params(self, params: Any) -> None:
    """Score with `params` from now on (no recompilation; already-placed params stay put)."""
    self.params = jax.device_put(params, self._param_shardings)

  @functools.cached_property
  def _nll(self) -> Callable:
    # Replicated output: every process of a multi-host run reads all the NLLs.
    return jax.jit(
      functools.partial(model_lib.slot_nll, self.model),
      out_shardings=sharding.replicated(self.mesh),
    )

  @functools.cached_property
  def _scores(self) -> Callable:
    return jax.jit(
      functools.partial(model_lib.slot_scores, self.model),
      out_shardings=sharding.replicated(self.mesh),
    )

  @property
  def vocab_size(self) -> int:
    return int(self.cfg.vocab_size)

  @property
  def block_size(self) -> int:
    return int(self.cfg.block_size)

  def token_nll(self, ids_BT: np.ndarray) -> np.ndarray:
    """[B, T-1] L2R NLL of tokens 1..T-1 (the generative-perplexity interface)."""
    return l2r_nll(self, ids_BT)[:, 1:]

  def slot_nll(self, tokens_BT: np.ndarray, order_Bt: np.ndarray) -> np.ndarray:
    """[B, t] NLL of slot s (target order[s]) given the tokens at order[:s]; t <= T slots.

    Every process passes the same whole batch; each places its own part on the mesh.
    """
    return np.asarray(self._run(self._nll, tokens_BT, order_Bt), np.float64)

  def slot_scores(self, tokens_BT: np.ndarray, order_Bt: np.ndarray) -> tuple:
    """([B, t] NLL as slot_nll, [B, t] bool: the target is the slot's most likely token)."""
    nll, greedy = self._run(self._scores, tokens_BT, order_Bt)
    return np.asarray(nll, np.float64), np.asarray(greedy)

  def _run(self, fn: Callable, tokens_BT: np.ndarray, order_Bt: np.ndarray) -> Any:
    b = len(tokens_BT)
    pad = -b % self.dp  # the batch is split over the data axes: pad it to a multiple
    if pad:
      tokens_BT = np.concatenate([tokens_BT, np.repeat(tokens_BT[:1], pad, 0)])
      order_Bt = np.concatenate([order_Bt, np.repeat(order_Bt[:1], pad, 0)])
    batch = sharding.batch_sharding(self.mesh, self.rules)
    place = lambda x: jax.make_array_from_callback(x.shape, batch, lambda index: x[index])
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      out = fn(
        self.params, place(np.asarray(tokens_BT, np.int32)), place(np.asarray(order_Bt, np.int32))
      )
    return jax.tree.map(lambda x: x[:b], jax.device_get(out))


def l2r_nll(scorer: Any, tokens_BT: np.ndarray) -> np.ndarray:
  """[B, T] NLL of each token under the identity order, from anything with `slot_nll`."""
  b, t = tokens_BT.shape
  return scorer.slot_nll(tokens_BT, np.broadcast_to(np.arange(t), (b, t)))
