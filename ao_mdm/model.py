"""AO-GPT and the sigma-GPT baseline (docs/design.md, "The model"): one forward for training and
decoding.

Slots: slot 0 is the learned [None] token, slot s >= 1 holds the token at position order[s-1], and
slot s predicts the token at position order[s]. Array names carry their shapes in the letters of
docs/design.md ("Shape letters"): B batch, T slots (t: the first t), W a decode chunk, P cache
prefix, D width, C conditioning, J modulation vectors, H heads, K head dim, V vocab, L layers.

AO-GPT's conditioning `cond` is a pair (c_TC, target_BW): silu of the target-position embedding
table and each slot's target position. An AdaLN layer's output depends on the target position
only, so it is computed on the T table rows and gathered whenever that is fewer rows than B x W.
"""

from collections.abc import Callable
import functools
import math
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ao_mdm import specs

REMAT = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
DTYPES = {name: jnp.dtype(name) for name in specs.DTYPES}
NORM_EPS = 1e-5
INPUT_AXES = {"attn_out": 2}  # Dense layers (by name) whose kernel reads more than the last axis


def _init(cfg, std: float, names: tuple):
  """Truncated normal cut at +-3 std or plain normal (cfg.arch), with logical axes."""
  if cfg.arch.truncated_init:
    init = nn.initializers.truncated_normal(std, lower=-3.0, upper=3.0)
  else:
    init = nn.initializers.normal(std)
  return nn.with_logical_partitioning(init, names)


def _zeros(names: tuple):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _ones(names: tuple):
  return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


class Norm(nn.Module):
  """RMSNorm or LayerNorm with bias (cfg.arch), computed in float32."""

  cfg: specs.ModelSpec
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x):
    dim = x.shape[-1]
    scale = self.param("scale", _ones((self.axis_name,)), (dim,), jnp.float32)
    x32 = x.astype(jnp.float32)
    if self.cfg.arch.rms_norm:
      y = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + NORM_EPS) * scale
    else:
      bias = self.param("bias", _zeros((self.axis_name,)), (dim,), jnp.float32)
      mean = jnp.mean(x32, axis=-1, keepdims=True)
      var = jnp.mean((x32 - mean) ** 2, axis=-1, keepdims=True)
      y = (x32 - mean) * jax.lax.rsqrt(var + NORM_EPS) * scale + bias
    return y.astype(x.dtype)


def attention(
  q_BWHK, k_BWHK, v_BWHK, mask_WW=None, cache_k_BHKT=None, cache_v_BHTK=None, cache_mask_WP=None
):
  """Softmax attention of W queries over W new keys (causal without mask_WW) and P cached keys.

  The cache is heads-major with the keys transposed (k [B, H, K, T], v [B, H, T, K]), so that
  both products with it are plain batched matmuls over a contiguous axis; P is the cache mask's
  length (cache_mask_WP), and reading the prefix here, inside the layer, lets XLA take it from
  the whole cache in one slice. The scores are split into the cache part and the new part so the
  cache is never concatenated with the new keys.
  """
  dtype = q_BWHK.dtype
  scale = q_BWHK.shape[-1] ** -0.5
  s_BHWW = jnp.einsum("bqhk,bshk->bhqs", q_BWHK, k_BWHK).astype(jnp.float32) * scale
  w = q_BWHK.shape[1]
  mask_WW = jnp.tril(jnp.ones((w, w), bool)) if mask_WW is None else mask_WW
  s_BHWW = jnp.where(mask_WW, s_BHWW, -jnp.inf)
  if cache_k_BHKT is None:
    p_BHWW = jax.nn.softmax(s_BHWW, axis=-1)
    return jnp.einsum("bhqs,bshk->bqhk", p_BHWW.astype(dtype), v_BWHK)
  prefix = cache_mask_WP.shape[-1]
  k_BHKP, v_BHPK = cache_k_BHKT[..., :prefix], cache_v_BHTK[:, :, :prefix]
  q_BHWK = q_BWHK.transpose(0, 2, 1, 3)
  s_BHWP = jnp.einsum("bhqk,bhkp->bhqp", q_BHWK, k_BHKP.astype(dtype)).astype(jnp.float32)
  s_BHWP = jnp.where(cache_mask_WP, s_BHWP * scale, -jnp.inf)
  # One softmax over the cache and new keys, never concatenated (each query sees itself).
  top_BHW1 = jnp.maximum(s_BHWP.max(-1, keepdims=True), s_BHWW.max(-1, keepdims=True))
  e_BHWP, e_BHWW = jnp.exp(s_BHWP - top_BHW1), jnp.exp(s_BHWW - top_BHW1)
  sum_BHW1 = e_BHWP.sum(-1, keepdims=True) + e_BHWW.sum(-1, keepdims=True)
  p_BHWP, p_BHWW = (e_BHWP / sum_BHW1).astype(dtype), (e_BHWW / sum_BHW1).astype(dtype)
  out_BHWK = jnp.einsum("bhqp,bhpk->bhqk", p_BHWP, v_BHPK.astype(dtype))
  return out_BHWK.transpose(0, 2, 1, 3) + jnp.einsum("bhqs,bshk->bqhk", p_BHWW, v_BWHK)


def cache_write(
  cache_k_BHKP, cache_v_BHPK, k_BWHK, v_BWHK, slots_BW, rows_B=None
) -> tuple[jax.Array, jax.Array]:
  """A layer's cache (as `attention` reads it) with a chunk's first W columns' K/V written at
  slots slots_BW [B, W] of rows rows_B (default: all, in order); slots >= P are dropped."""
  rows_B1 = (jnp.arange(slots_BW.shape[0]) if rows_B is None else rows_B)[:, None]
  k_BWHK, v_BWHK = k_BWHK[:, : slots_BW.shape[1]], v_BWHK[:, : slots_BW.shape[1]]
  if slots_BW.size == 1:  # one write is a dynamic-update-slice: XLA copies the cache around it
    slots_BW = jnp.concatenate([slots_BW, jnp.full_like(slots_BW, cache_v_BHPK.shape[2])], 1)
    k_BWHK, v_BWHK = jnp.repeat(k_BWHK, 2, 1), jnp.repeat(v_BWHK, 2, 1)
  # Advanced indices split by the head axis: the indexed result's axes are [B, W, H, K].
  k = cache_k_BHKP.at[rows_B1, :, :, slots_BW].set(k_BWHK.astype(cache_k_BHKP.dtype), mode="drop")
  v = cache_v_BHPK.at[rows_B1, :, slots_BW].set(v_BWHK.astype(cache_v_BHPK.dtype), mode="drop")
  return k, v


def platform() -> str:
  """The platform being traced for: the mesh's (a TPU topology compiled for on a CPU host is
  'tpu'), else the default backend's."""
  mesh = jax.sharding.get_abstract_mesh()
  return jax.default_backend() if mesh.empty else mesh.abstract_device.platform


def attention_kind(cfg: specs.ModelSpec, target: str, length: int) -> str:
  """The attention `cfg.attention` means for `length` slots on platform `target`: 'auto' is
  splash on TPU, cuDNN on GPU in bfloat16 with a head dim it takes, else XLA; splash needs the
  length in blocks of 128 (a forward cut short, as the ensemble's, falls back to XLA)."""
  if cfg.attention == "splash" or (cfg.attention == "auto" and target == "tpu"):
    return "splash" if length % 128 == 0 else "xla"
  if cfg.attention != "auto":
    return cfg.attention
  k_dim = cfg.n_embd // cfg.n_head
  if target in ("gpu", "cuda") and cfg.dtype == "bfloat16" and k_dim <= 128 and k_dim % 8 == 0:
    return "cudnn"
  return "xla"


def _splash_kernel(t: int, heads: int, interpret: bool) -> Any:
  """The causal splash kernel over t slots of `heads` heads, built at each trace (it holds
  arrays, which must not outlive one); its blocks: the largest of 512, 256, 128 that divides t
  (the kernel computes in blocks of at least 128 keys)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  b = next(b for b in (512, 256, 128) if t % b == 0)
  names = ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute", "q_dq", "kv_dq")
  blocks = splash.BlockSizes(**{f"block_{n}": cast(Any, b) for n in names})
  mask = splash.MultiHeadMask([splash.CausalMask((t, t)) for _ in range(heads)])
  return splash.make_splash_mha(
    mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
  )


def splash_attention(q_BTHK, k_BTHK, v_BTHK):
  """Causal softmax attention over all T slots by the Pallas splash kernel (docs/design.md,
  "The model"): on a mesh each device runs it on its rows and heads (shard_map); interpreted
  off TPU. The kernel does not scale the scores, so q is scaled first."""
  interpret = platform() != "tpu"

  def local(q_bThK, k_bThK, v_bThK):
    b, t, h, k_dim = q_bThK.shape
    kernel = _splash_kernel(t, h, interpret)
    heads_first = lambda x: x.transpose(0, 2, 1, 3)
    out_bhTK = jax.vmap(kernel)(
      heads_first(q_bThK * k_dim**-0.5), heads_first(k_bThK), heads_first(v_bThK)
    )
    return heads_first(out_bhTK)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(q_BTHK, k_BTHK, v_BTHK)
  spec = _splash_spec()
  return jax.shard_map(
    local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
  )(q_BTHK, k_BTHK, v_BTHK)


def _splash_spec() -> jax.sharding.PartitionSpec:
  spec = nn.logical_to_mesh_axes(("batch", "length", "heads", "kv"))
  assert spec is not None  # None only for no names
  return spec


def splash_fits(q_BTHK) -> bool:
  """Whether each device gets whole rows and heads of q (not so for the batch of one that
  initialises the params, which then goes through XLA attention)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return True
  for size, axes in zip(q_BTHK.shape, _splash_spec()):
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    if size % math.prod(mesh.shape[a] for a in axes):
      return False
  return True


ATTENTION: dict[str, Callable[..., Any]] = {
  "xla": attention,
  "cudnn": functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"),
  "splash": splash_attention,
}


def attend(cfg: specs.ModelSpec, q_BWHK, k_BWHK, v_BWHK, cache=None, mask=None):
  """The one attention switch: causal (training, scoring, a decode prefill) by cfg's kind; a
  decode chunk's, masked per row over chunk and cache, by `attention`, which takes such masks."""
  if cache is None and mask is None:
    kind = attention_kind(cfg, platform(), q_BWHK.shape[1])
    kind = "xla" if kind == "splash" and not splash_fits(q_BWHK) else kind
    return ATTENTION[kind](q_BWHK, k_BWHK, v_BWHK)
  cached = () if cache is None else (cache["k"], cache["v"], mask["cache"])
  return attention(q_BWHK, k_BWHK, v_BWHK, None if mask is None else mask["new"], *cached)


class Dense(nn.Module):
  """Kernel over the input's last INPUT_AXES[name] axes (default 1) to `features`, in cfg.dtype."""

  cfg: specs.ModelSpec
  features: tuple
  names: tuple  # logical axis names of the kernel: input axes, then output axes
  std: float = 0.02
  use_bias: bool = True
  float32_out: bool = False  # accumulate and return float32 (the head's logits)

  @nn.compact
  def __call__(self, x):
    n_in = INPUT_AXES.get(self.name or "", 1)
    shape = x.shape[-n_in:] + tuple(self.features)
    x_NI = x.reshape(-1, math.prod(shape[:n_in])).astype(DTYPES[self.cfg.dtype])
    if self.has_variable("params", "kernel_OI"):  # a decode loop's (decode/engine.output_major)
      kernel_IO = self.get_variable("params", "kernel_OI").T
    else:
      # One 2-D matmul: XLA:CPU transposes a 3-D operand for the kernel gradient (2x slower).
      kernel = self.param("kernel", _init(self.cfg, self.std, self.names), shape, jnp.float32)
      kernel_IO = kernel.reshape(x_NI.shape[1], -1)
    out_dtype = jnp.float32 if self.float32_out else None
    y_NO = jnp.matmul(x_NI, kernel_IO.astype(x_NI.dtype), preferred_element_type=out_dtype)
    if self.use_bias:
      bias = self.param("bias", _zeros(self.names[n_in:]), tuple(self.features), jnp.float32)
      y_NO = y_NO + bias.reshape(-1).astype(y_NO.dtype)
    return y_NO.reshape(x.shape[:-n_in] + tuple(self.features))


def per_slot(dense: nn.Module, cond: tuple, mod_TJD: Any = None) -> list:
  """dense(c) ([.., J, D]) for each slot's target position, as J arrays [B, W, D], gathered from
  the table (or mod_TJD, the table made before) one part at a time, so that XLA fuses each
  gather into its consumer."""
  c_TC, target_BW = cond
  if mod_TJD is None and target_BW.size > c_TC.shape[0]:
    mod_TJD = dense(c_TC)
  if mod_TJD is not None:
    return [jnp.take(mod_TJD[:, i], target_BW, axis=0) for i in range(mod_TJD.shape[1])]
  mod_BWJD = dense(jnp.take(c_TC, target_BW, axis=0))
  return [mod_BWJD[:, :, i] for i in range(mod_BWJD.shape[2])]


def columns(x_BW: jax.Array, cols_BQ: jax.Array) -> jax.Array:
  """x [B, W, ...] at columns cols_BQ: [B, Q, ...]."""
  return jnp.take_along_axis(x_BW, cols_BQ.reshape(cols_BQ.shape + (1,) * (x_BW.ndim - 2)), 1)


def adaln_dense(cfg: specs.ModelSpec, name: str | None = None) -> "Dense":
  """A block's AdaLN layer: the target's conditioning -> 6 modulations of D."""
  return Dense(cfg, (6, cfg.n_embd), ("cond", None, "embed"), name=name)


class Block(nn.Module):
  """Pre-norm transformer block; AO-GPT modulates both norms with AdaLN from the target.
  `cache`: None or a dict: a layer's {"k", "v"} (`attention`'s layout; without, no cache read),
  "slots_BW" to write the chunk's K/V there first (returned as kv["cache"]), "cols_BQ" to return
  only those columns (every column's K/V is still made; the rest of the block runs on Q rows),
  "adaln_TJD" the AdaLN table made before (DecodeModel.loop_params)."""

  cfg: specs.ModelSpec
  return_kv: bool = False

  @nn.compact
  def __call__(self, x_BWD, cond, cache, mask):
    cfg = self.cfg
    d, h = cfg.n_embd, cfg.n_head
    k_dim = d // h
    resid_std = 0.02 / (2 * cfg.n_layer) ** 0.5

    if cfg.arch.adaln:
      table = None if cache is None else cache.get("adaln_TJD")
      shift1, scale1, gate1, shift2, scale2, gate2 = per_slot(
        adaln_dense(cfg, "adaln"), cond, table
      )
      modulate = lambda y, shift, scale: y * (1 + scale) + shift
    else:
      modulate = lambda y, shift, scale: y
      shift1 = scale1 = shift2 = scale2 = None
      gate1 = gate2 = 1.0

    y = modulate(Norm(cfg, name="ln_1")(x_BWD), shift1, scale1)
    qkv = Dense(cfg, (3, h, k_dim), ("embed", None, "heads", "kv"), name="qkv")(y)
    q_BWHK, k_BWHK, v_BWHK = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if cfg.arch.qk_norm:
      q_BWHK = Norm(cfg, "kv", name="q_norm")(q_BWHK)
      k_BWHK = Norm(cfg, "kv", name="k_norm")(k_BWHK)
    written = None
    if cache is not None and "slots_BW" in cache:
      # Written before the cache is read (masked there): a read before the write is a copy.
      written = cache_write(cache["k"], cache["v"], k_BWHK, v_BWHK, cache["slots_BW"])
    if cache is not None and "cols_BQ" in cache:
      cols_BQ = cache["cols_BQ"]
      at = lambda a: columns(a, cols_BQ)
      x_BWD, q_BWHK = at(x_BWD), at(q_BWHK)
      mask = {n: jnp.take_along_axis(m, cols_BQ[:, None, :, None], 2) for n, m in mask.items()}
      if cfg.arch.adaln:
        shift2, scale2, gate1, gate2 = map(at, (shift2, scale2, gate1, gate2))
    if written is not None:
      cache = {"k": written[0], "v": written[1]}
    a_BWHK = attend(cfg, q_BWHK, k_BWHK, v_BWHK, cache if cache and "k" in cache else None, mask)
    a_BWD = Dense(cfg, (d,), ("heads", "kv", "embed"), resid_std, name="attn_out")(a_BWHK)
    x_BWD = x_BWD + gate1 * a_BWD
    x_BWD = nn.with_logical_constraint(x_BWD, ("batch", "length", "embed"))

    y = modulate(Norm(cfg, name="ln_2")(x_BWD), shift2, scale2)
    y = Dense(cfg, (4 * d,), ("embed", "mlp"), name="mlp_in")(y)
    y = nn.gelu(y, approximate=False)
    y = Dense(cfg, (d,), ("mlp", "embed"), resid_std, name="mlp_out")(y)
    x_BWD = x_BWD + gate2 * y
    x_BWD = nn.with_logical_constraint(x_BWD, ("batch", "length", "embed"))
    kv = {"k": k_BWHK, "v": v_BWHK} if self.return_kv else None
    if written is not None:
      kv = {**(kv or {}), "cache": written}
    return x_BWD, kv


class AOGPT(nn.Module):
  """AO-GPT or sigma-GPT (cfg.variant, built as cfg.arch says) over T order slots. With
  decode=True the stack also returns each layer's K/V (a decode prefill); a chunk that reads a
  KV cache runs the layers one by one instead (decode/engine.py)."""

  cfg: specs.ModelSpec
  decode: bool = False

  def setup(self):
    cfg = self.cfg
    d, t = cfg.n_embd, cfg.block_size
    self.token_embed = self.param(
      "token_embed", _init(cfg, 0.02, ("vocab", "embed")), (cfg.vocab_size, d), jnp.float32
    )
    self.pos_embed = self.param(
      "pos_embed", _init(cfg, cfg.position_std, (None, "embed")), (t + 1, d), jnp.float32
    )
    self.none_embed = self.param("none_embed", _init(cfg, 0.02, ("embed",)), (d,), jnp.float32)
    self.target_embed = self.param(
      "target_embed",
      _init(cfg, cfg.position_std, (None, "cond" if cfg.arch.adaln else "embed")),
      (t, cfg.cond_dim if cfg.arch.adaln else d),
      jnp.float32,
    )
    block = (
      Block
      if REMAT[cfg.remat] is None
      else nn.remat(Block, policy=REMAT[cfg.remat], prevent_cse=False)
    )
    blocks = nn.scan(
      block,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
      length=cfg.n_layer,
      unroll=cfg.n_layer if cfg.unroll_layers else 1,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    self.blocks = blocks(cfg, return_kv=self.decode, name="blocks")
    self.ln_f = Norm(cfg)
    if cfg.arch.adaln:
      self.final_adaln = Dense(cfg, (2, d), ("cond", None, "embed"))
    if not cfg.arch.tied_head:
      self.head = Dense(cfg, (cfg.vocab_size,), ("embed", "vocab"), float32_out=True)

  def embed(self, prev_tok_BW, prev_pos_BW, target_pos_BW):
    """Slot inputs (token + position of the previous order entry, -1 for [None]) and targets.

    Returns x_BWD in the compute dtype and the conditioning `cond` (None without AdaLN: the
    target embedding is added to the input instead).
    """
    dtype = DTYPES[self.cfg.dtype]
    tok_BWD = jnp.take(self.token_embed, prev_tok_BW, axis=0)
    tok_BWD = jnp.where((prev_pos_BW < 0)[..., None], self.none_embed, tok_BWD)
    x_BWD = tok_BWD + jnp.take(self.pos_embed, prev_pos_BW + 1, axis=0)
    if not self.cfg.arch.adaln:
      return (x_BWD + jnp.take(self.target_embed, target_pos_BW, axis=0)).astype(dtype), None
    return x_BWD.astype(dtype), (nn.silu(self.target_embed.astype(dtype)), target_pos_BW)

  def stack(self, x_BWD, cond, mask=None):
    """The layer stack (causal, or by `mask` over the chunk); returns hidden states and
    (decode=True) the per-layer K/V."""
    x_BWD = nn.with_logical_constraint(x_BWD, ("batch", "length", "embed"))
    return self.blocks(x_BWD, cond, None, mask)

  def logits(self, h_BWD, cond):
    """Final (modulated) norm and the output head; float32 logits (a bf16 model's head
    accumulates in float32)."""
    y = self.ln_f(h_BWD)
    if self.cfg.arch.adaln:
      shift, scale = per_slot(self.final_adaln, cond)
      y = y * (1 + scale) + shift
    if not self.cfg.arch.tied_head:
      out = self.head(y)
    else:  # the token embedding is the head
      out = jnp.einsum(
        "bwd,vd->bwv", y, self.token_embed.astype(y.dtype), preferred_element_type=jnp.float32
      )
    return nn.with_logical_constraint(out.astype(jnp.float32), ("batch", "length", "vocab"))

  def __call__(self, tokens_BT, order_BT, return_hidden: bool = False):
    """Training forward: logits where slot s predicts the token at position order[s].

    The order may stop early (t <= T slots, e.g. to score a target without later slots).
    With `return_hidden`, (logits, the final hidden states h_BTD before the output norm): what a
    draft head reads (decode/draft.py).
    """
    if tokens_BT.ndim != 2 or tokens_BT.shape[1] > self.cfg.block_size:
      raise ValueError(
        f"tokens have shape {tuple(tokens_BT.shape)}; expected [batch, T] with "
        f"T <= model.block_size={self.cfg.block_size}"
      )
    if order_BT.shape[0] != tokens_BT.shape[0] or order_BT.shape[1] > tokens_BT.shape[1]:
      raise ValueError(
        f"order shape {tuple(order_BT.shape)} does not fit tokens shape "
        f"{tuple(tokens_BT.shape)}: an order may cover fewer slots, not more"
      )
    prev_tok_BT, prev_pos_BT = slot_inputs(tokens_BT, order_BT)
    x_BTD, cond = self.embed(prev_tok_BT, prev_pos_BT, order_BT)
    h_BTD, _ = self.stack(x_BTD, cond)
    logits_BTV = self.logits(h_BTD, cond)
    return (logits_BTV, h_BTD) if return_hidden else logits_BTV


def slot_inputs(tokens_BT: jax.Array, order_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Token and position fed at each slot: slot 0 gets [None] (position -1), slot s order[s-1]."""
  none_B1 = jnp.full(order_BT[:, :1].shape, -1, order_BT.dtype)
  prev_pos_BT = jnp.concatenate([none_B1, order_BT[:, :-1]], axis=1)
  prev_tok_BT = jnp.take_along_axis(tokens_BT, jnp.maximum(prev_pos_BT, 0), axis=1)
  return prev_tok_BT, prev_pos_BT


def slot_labels(tokens_BT: jax.Array, order_BT: jax.Array) -> jax.Array:
  """The label of slot s is the token at position order[s]."""
  return jnp.take_along_axis(tokens_BT, order_BT, axis=1)


def slot_nll(model: AOGPT, params: Any, tokens_BT: jax.Array, order_Bt: jax.Array) -> jax.Array:
  """[B, t] float32 NLL of each slot's target, from integer labels (no one-hot over V)."""
  logits_BtV = model.apply({"params": params}, tokens_BT, order_Bt)
  return optax.softmax_cross_entropy_with_integer_labels(
    logits_BtV, slot_labels(tokens_BT, order_Bt)
  )


def slot_scores(model: AOGPT, params: Any, tokens_BT: jax.Array, order_Bt: jax.Array) -> tuple:
  """([B, t] NLL as slot_nll, [B, t] whether the target has the slot's largest logit: the
  harness's is_greedy)."""
  logits_BtV = cast(jax.Array, model.apply({"params": params}, tokens_BT, order_Bt))
  labels_Bt = slot_labels(tokens_BT, order_Bt)
  target_Bt = jnp.take_along_axis(logits_BtV, labels_Bt[..., None], axis=-1)[..., 0]
  return (
    optax.softmax_cross_entropy_with_integer_labels(logits_BtV, labels_Bt),
    target_Bt >= jnp.max(logits_BtV, axis=-1),
  )


def count_params(params: Any) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))


def flops_per_token(cfg: specs.ModelSpec, n_params: int, width: int | None = None) -> float:
  """Training FLOPs per token: 6N for the weights (embedding lookups excluded) plus attention.

  Attention: 12 * L * D * width (QK^T and AV, forward and backward, the full square of the
  `width` positions a row runs, T unless narrowed).
  """
  t, d = cfg.block_size, cfg.n_embd
  # The token embedding, when tied, is also the head: its matmul counts.
  n_lookup = (t + 2) * d + t * (cfg.cond_dim if cfg.arch.adaln else d)
  n_lookup += 0 if cfg.arch.tied_head else cfg.vocab_size * d
  return 6 * (n_params - n_lookup) + 12 * cfg.n_layer * d * (width or t)


def make_model(cfg: specs.ModelSpec, decode: bool = False) -> AOGPT:
  return AOGPT(cfg, decode=decode)


def init_params(cfg: specs.ModelSpec, key: jax.Array) -> Any:
  """Initial parameters (boxed with logical axis metadata) for a model spec."""
  model = make_model(cfg)
  t = cfg.block_size
  dummy = jnp.zeros((1, t), jnp.int32)
  return model.init(key, dummy, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (1, t)))["params"]
