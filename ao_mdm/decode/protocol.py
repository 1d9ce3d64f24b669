"""The decode state and the protocol every decoding policy implements (docs/sampling.md, "The
engine"): a policy inserts rows (their known tokens prefilled into the cache) and steps every
active row by one forward. Two drivers run any policy: `decoder` (one jitted loop over a static
batch) and batching.Batcher (rows that join and leave between steps)."""

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import specs
from ao_mdm.decode import common, engine


class DecodeState(NamedTuple):
  """Between steps: what every policy keeps per row, the K/V cache, and the policy's own per-row
  arrays (`fields`, leading axis B)."""

  rows: engine.Rows
  cache: engine.KVCache | None
  fields: Any


class Shape(NamedTuple):
  """A step's static shape: the cache slots it reads and holds, and the policy's own width
  (e.g. the query columns of an adaptive order). Each is compiled once."""

  cache_len: int
  width: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySpec:
  """What one policy's jitted insert and step are made for (hashable: the key of its
  programs). A policy subclasses it and implements the methods that raise here."""

  model: specs.ModelSpec
  draw: common.DrawRule = common.DrawRule()
  order: str = "l2r"  # of the unknown positions after the known ones: "random" or "l2r"
  block_len: int | None = None  # unknown positions per block, left to right (None: one block)
  eos_id: int | None = None  # a row is done once an EOS is decoded (the policy says when)
  use_cache: bool = True
  # Each token drawn from its conditional given every order slot before it (exact sequential
  # draws), not given its step's start: what a scorer of the draws conditions on.
  sequential: ClassVar[bool] = False

  def plan_request(self, known: int, end: int, steps: int, schedule: str, max_steps: int) -> Any:
    """One request's plan on the host (a NamedTuple of int tuples, one row of `fields`): known
    tokens first, order slots up to `end` decoded in `steps` steps, padded to max_steps steps;
    a ValueError saying what it needs when this spec cannot decode it."""
    raise NotImplementedError

  def extent(self, plan: Any) -> tuple[int, int, int]:
    """(known, end, steps) of a plan."""
    raise NotImplementedError

  def fields(self, batch: int, steps: int) -> Any:
    """The policy's fields of `batch` free rows (plans of up to `steps` steps)."""
    raise NotImplementedError

  def start(self, plan_R: Any, order_RT: jax.Array, known_R: jax.Array, keys_R: jax.Array) -> Any:
    """The fields of rows starting the requests of plans plan_R (arrays, leading axis R), with
    their draw keys."""
    return plan_R

  def step(self, dm: engine.DecodeModel, params: Any, s: "DecodeState", shape: "Shape") -> Any:
    """One forward for every active row, what each commits (engine.commit: tokens with the
    log-probs they were drawn with) and which rows are done (rows.active_B false): a
    DecodeState."""
    raise NotImplementedError

  def shape(self, rows: engine.Rows, fields: Any) -> "Shape":
    """The static shape of the next step of the active rows (read on the host)."""
    raise NotImplementedError

  def shapes(self) -> list:
    """Every Shape `shape` can return: what a server compiles before it says it is ready."""
    raise NotImplementedError

  def segments(self, plan: Any) -> tuple:
    """((first step, end step, Shape), ...): the static loop of a batch sharing `plan`."""
    raise NotImplementedError

  def orders(self, key: jax.Array, known_BT: jax.Array, end: int) -> tuple:
    """(orders, per-row draw keys) of a batch drawn with `key`: the orders from one split of it,
    row r's draws from fold_in(the other, r)."""
    k_order, k_steps = jax.random.split(key)
    order_BT = common.make_orders(k_order, known_BT, self.order, self.block_len, end)
    return order_BT, engine.row_keys(k_steps, known_BT.shape[0])


def empty(spec: PolicySpec, batch: int, steps: int, cache_len: int | None = None) -> DecodeState:
  """A state of `batch` free rows, whose plans may have up to `steps` steps, and a cache of
  cache_len slots (default T)."""
  b, t = batch, spec.model.block_size
  zeros_BT, zeros_B = jnp.zeros((b, t), jnp.int32), jnp.zeros((b,), jnp.int32)
  rows = engine.new_rows(
    zeros_BT,
    zeros_BT,
    zeros_B,
    engine.row_keys(jax.random.key(0), b),
    jnp.zeros((b,), jnp.float32),
    jnp.zeros((b,), jnp.float32),
    zeros_B,
  )._replace(active_B=jnp.zeros((b,), bool))
  cache = engine.KVCache.empty(spec.model, b, cache_len) if spec.use_cache else None
  return DecodeState(rows, cache, spec.fields(b, steps))


def insert(
  spec: PolicySpec,
  dm: engine.DecodeModel,
  params: Any,
  s: DecodeState,
  rows_R: jax.Array,
  tokens_RT: jax.Array,
  order_RT: jax.Array,
  known_R: jax.Array,
  keys_R: jax.Array,
  draw_R: tuple,
  fields_R: Any,
  width: int,
  prefix: tuple | None = None,
  cache_len: int = 0,
) -> DecodeState:
  """The state with rows rows_R starting new requests: their tokens (the known ones at the
  first known_R slots of their orders), draw keys and settings (temperature, top_p, top_k per
  row) and the policy's fields; each row's known slots are prefilled by one forward of `width`
  >= its known count slots. prefix (start_R, stored): each row's slots before start_R are copied
  from `stored`, a KVCache of R rows (KVCache.with_prefix), and the forward starts there
  (reading cache_len)."""
  new = engine.new_rows(tokens_RT, order_RT, known_R, keys_R, *draw_R)
  put = lambda old, x: old.at[rows_R].set(x)
  rows = jax.tree.map(put, s.rows, new)
  cache = s.cache
  if cache is not None and prefix is not None:
    start_R, stored = prefix
    cache = cache.with_prefix(rows_R, start_R, stored)
    cache = dm.prefill(
      params, cache, tokens_RT, order_RT, known_R, width, rows_R, start_R, cache_len
    )
  elif cache is not None:
    cache = dm.prefill(params, cache, tokens_RT, order_RT, known_R, width, rows_R)
  else:
    rows = rows._replace(cached_B=rows.cached_B.at[rows_R].set(0))
  fields = jax.tree.map(put, s.fields, spec.start(fields_R, order_RT, known_R, keys_R))
  return DecodeState(rows, cache, fields)


@functools.lru_cache(maxsize=32)
def decoder(spec: PolicySpec, plan: Any):
  """The jitted loop of a static batch whose rows share one request plan (a hashable tuple of
  the policy's fields, PolicySpec.plan as tuples): run(params, tokens, known, key, temperature,
  top_p, top_k) -> the DecodeState after every step; compiled once per batch shape."""
  dm = engine.DecodeModel.of(spec.model)
  segments = spec.segments(plan)
  fields = jax.tree.map(lambda x: jnp.asarray(x, jnp.int32), plan, is_leaf=is_row)
  known, end, steps = spec.extent(plan)

  def run(params, tokens_BT, known_BT, key, temperature, top_p, top_k):
    b = tokens_BT.shape[0]
    order_BT, keys_B = spec.orders(key, known_BT, end)
    full = lambda x: jnp.full((b,), x)
    s = empty(spec, b, steps, segments[0][2].cache_len)
    s = insert(
      spec,
      dm,
      params,
      s,
      jnp.arange(b),
      jnp.where(known_BT, tokens_BT, 0),
      order_BT,
      full(jnp.int32(known)),
      keys_B,
      (full(temperature), full(top_p), full(top_k)),
      jax.tree.map(lambda x: jnp.broadcast_to(x, (b, *x.shape)), fields),
      known,
    )
    if spec.use_cache:
      params = dm.loop_params(params)
    for first, last, shape in segments:
      if s.cache is not None:
        s = s._replace(cache=s.cache.grown(shape.cache_len))
      # Up to the segment's last step, and not once every row is done (a row's plan may end
      # early: at an EOS, or a policy whose steps vary, such as speculative's).
      _, s = jax.lax.while_loop(
        lambda c, last=last: (c[0] < last) & jnp.any(c[1].rows.active_B),
        lambda c, shape=shape: (c[0] + 1, spec.step(dm, params, c[1], shape)),
        (jnp.int32(first), s),
      )
    return s

  return jax.jit(run)


def run(spec: PolicySpec, plan: Any, params: Any, tokens_BT, known_BT, seed: int, *draw) -> Any:
  """The static loop of a batch sharing `plan` (known tokens tokens_BT where known_BT; the
  draw: temperature, top_p, top_k) run once: its last DecodeState, on the host."""
  temperature, top_p, top_k = draw
  out = decoder(spec, plan)(
    params,
    jnp.asarray(tokens_BT),
    jnp.asarray(known_BT),
    jax.random.key(seed),
    jnp.float32(temperature),
    jnp.float32(top_p),
    jnp.int32(top_k),
  )
  return jax.device_get(out)


def output(rows: engine.Rows, **extra: Any) -> common.SampleOutput:
  """A static batch's SampleOutput: its rows' tokens, orders and draws (extra: logits, stats)."""
  tokens, order = np.asarray(rows.tokens_BT), np.asarray(rows.order_BT)
  return common.SampleOutput(tokens, order, **extra, **common.drawn_arrays(rows.drawn))


def is_row(x: Any) -> bool:
  """A plan's leaf: a tuple of ints (one row's values of a field)."""
  return isinstance(x, tuple) and all(isinstance(v, int) for v in x)
