"""The decode state and the protocol every decoding policy implements (docs/sampling.md, "The
engine"): a policy inserts rows (their known tokens prefilled into the cache) and steps every
active row by one forward. Two drivers run any policy: `decoder` (one jitted loop over a static
batch) and batching.Batcher (rows that join and leave between steps)."""

from collections.abc import Callable
import dataclasses
import functools
import itertools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import specs
from ao_mdm.decode import common, engine
from ao_mdm.decode import options as options_lib


class DecodeState(NamedTuple):
  """Between steps: what every policy keeps per row, the K/V cache, and the policy's own per-row
  arrays (`fields`, leading axis B)."""

  rows: engine.Rows
  cache: engine.KVCache | None
  fields: Any


class Shape(NamedTuple):
  """A step's static shape: the cache slots it reads and writes (the cache it holds), and the
  policy's own width (e.g. the query columns of an adaptive order). Each is compiled once."""

  cache_len: int
  width: int = 0


class Continuing(NamedTuple):
  """What a policy's continuous batch is built for (policies.Policy.batch_spec): up to
  tokens_per_step tokens a forward, a row done at its EOS where the policy can tell, ids >=
  vocab_limit never drawn, and (policies of fixed orders) the order of the unknown positions and
  their blocks (None: one)."""

  tokens_per_step: int
  eos_id: int | None = None
  vocab_limit: int | None = None
  order: str = "l2r"
  block_len: int | None = None


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
  # The buckets each Shape field is compiled for (0: the field is always 0).
  buckets: ClassVar[Shape] = Shape(common.CACHE_BUCKETS)

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

  def needs(self, rows: engine.Rows, fields: Any) -> tuple:
    """Per row ([B] host or traced arrays), one per Shape field: what its next step needs (the
    cache slots it reads and writes, the policy's width), each at most T."""
    raise NotImplementedError

  def shape(self, active_B: np.ndarray, needs: tuple) -> Shape:
    """The static shape of the next step of the active rows, from their `needs` (host arrays):
    each field's bucket."""
    t = self.model.block_size
    return Shape(
      *(
        common.bucket_for(int(need[active_B].max(initial=1)), t, n) if n else 0
        for need, n in zip(needs, self.buckets)
      )
    )

  def fits(self, rows: engine.Rows, fields: Any, shape: Shape) -> jax.Array:
    """Whether the next step of every active row fits `shape` (traced)."""
    needs = [x for x, n in zip(self.needs(rows, fields), self.buckets) if n]
    bounds = [b for b, n in zip(shape, self.buckets) if n]
    return jnp.all(
      jnp.stack([jnp.where(rows.active_B, x <= b, True) for x, b in zip(needs, bounds)])
    )

  def shapes(self) -> list:
    """Every Shape `shape` can return: what a server compiles before it says it is ready."""
    t = self.model.block_size
    bounds = [common.bucket_bounds(t, n) if n else [0] for n in self.buckets]
    return [Shape(*x) for x in itertools.product(*bounds)]

  def segments(self, plan: Any) -> tuple:
    """((first step, end step, Shape), ...): the static loop of a batch sharing `plan`."""
    raise NotImplementedError

  def orders(self, key: jax.Array, known_BT: jax.Array, end: int) -> tuple:
    """(orders, per-row draw keys) of a batch drawn with `key`: the orders from one split of it,
    row r's draws from fold_in(the other, r)."""
    k_order, k_steps = jax.random.split(key)
    order_BT = common.make_orders(k_order, known_BT, self.order, self.block_len, end)
    return order_BT, engine.row_keys(k_steps, known_BT.shape[0])

  def output(self, s: "DecodeState", plan: Any, **extra: Any) -> common.SampleOutput:
    """A static batch's SampleOutput from its last rows and fields (on the host): the tokens,
    orders and draws; a policy adds its own (extra: logits, stats)."""
    rows = s.rows
    tokens, order = np.asarray(rows.tokens_BT), np.asarray(rows.order_BT)
    return common.SampleOutput(tokens, order, **extra, **common.drawn_arrays(rows.drawn))


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


class Prefix(NamedTuple):
  """New rows' slots already computed: each row's slots before start_R are copied from
  `stored`, a KVCache of the R rows (a prompt prefix another request computed)."""

  start_R: jax.Array
  stored: engine.KVCache


def prefill(
  spec: PolicySpec,
  dm: engine.DecodeModel,
  params: Any,
  tokens_RT: jax.Array,
  order_RT: jax.Array,
  width: int,
  prefix: Prefix | None = None,
) -> dict | None:
  """The K/V of new rows' first `width` order slots (from prefix.start_R on, reading its
  cache), which must hold every known one: insert keeps those. None without a cache or width."""
  if not spec.use_cache or not width:
    return None
  if prefix is None:
    return dm.prefill(params, tokens_RT, order_RT, width)
  return dm.prefill(params, tokens_RT, order_RT, width, prefix.start_R, prefix.stored)


def insert(
  spec: PolicySpec,
  s: DecodeState,
  rows_R: jax.Array,
  tokens_RT: jax.Array,
  order_RT: jax.Array,
  known_R: jax.Array,
  keys_R: jax.Array,
  draw_R: tuple,
  fields_R: Any,
  kv: dict | None,
  prefix: Prefix | None = None,
  source_R: jax.Array | None = None,
) -> DecodeState:
  """The state with rows rows_R starting new requests: their tokens (the known ones at the
  first known_R slots of their orders), draw keys and settings (temperature, top_p, top_k per
  row), the policy's fields, and in the cache their known slots: those before prefix.start_R
  copied from prefix.stored, the rest from kv (`prefill`'s; its row source_R[i] for new row i
  where given: rows with the same prompt share one prefill, read in place, not copied first)."""
  new = engine.new_rows(tokens_RT, order_RT, known_R, keys_R, *draw_R)
  put = lambda old, x: old.at[rows_R].set(x)
  rows = jax.tree.map(put, s.rows, new)
  cache = s.cache
  if cache is None:
    rows = rows._replace(cached_B=rows.cached_B.at[rows_R].set(0))
  else:
    start_R = jnp.zeros_like(known_R)
    if prefix is not None:
      start_R = prefix.start_R
      cache = cache.with_prefix(rows_R, start_R, prefix.stored.resized(cache.length))
    if kv is not None:
      if source_R is not None:
        kv = jax.tree.map(lambda x: jnp.take(x, source_R, 1), kv)
      slots_RW = start_R[:, None] + jnp.arange(kv["k"].shape[2])
      t = spec.model.block_size
      cache = cache.write(kv, jnp.where(slots_RW < known_R[:, None], slots_RW, t), rows_R)
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
    tokens_BT = jnp.where(known_BT, tokens_BT, 0)
    if spec.use_cache:
      params = dm.loop_params(params)
    s = insert(
      spec,
      s,
      jnp.arange(b),
      tokens_BT,
      order_BT,
      full(jnp.int32(known)),
      keys_B,
      (full(temperature), full(top_p), full(top_k)),
      jax.tree.map(lambda x: jnp.broadcast_to(x, (b, *x.shape)), fields),
      prefill(spec, dm, params, tokens_BT, order_BT, known),
    )
    for first, last, shape in segments:
      if s.cache is not None:
        s = s._replace(cache=s.cache.resized(shape.cache_len))
      s = advance(spec, dm, params, s, shape, last - first, stop_after=0, bounded=False)
    return s

  return jax.jit(run)


def advance(
  spec: PolicySpec,
  dm: engine.DecodeModel,
  params: Any,
  s: DecodeState,
  shape: Shape,
  limit: Any,
  stop_after: Any,
  bounded: bool = True,
) -> DecodeState:
  """Up to `limit` steps at `shape`, ending once every row is done, once `stop_after` (> 0) of
  the rows that were active have finished, or (bounded) before a step that would not fit `shape`."""
  started_B = s.rows.active_B

  def more(c) -> jax.Array:
    i, s = c
    go = (i < limit) & jnp.any(s.rows.active_B)
    finished = jnp.sum(started_B & ~s.rows.active_B)
    go &= ~((stop_after > 0) & (finished >= stop_after))
    return go & spec.fits(s.rows, s.fields, shape) if bounded else go

  one = lambda c: (c[0] + 1, spec.step(dm, params, c[1], shape))
  return jax.lax.while_loop(more, one, (jnp.int32(0), s))[1]


class Batch(NamedTuple):
  """A static batch as a policy's builder sees it: the params and model (in the decoding
  dtype), the positions known in every row, the order slot decoding stops at, the draw's rule."""

  params: Any
  cfg: specs.ModelSpec
  known_T: np.ndarray
  end: int
  draw: common.DrawRule

  @staticmethod
  def unconditional(params: Any, cfg: specs.ModelSpec, end: int | None = None) -> "Batch":
    """No known token, positions drawn up to `end` (default T) by the default rule: what the
    benchmarks and the cost model decode."""
    t = cfg.block_size
    return Batch(params, cfg, np.zeros(t, bool), t if end is None else end, common.DrawRule())


class Static(NamedTuple):
  """A static batch's program, as a policy builds it: its spec, the plan its rows share, and
  the params the loop reads."""

  spec: PolicySpec
  plan: Any
  params: Any


def sample(
  build: Callable[..., Static],
  params: Any,
  cfg: specs.ModelSpec,
  *,
  batch_size: int,
  seed: int = 0,
  known_positions: Any = (),
  known_tokens: Any = (),
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  top_p_rule: str = "authors",
  vocab_limit: int | None = None,
  dtype: str = "float32",
  end: int | None = None,
  **options: Any,
) -> common.SampleOutput:
  """[batch_size, T] samples of model `cfg` by one policy, whose `build(Batch, **options)`
  checks its options and returns its Static (the policy's `sample`).

  Known tokens (positions and ids shared by the batch) come first in the order and are never
  changed. temperature 0 is greedy; top_p and top_k filter by top_p_rule (common.filter_logits);
  vocab_limit: the tokenizer's vocab size when the model's is padded (larger ids are never
  drawn); end: only the positions before it are drawn, the later ones are last in the order and
  0 in the output (an infill that ends at its text); dtype: common.with_dtype's. Row r draws
  with key fold_in(key(seed), r) (engine.row_keys), as a request of its own.
  """
  options_lib.check_sampling(None, temperature, top_p, top_k, None, top_p_rule)
  params, cfg = common.with_dtype(params, cfg, dtype)
  tokens, mask = common.known_inputs(cfg, batch_size, known_positions, known_tokens, vocab_limit)
  end = common.decode_end(end, mask[0])
  st = build(Batch(params, cfg, mask[0], end, common.DrawRule(top_p_rule, vocab_limit)), **options)
  out = decoder(st.spec, st.plan)(
    st.params,
    jnp.asarray(tokens),
    jnp.asarray(mask),
    jax.random.key(seed),
    jnp.float32(temperature),
    jnp.float32(top_p),
    jnp.int32(top_k),
  )
  return st.spec.output(jax.device_get(out._replace(cache=None)), st.plan)  # not the cache


def is_row(x: Any) -> bool:
  """A plan's leaf: a tuple of ints (one row's values of a field)."""
  return isinstance(x, tuple) and all(isinstance(v, int) for v in x)
