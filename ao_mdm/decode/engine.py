"""The model's decode interface (docs/sampling.md, "The engine"): one K/V cache layout, one chunk
of slots per row run against it, and one mask rule. Every decoder builds its forwards from these
and nothing else of the model.

A chunk is W columns per row. Column w feeds a token and its position (the slot input), targets
a position, and sees the first `sees[w]` columns of the chunk and itself, plus the first
`cached` slots of the cache: a real slot sees the real slots before it (sees = w), a phantom (a
copy of a real slot's input with another target) the real slots before the one it copies.
"""

import math
from typing import Any, NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import common, noise


class KVCache(NamedTuple):
  """Per layer, heads-major K/V of the first P <= T slots: k[l] [B, H, K, P] (keys transposed),
  v[l] [B, H, P, K], so that attention multiplies each with a plain batched matmul
  (model.attention). One array per layer, of the length a decode loop reads: XLA:CPU copies a
  slice of a larger buffer before every matmul, which cost more than the matmul itself."""

  k: tuple
  v: tuple

  @staticmethod
  def empty(cfg: specs.ModelSpec, batch: int, length: int | None = None) -> "KVCache":
    dtype = model_lib.DTYPES[cfg.dtype]
    bh, k_dim, p = (batch, cfg.n_head), cfg.n_embd // cfg.n_head, length or cfg.block_size
    layers = range(cfg.n_layer)
    return KVCache(
      tuple(jnp.zeros(bh + (k_dim, p), dtype) for _ in layers),
      tuple(jnp.zeros(bh + (p, k_dim), dtype) for _ in layers),
    )

  @property
  def length(self) -> int:
    return self.v[0].shape[2]

  @staticmethod
  def of_layers(layers: list) -> "KVCache":
    """The cache of per-layer (k, v) pairs."""
    return KVCache(*(tuple(z) for z in zip(*layers)))

  def resized(self, length: int) -> "KVCache":
    """The cache holding `length` slots: its first ones, then zeros."""
    if length == self.length:
      return self
    return KVCache(
      tuple(resized(k, length, 3) for k in self.k), tuple(resized(v, length, 2) for v in self.v)
    )

  def take(self, rows_R: jax.Array) -> "KVCache":
    """The cache of rows rows_R only."""
    return jax.tree.map(lambda x: jnp.take(x, rows_R, axis=0), self)

  def write(self, kv: dict, slots_BW: jax.Array, rows_B: jax.Array | None = None) -> "KVCache":
    """The cache with a chunk's K/V ([L, B, W', H, K], W' >= W) written at cache slots
    slots_BW of rows rows_B (default: every row, in order); slots >= P are dropped."""
    return KVCache.of_layers(
      [
        model_lib.cache_write(k, v, kv["k"][i], kv["v"][i], slots_BW, rows_B)
        for i, (k, v) in enumerate(zip(self.k, self.v))
      ]
    )

  def with_prefix(self, rows_R: jax.Array, start_R: jax.Array, prefix: "KVCache") -> "KVCache":
    """The cache with rows rows_R's slots before start_R taken from `prefix`, a cache of R rows
    and the same length (a reused prompt prefix)."""
    before_RP = jnp.arange(self.length) < start_R[:, None]
    k = lambda old, new: old.at[rows_R].set(jnp.where(before_RP[:, None, None], new, old[rows_R]))
    v = lambda old, new: old.at[rows_R].set(
      jnp.where(before_RP[:, None, :, None], new, old[rows_R])
    )
    return KVCache(tuple(map(k, self.k, prefix.k)), tuple(map(v, self.v, prefix.v)))


def resized(x: jax.Array, length: int, axis: int) -> jax.Array:
  """x with `length` entries along `axis`: its first ones, then zeros."""
  pad = [(0, max(length - x.shape[axis], 0) if a == axis else 0) for a in range(x.ndim)]
  return jax.lax.slice_in_dim(jnp.pad(x, pad), 0, length, axis=axis)


class Chunk(NamedTuple):
  """One forward's W columns per row (module docstring)."""

  tok_BW: jax.Array  # token fed (the slot input)
  pos_BW: jax.Array  # its position (-1: the [None] token of slot 0)
  target_BW: jax.Array  # the position the column predicts
  sees_BW: jax.Array  # columns before this many are visible, besides itself
  cached_B: jax.Array  # cache slots visible


def masks(chunk: Chunk, cache_len: int) -> dict:
  """Attention masks of a chunk: "new" [B, 1, W, W] over the chunk, "cache" [B, 1, W, P] over
  the first P = cache_len cache slots (the prefix attention reads)."""
  w = chunk.tok_BW.shape[1]
  j = jnp.arange(w)
  new = (j[None, None, :] < chunk.sees_BW[:, :, None]) | (j[None, :, None] == j[None, None, :])
  cache = jnp.arange(cache_len)[None, None, :] < chunk.cached_B[:, None, None]
  b = cache.shape[0]
  return {"new": new[:, None], "cache": jnp.broadcast_to(cache, (b, w, cache_len))[:, None]}


def slot_inputs(tokens_BT: jax.Array, order_BT: jax.Array, slots_BW: jax.Array) -> tuple:
  """(token, position) fed at order slots slots_BW: model.slot_inputs read at those slots."""
  prev_tok_BT, prev_pos_BT = model_lib.slot_inputs(tokens_BT, order_BT)
  slots_BW = jnp.clip(slots_BW, 0, order_BT.shape[1] - 1)
  return (
    jnp.take_along_axis(prev_tok_BT, slots_BW, axis=1),
    jnp.take_along_axis(prev_pos_BT, slots_BW, axis=1),
  )


def _layers(blocks: Any) -> tuple:
  """Stacked layer params [L, ...] as L trees."""
  return tuple(
    jax.tree.map(lambda a: a[i], blocks) for i in range(jax.tree.leaves(blocks)[0].shape[0])
  )


def _embed_stack(module: Any, tok, pos, target, mask) -> tuple:
  x, c = module.embed(tok, pos, target)
  h, kv = module.stack(x, c, mask)
  return h, c, kv


def output_major(params: Any) -> Any:
  """Split layers' params with each Dense kernel [inputs..., outputs...] held as `kernel_OI`, a
  matrix [outputs, inputs], which Dense then multiplies by: XLA:CPU multiplies a step's few rows
  by that layout faster (16 rows of ao_small: 66 -> 56 ms a step)."""
  if isinstance(params, tuple):
    return tuple(output_major(p) for p in params)
  if not isinstance(params, dict):
    return params
  out = {}
  for name, p in params.items():
    if isinstance(p, dict) and "kernel" in p:
      k = p["kernel"]
      inputs = math.prod(k.shape[: model_lib.INPUT_AXES.get(name, 1)])
      out[name] = {n: v for n, v in p.items() if n != "kernel"}
      out[name]["kernel_OI"] = k.reshape(inputs, -1).T
    else:
      out[name] = output_major(p)
  return out


class DecodeModel(NamedTuple):
  """A model's decode forwards: `forward` runs a chunk against the cache, `logits` reads the
  head at chosen columns, `prefill` fills cache rows with their known slots."""

  cfg: specs.ModelSpec
  module: Any

  @staticmethod
  def of(cfg: specs.ModelSpec) -> "DecodeModel":
    return DecodeModel(cfg, model_lib.make_model(cfg, decode=True))

  def forward(
    self,
    params: Any,
    cache: KVCache | None,
    chunk: Chunk,
    cache_len: int | None,
    write_BW: jax.Array | None = None,
    cols_BQ: jax.Array | None = None,
  ) -> tuple:
    """(hidden [B, W, D], conditioning, chunk K/V [L, B, W, H, K], cache); cache None: no cache
    read (cache_len None), the chunk alone. write_BW: the first columns' K/V are written at
    these cache slots (>= P: dropped) before the cache is read, so they must be slots the
    chunk's mask hides; the cache returned holds them (without write_BW it is `cache`).
    cols_BQ: the hidden states and conditioning of those columns only ([B, Q, D]: what `logits`
    reads); the last layer then runs only them (every column's K/V is still made)."""
    m = masks(chunk, cache_len or 0)
    if cache is None:
      m = {"new": m["new"]}
    elif cache_len is None or cache_len > cache.length:
      raise ValueError(f"cache_len={cache_len} must be in [0, {cache.length}] (the cache held)")
    return self._run(
      params, chunk.tok_BW, chunk.pos_BW, chunk.target_BW, cache, m, write_BW, cols_BQ
    )

  def loop_params(self, params: Any) -> Any:
    """The params as a decode loop holds them, made once before it starts: the stacked layers
    split into one tree per layer (XLA:CPU copies the slices in every step otherwise), each
    Dense kernel [outputs, inputs] (output_major: faster for a step's few rows) and, with
    AdaLN, each layer's modulations [T, 6, D] of every target position (model.per_slot gathers
    them per column). A forward without a cache (a prefill) takes either form."""
    if isinstance(params["blocks"], tuple):
      return params
    layers = _layers(params["blocks"])
    if not self.cfg.arch.adaln:
      return output_major({**params, "blocks": layers})
    one = jnp.zeros((1, 1), jnp.int32)
    _, (c_TC, _) = self.module.apply({"params": params}, one, one, one, method="embed")
    adaln = model_lib.adaln_dense(self.cfg)
    tables = tuple(adaln.apply({"params": p["adaln"]}, c_TC) for p in layers)
    return output_major({**params, "blocks": layers, "adaln_TJD": tables})

  def _run(self, params: Any, tok, pos, target, cache, mask, write_BW=None, cols_BQ=None) -> tuple:
    """Embedding and the layers. With the params stacked (and no cache), the training stack's
    scan (one layer body to compile); with loop_params', the layers one after another, each
    reading its own cache arrays (a scan would copy its slice of a stacked cache every step)
    and its AdaLN table (a prefill then gathers its modulations rather than computing them:
    16 prompts of 32 tokens of ao_small, 460 -> 370 ms)."""
    pick = lambda a: a if cols_BQ is None else model_lib.columns(a, cols_BQ)
    if cache is None and not isinstance(params["blocks"], tuple):
      h, c, kv = self.module.apply({"params": params}, tok, pos, target, mask, method=_embed_stack)
      return pick(h), c and (c[0], pick(c[1])), kv, None
    x, c = self.module.apply({"params": params}, tok, pos, target, method="embed")
    # Barriers where the scan's carry would be: XLA then rounds the bfloat16 activations there
    # as it does in the scan, and tokens stay bitwise those of the layer-scan decoder.
    x, c = jax.lax.optimization_barrier((x, c))
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    block = model_lib.Block(self.cfg, return_kv=True)
    kvs, written = [], []
    blocks = params["blocks"]  # split per call when not by loop_params
    blocks = blocks if isinstance(blocks, tuple) else _layers(blocks)
    for i, p in enumerate(blocks):
      layer = {} if cache is None else {"k": cache.k[i], "v": cache.v[i]}
      if params.get("adaln_TJD"):
        layer["adaln_TJD"] = params["adaln_TJD"][i]
      if write_BW is not None:
        layer["slots_BW"] = write_BW
      if cols_BQ is not None and i == len(blocks) - 1:
        layer["cols_BQ"] = cols_BQ
      x, kv = block.apply({"params": p}, x, c, layer, mask)
      x = jax.lax.optimization_barrier(x)
      written.append(kv.get("cache"))
      kvs.append({"k": kv["k"], "v": kv["v"]})
    if write_BW is not None:
      cache = KVCache.of_layers(written)
    return (
      x,
      c and (c[0], pick(c[1])),
      jax.tree.map(lambda *a: jnp.stack(a), *kvs),
      cache,
    )

  def logits(self, params: Any, hidden_BQD: jax.Array, cond: Any) -> jax.Array:
    """float32 logits [B, Q, V] of the columns `forward` returned."""
    out = self.module.apply({"params": params}, hidden_BQD, cond, method="logits")
    return cast(jax.Array, out)

  def prefill(
    self,
    params: Any,
    tokens_BT: jax.Array,
    order_BT: jax.Array,
    width: int,
    start_B: jax.Array | None = None,
    stored: KVCache | None = None,
  ) -> dict:
    """K/V {"k", "v"} [L, B, W, H, K] of order slots start_B .. start_B + width - 1 (default
    0 ..), whose inputs are known tokens: one causal forward of `width` slots (the caller keeps
    the known ones). With start_B the forward reads `stored`, a cache of the B rows holding
    their slots before start_B (a reused prefix)."""
    b, t = order_BT.shape
    if start_B is None:
      slots_BW = jnp.broadcast_to(jnp.arange(width), (b, width))
      tok, pos = slot_inputs(tokens_BT, order_BT, slots_BW)
      return self._run(params, tok, pos, order_BT[:, :width], None, None)[2]
    assert stored is not None
    slots_BW = start_B[:, None] + jnp.arange(width)
    tok, pos = slot_inputs(tokens_BT, order_BT, slots_BW)
    target = jnp.take_along_axis(order_BT, jnp.minimum(slots_BW, t - 1), 1)
    causal = jnp.broadcast_to(jnp.arange(width), (b, width))
    chunk = Chunk(tok, pos, target, causal, start_B)
    return self.forward(params, stored, chunk, stored.length)[2]


class Drawn(NamedTuple):
  """Per position: the log-prob its token was drawn with (after temperature, top-p, top-k; 0
  when greedy), the model's own log-prob of it, and the step that drew it (-1: known)."""

  logprob_BT: jax.Array
  raw_logprob_BT: jax.Array
  step_BT: jax.Array

  @staticmethod
  def empty(batch: int, t: int) -> "Drawn":
    zeros_BT = jnp.zeros((batch, t), jnp.float32)
    return Drawn(zeros_BT, zeros_BT, jnp.full((batch, t), -1, jnp.int32))

  def put(self, pos_BQ: jax.Array, lp_BQ: jax.Array, raw_BQ: jax.Array, step_B) -> "Drawn":
    """Written at positions pos_BQ (T: nothing), each drawn at its row's step step_B."""
    r = jnp.arange(pos_BQ.shape[0])[:, None]
    put = lambda x, v: x.at[r, pos_BQ].set(v, mode="drop")
    step_BQ = jnp.broadcast_to(jnp.asarray(step_B).reshape(-1, 1), pos_BQ.shape)
    return Drawn(
      put(self.logprob_BT, lp_BQ), put(self.raw_logprob_BT, raw_BQ), put(self.step_BT, step_BQ)
    )


class Rows(NamedTuple):
  """What every policy keeps per row: the sequence, its order, how far it is decoded, its own
  key and draw settings, and per position the log-probabilities its token was drawn with."""

  tokens_BT: jax.Array
  order_BT: jax.Array  # order slot -> position (known positions first)
  filled_B: jax.Array  # order slots whose tokens are known (n)
  cached_B: jax.Array  # slots whose K/V are in the cache
  active_B: jax.Array  # holds a request that is not done
  key_B: jax.Array  # the row's own key: its draws do not depend on the other rows
  temperature_B: jax.Array
  top_p_B: jax.Array
  top_k_B: jax.Array
  drawn: Drawn
  forwards_B: jax.Array  # steps the row took part in


def new_rows(
  tokens_BT: jax.Array,
  order_BT: jax.Array,
  known_B: jax.Array,
  key_B: jax.Array,
  temperature_B: jax.Array,
  top_p_B: jax.Array,
  top_k_B: jax.Array,
) -> Rows:
  """Rows that start decoding with known_B tokens (the first known_B order slots) in place."""
  b, t = tokens_BT.shape
  return Rows(
    tokens_BT,
    order_BT,
    known_B,
    known_B,
    jnp.ones((b,), bool),
    key_B,
    temperature_B,
    top_p_B,
    top_k_B,
    Drawn.empty(b, t),
    jnp.zeros((b,), jnp.int32),
  )


def row_keys(key: jax.Array, batch: int) -> jax.Array:
  """The keys of a batch's rows: row r of a batch drawn with `key` decodes as a request of its
  own with key fold_in(key, r)."""
  return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(batch))


def draw(
  rows: Rows, rule: Any, logits_BQV: jax.Array, step_B: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(tokens, log-probs as drawn, raw log-probs) [B, Q] of one draw per query: each row with
  its own settings and key (folded with the row's step)."""
  d = common.Draw(
    rows.temperature_B[:, None, None],
    rows.top_p_B[:, None, None],
    rows.top_k_B[:, None, None],
    rule,
  )
  gumbel = jax.vmap(lambda k, i: noise.gumbel(jax.random.fold_in(k, i), logits_BQV.shape[1:]))
  picked, scaled = d.perturbed(logits_BQV, gumbel(rows.key_B, step_B))
  return (picked, *logprobs(scaled, logits_BQV, picked, d.temperature[..., 0]))


def logprobs(scaled: jax.Array, logits: jax.Array, picked: jax.Array, temperature: Any) -> tuple:
  """(log-prob of `picked` under softmax(scaled), the distribution it was drawn from, 0 when
  greedy; its log-prob under the model's own softmax(logits)): [...] from [..., V]."""
  at = lambda x: jnp.take_along_axis(x, picked[..., None], axis=-1)[..., 0]

  def log_softmax_at(x):  # jax.nn.log_softmax(x) at `picked`, op for op, without all V of it
    top = jax.lax.stop_gradient(x.max(-1, keepdims=True))
    return (at(x) - top[..., 0]) - jnp.log(jnp.exp(x - top).sum(-1))

  lp = jnp.where(temperature > 0, log_softmax_at(scaled), 0.0)
  return lp, log_softmax_at(logits.astype(jnp.float32))


def commit(
  rows: Rows, pos_BQ: jax.Array, tok_BQ: jax.Array, lp_BQ: jax.Array, raw_BQ: jax.Array, step_B
) -> Rows:
  """Rows with tokens written at positions pos_BQ (T: nothing), with their log-probs and step."""
  tokens_BT = rows.tokens_BT.at[jnp.arange(pos_BQ.shape[0])[:, None], pos_BQ].set(
    tok_BQ, mode="drop"
  )
  return rows._replace(tokens_BT=tokens_BT, drawn=rows.drawn.put(pos_BQ, lp_BQ, raw_BQ, step_B))
