"""Continuous batching (docs/sampling.md, "The engine"): requests join free rows of a running
batch between steps and leave when done, each with its own plan, key and draw settings, all
rows advancing in one jitted step. Row r of `parallel.sample(seed=s)` decodes as a request
with key fold_in(key(s), r), so a request with seed s decodes as `sample(batch_size=1, seed=s)`.
"""

import dataclasses
import functools
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import specs
from ao_mdm.decode import common, engine, policies, prefill, protocol, schedules

# warm_up runs the prefills of several rows whose slots are at most this many a row of the
# batch: a burst of short prompts then waits on no compile (whose first use cost 0.5-0.9 s of
# ao_small, more than such a prefill), while a burst of long ones, whose prefill costs more
# than its compile, is left to compile at first use.
BURST_SLOTS = 64


class _Start(NamedTuple):
  """A request as its rows are inserted: known tokens and mask [1, T], the policy's plan, the
  known count, the order slot it ends at."""

  tokens: Any
  mask: Any
  plan: Any
  known: int
  end: int


@dataclasses.dataclass(frozen=True)
class Request:
  """One sequence to decode: known tokens (positions and ids), its plan and its draw."""

  positions: tuple = ()
  token_ids: tuple = ()
  steps: int = 1
  schedule: str = "linear"
  end: int | None = None  # only the positions before it are drawn
  seed: int = 0
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0


def prompt_request(
  ids: Any,
  t: int,
  tokens_per_step: int,
  seed: int = 0,
  temperature: float = 1.0,
  block_len: int | None = None,
) -> "Request":
  """A prompt's continuation to the end of the block, up to tokens_per_step tokens per forward
  (in blocks of block_len: the Batcher's)."""
  steps = schedules.steps_within(t, len(ids), tokens_per_step, block_len=block_len)
  return Request(
    tuple(range(len(ids))), tuple(int(x) for x in ids), steps, seed=seed, temperature=temperature
  )


@dataclasses.dataclass
class Finished:
  """A request's result: tokens [T], order [T], per position the log-probs its token was drawn
  with (after filtering, and the model's own) and the step that drew it; the forwards it took."""

  request: Request
  tokens: np.ndarray
  order: np.ndarray
  logprobs: np.ndarray
  raw_logprobs: np.ndarray
  steps: np.ndarray
  forwards: int


class Batcher:
  """A batch of `batch` rows decoding by one policy (a protocol.PolicySpec); `add` starts a
  request in a free row, `step` advances every active row once and returns the requests that
  finished."""

  def __init__(
    self,
    params: Any,
    spec: protocol.PolicySpec,
    *,
    batch: int,
    max_steps: int,
    prefixes: int = 0,
    sizes: tuple[int, ...] = (),
  ):
    self.spec = spec
    dm = engine.DecodeModel.of(spec.model)
    self._loop_params = jax.jit(dm.loop_params)
    self._params: Any = None
    self.params, self.max_steps = params, max_steps
    # The state holds the smallest of `sizes` (and 2, `batch`) that holds the last busy row: a
    # step computes every row it holds. Each size is more programs, which a server compiles
    # before it is ready (GRPO's compile at first use: grpo.state_sizes). Not 1: XLA:CPU
    # multiplies a lone row by other kernels, which round otherwise (from 2 rows up, alike).
    self.sizes = tuple(sorted(set(sizes) | {min(2, batch), batch}))
    if not all(min(2, batch) <= n <= batch for n in self.sizes):
      raise ValueError(f"Batcher sizes={sizes} must be in [2, batch={batch}]")
    # The cache holds the slots of the current step's shape, resized (a copy) when that
    # changes: a step reading part of a longer cache copied that part in every layer.
    self.state = self._empty(self.sizes[0], spec.shapes()[0].cache_len)
    # The state is donated: a step or insert updates it (its K/V cache above all) in place,
    # where a copy of the cache every forward cost more than the forward (16 rows of ao_small).
    # A step returns with it its rows' needs, the next step's shape: no program to read them.
    needs = lambda rows, fields: (rows.active_B, spec.needs(rows, fields))
    advance = lambda *a: (s := protocol.advance(spec, dm, *a), needs(s.rows, s.fields))
    self._advance = jax.jit(advance, static_argnums=2, donate_argnums=1)
    self._prefill = jax.jit(
      functools.partial(protocol.prefill, spec, dm), static_argnames=("width",)
    )
    self._insert = jax.jit(functools.partial(protocol.insert, spec), donate_argnums=0)
    self._take = jax.jit(lambda x, rows_R: x[rows_R])
    self._resized = jax.jit(engine.resized, static_argnums=(1, 2))

    # A change of the state's size as one program (op by op, each array's ops compiled at
    # first use at each cache length: 2.5 s of ao_small's first burst after a lone request).
    def grown(s: protocol.DecodeState, rows: int) -> protocol.DecodeState:
      more = protocol.empty(spec, rows, max_steps, s.cache and s.cache.length)
      return jax.tree.map(lambda x, y: jnp.concatenate([x, y]), s, more)

    self._grown = jax.jit(grown, static_argnums=1)
    self._cut = jax.jit(lambda s, rows: jax.tree.map(lambda x: x[:rows], s), static_argnums=1)
    self._gathered = jax.jit(lambda s, rows_S: jax.tree.map(lambda x: x[rows_S], s))
    self._needs = jax.jit(needs)  # after an insert, cut or cancel changed the rows
    self._next: tuple = (None, None)  # the rows a step returned, and their `needs` output
    self.prefixes, self.reused_slots = prefill.PrefixStore(prefixes), 0
    # Each request's order and draw key from its seed: one call for all that join at once.
    one = lambda seed, mask_T, end: spec.orders(jax.random.key(seed), mask_T[None], end)
    self._starts = jax.jit(lambda *a: jax.tree.map(lambda x: x[:, 0], jax.vmap(one)(*a)))
    self._plan = functools.lru_cache(maxsize=4096)(spec.plan_request)  # plans repeat
    # A prompt's known arrays, shared by the requests to it (a GRPO group): not to be written to.
    self._known = functools.lru_cache(256)(functools.partial(common.known_inputs, spec.model, 1))
    self.requests: list[Request | None] = [None] * batch
    self._rows: Any = None

  @property
  def rows(self) -> Any:
    """The state's rows as of the last step, their outputs (tokens, orders, draws, forwards) on
    the host: fetched at the first read after it (a caller may need only the finished ones)."""
    if self._rows is None:
      r = self.state.rows
      out = dict(tokens_BT=r.tokens_BT, order_BT=r.order_BT, drawn=r.drawn, forwards_B=r.forwards_B)
      self._rows = r._replace(**jax.device_get(out))
    return self._rows

  @property
  def params(self) -> Any:
    return self._params

  @params.setter
  def params(self, params: Any) -> None:
    """New params (GRPO swaps them between steps): steps and prefills take them as a decode
    loop does (DecodeModel.loop_params), split once here rather than in every call. The same
    params again (GRPO's later rounds of a step) are not split again."""
    if params is not None and params is self._params:
      return
    self._params = params
    self._stepped = None if params is None else self._loop_params(params)

  @classmethod
  def continuing(
    cls,
    params: Any,
    cfg: specs.ModelSpec,
    *,
    batch: int,
    policy: str = "parallel",
    prefixes: int = 0,
    sizes: tuple[int, ...] = (),
    **options: Any,
  ) -> "Batcher":
    """A batch continuing prompts (prompt_request) by a registered policy (its `batched` spec,
    built from `options`: tokens_per_step, eos_id, vocab_limit, its own): what the server,
    completions and GRPO's rollouts run; with `prefixes` > 0, the caches of that many recent
    prompts are kept for reuse; `sizes`: the state's sizes besides 2 and `batch`."""
    spec = policies.get(policy).batch_spec(cfg, **options)
    return cls(params, spec, batch=batch, max_steps=cfg.block_size, prefixes=prefixes, sizes=sizes)

  def free_rows(self) -> int:
    return self.requests.count(None)

  def add(self, request: Request) -> int:
    """Start `request` in a free row (its index); ValueError when its plan needs wider chunks
    than the batch was built for, or more steps."""
    return self.add_many([request])[0]

  def _empty(self, rows: int, cache_len: int | None) -> protocol.DecodeState:
    """A state of free rows, a buffer of its own per leaf (empty() shares its zeros), as
    donation needs."""
    return jax.tree.map(jnp.copy, protocol.empty(self.spec, rows, self.max_steps, cache_len))

  @property
  def cache_len(self) -> int:
    """The cache slots the state holds (0 without a cache)."""
    return 0 if self.state.cache is None else self.state.cache.length

  def _hold(self, length: int) -> None:
    """The state's cache resized to `length` slots: a copy, once per change of shape, one
    layer's array at a time (each old one freed as its copy is made, not the whole cache
    held twice)."""
    if self.state.cache is None or length == self.cache_len:
      return
    k, v = list(self.state.cache.k), list(self.state.cache.v)
    self.state = self.state._replace(cache=None)
    for i in range(len(k)):
      k[i], v[i] = self._resized(k[i], length, 3), self._resized(v[i], length, 2)
    self.state = self.state._replace(cache=engine.KVCache(tuple(k), tuple(v)))

  @property
  def held(self) -> int:
    """The rows the state holds now (one of `sizes`)."""
    return self.state.rows.active_B.shape[0]

  def _resize(self, rows: int) -> None:
    """The state at `rows` rows: cut after its first rows, or padded with free rows (a copy)."""
    held, self._rows = self.held, None
    if rows < held:
      self.state = self._cut(self.state, rows)
    elif rows > held:
      self.state = self._grown(self.state, rows - held)

  def compact(self) -> dict[int, int]:
    """When the busy rows fit a smaller state size, the state cut to it, the busy rows past it
    moved into its free rows (one program per pair of sizes, as a step computes every row the
    state holds); {old row: new row}. A row decodes as it would have: from 2 rows up, its
    tokens do not depend on its place."""
    busy = [r for r, q in enumerate(self.requests) if q is not None]
    size = self._size(len(busy))
    if size >= self.held:
      return {}
    free = [r for r in range(size) if self.requests[r] is None]
    moves = dict(zip([r for r in busy if r >= size], free))
    rows_S = np.arange(size)
    rows_S[list(moves.values())] = list(moves)
    self.state, self._rows = self._gathered(self.state, rows_S), None
    for old, new in moves.items():
      self.requests[new], self.requests[old] = self.requests[old], None
    return moves

  def add_many(self, requests: list[Request]) -> list[int]:
    """Start each request in a free row, all prefilled by one forward (their rows); ValueError
    as `add`, or when fewer rows are free."""
    free = [r for r, q in enumerate(self.requests) if q is None]
    if len(requests) > len(free):
      raise ValueError(f"{len(requests)} requests for {len(free)} free rows")
    parts = []
    for request in requests:
      if not 0 <= request.seed < 2**31:
        raise ValueError(f"{request}: seed={request.seed} must be in [0, 2**31)")
      tokens, mask = self._known(request.positions, request.token_ids, None)
      end = common.decode_end(request.end, mask[0])
      known = int(mask[0].sum())
      try:
        plan = self._plan(known, end, request.steps, request.schedule, self.max_steps)
      except ValueError as e:
        raise ValueError(f"{request} needs {e}") from None
      parts.append(_Start(tokens, mask, plan, known, end))
    rows = free[: len(requests)]
    self._resize(max(self.held, self._size(max(rows) + 1)))
    reuse = [self.prefixes.longest(prefill.prompt_ids(q.positions, q.token_ids)) for q in requests]
    self.reused_slots += sum(r[0] for r in reuse)
    for group in (
      [i for i, r in enumerate(reuse) if not r[0]],
      [i for i, r in enumerate(reuse) if r[0]],
    ):
      if group:
        pick = lambda xs: [xs[i] for i in group]
        self._insert_rows(pick(rows), pick(requests), pick(parts), pick(reuse))
    for row, request in zip(rows, requests):
      self.requests[row] = request
    self._remember(rows, requests)
    return rows

  def _size(self, rows: int) -> int:
    """The smallest state size that holds `rows` rows."""
    return min(n for n in self.sizes if n >= rows)

  def _insert_rows(self, rows: list, requests: list, parts: list, reuse: list) -> None:
    """One insert (a prefill forward) of requests into rows, with their orders and draw keys
    from their seeds; reuse: per request (the slots copied from a stored prompt's cache, that
    cache), all 0 or all > 0. They are padded to a power of two with copies of the last (the
    same values written twice): an insert is compiled for a few counts of rows, not for every
    count."""
    t = self.spec.model.block_size
    pad = min(1 << (len(rows) - 1).bit_length(), self.held) - len(rows)
    rows, requests, parts, reuse = (xs + xs[-1:] * pad for xs in (rows, requests, parts, reuse))
    column = lambda values, dtype=np.int32: np.asarray(values, dtype)  # a jit call moves it
    bucket = lambda n: common.bucket_for(n, t, self.spec.buckets.cache_len)
    self._hold(max(self.cache_len, bucket(max(p.known for p in parts))))
    starts = [r[0] for r in reuse]
    prefix = None
    if max(starts):  # the stored caches cut to the slots the prefill reads
      stored = [r[1].resized(bucket(max(starts))) for r in reuse]
      stored = jax.tree.map(lambda *x: jnp.concatenate(x), *stored)
      prefix = protocol.Prefix(jnp.asarray(column(starts)), stored)
    tokens = np.concatenate([p.tokens for p in parts])
    order, keys = self._starts(
      column([q.seed for q in requests]),
      np.concatenate([p.mask for p in parts]),
      column([p.end for p in parts]),
    )
    todo = max(p.known - m for p, m in zip(parts, starts))
    # A few static prefill widths (a compile each), not one per prompt length.
    kv, source = (None, None)
    if todo:
      kv, source = self._prefilled(tokens, order, prefill.width(todo, t), parts, prefix)
    plans = jax.tree.map(lambda *x: column(x), *[p.plan for p in parts], is_leaf=protocol.is_row)
    self._rows = None
    self.state = self._insert(
      self.state,
      column(rows),
      tokens,
      order,
      column([p.known for p in parts]),
      keys,
      (
        column([q.temperature for q in requests], np.float32),
        column([q.top_p for q in requests], np.float32),
        column([q.top_k for q in requests]),
      ),
      plans,
      kv,
      prefix,
      source,
    )

  def _prefilled(self, tokens: Any, order: Any, width: int, parts: list, prefix: Any) -> tuple:
    """The new rows' prefill K/V and, where rows share one, each row's row of it (else None).
    Rows with the same known tokens (n answers to one prompt, as a GRPO group's) have the same
    known slots (known positions come first, left to right): one forward of each distinct
    prompt serves its rows."""
    if prefix is not None:
      return self._prefill(self._stepped, tokens, order, width, prefix), None
    first: dict = {}
    source = [
      first.setdefault((p.end, p.tokens.tobytes(), p.mask.tobytes()), len(first)) for p in parts
    ]
    n = max(2, 1 << (len(first) - 1).bit_length())  # 2 rows and up round alike (see sizes)
    if n >= len(parts):
      return self._prefill(self._stepped, tokens, order, width, None), None
    firsts = [source.index(i) for i in range(len(first))]
    rows = np.asarray(firsts + firsts[-1:] * (n - len(firsts)))
    kv = self._prefill(self._stepped, tokens[rows], self._take(order, rows), width, None)
    return kv, np.asarray(source, np.int32)

  def _remember(self, rows: list, requests: list) -> None:
    """The new rows' prompt caches, kept for reuse (with `prefixes` > 0)."""
    cache = self.state.cache
    if cache is None or not self.prefixes.size:  # no prompt ids to work out
      return
    for row, request in zip(rows, requests):
      self.prefixes.remember(prefill.prompt_ids(request.positions, request.token_ids), cache, row)

  def warm_up(self, progress: Any = None) -> None:
    """Compiles, at each state size, the resizes of the cache a step may make, at each cache
    length the one-row prefill of each width bucket that fits, the prefills of 2, 4, ... rows
    up to the size of BURST_SLOTS slots a row of the batch (at the shortest length that holds
    them; on free rows, their work dropped) and the steps of each shape; then the changes of
    size at each length: a server says it is ready only once a request waits on no compile
    (but a burst of long prompts, compiled at first use). progress(done, total) after each."""
    t = self.spec.model.block_size
    shapes = self.spec.shapes()
    lengths = sorted({s.cache_len for s in shapes})
    bucket = lambda n: common.bucket_for(n, t, self.spec.buckets.cache_len)
    known = [min(w, t - 1) for w in prefill.widths(t)]
    inserts = [(n, k) for n in lengths for k in known if bucket(k) <= n]
    resizes = [(a, b) for a in lengths for b in lengths if b > a or 2 * b <= a]
    # The row counts _insert_rows pads to: powers of two, the size at most.
    rows = lambda size: [min(1 << i, size) for i in range(1, (size - 1).bit_length() + 1)]
    slots = BURST_SLOTS * len(self.requests)
    bursts = {s: [(r, k) for r in rows(s) for k in known if r * k <= slots] for s in self.sizes}
    total = sum(len(inserts) + len(bursts[s]) + len(shapes) + len(resizes) for s in self.sizes)
    total += len(lengths) if len(self.sizes) > 1 else 0
    done = iter(range(1, total + 1))
    for size in self.sizes:
      self._resize(size)
      for a, b in resizes if self.state.cache is not None else ():
        self._hold(a)
        self._hold(b)
        if progress:
          progress(next(done), total)
      for length, k in inserts:
        self._hold(length)
        self.cancel(self.add(Request(tuple(range(k)), (0,) * k, t - k)))
        if progress:
          progress(next(done), total)
      for r, k in bursts[size]:  # distinct prompts: one forward of r rows
        self._hold(bucket(k))
        for row in self.add_many([Request(tuple(range(k)), (i,) * k, t - k) for i in range(r)]):
          self.cancel(row)
        if progress:
          progress(next(done), total)
      for shape in shapes:  # every row free: the step changes nothing
        self._hold(shape.cache_len)
        self.state = jax.block_until_ready(self._run_steps(shape, 1, 1)[0])
        if progress:
          progress(next(done), total)
    for length in lengths if len(self.sizes) > 1 else ():  # each change of size, each length
      self._hold(length)
      for a, b in itertools.permutations(self.sizes, 2):
        self._resize(a)
        self._resize(b)
      if progress:
        progress(next(done), total)
    self.prefixes.clear()
    self.reused_slots = 0
    self._resize(self.sizes[0])

  def cancel(self, row: int) -> None:
    """Ends row `row`'s request now (a client gone, a stop string seen): the row is free."""
    rows = self.state.rows
    if row < self.held:
      active_B = rows.active_B.at[row].set(False)
      self.state = self.state._replace(rows=rows._replace(active_B=active_B))
      self._rows = None
    self.requests[row] = None

  def _run_steps(self, shape: protocol.Shape, steps: int, stop_after: int) -> Any:
    return self._advance(self._stepped, self.state, shape, np.int32(steps), np.int32(stop_after))

  def step(self, steps: int = 1, stop_after: int = 1) -> list[Finished]:
    """Up to `steps` steps of every active row in one call (ending early once every row is
    done, a step would need another static shape, or once `stop_after` (> 0) rows finished);
    the requests that finished leave their rows."""
    stepped, after = self._next
    if stepped is not self.state.rows:
      after = self._needs(self.state.rows, self.state.fields)
    active, needs = jax.device_get(after)
    self._resize(self._size(int(np.flatnonzero(active).max(initial=0)) + 1))
    shape = self.spec.shape(active[: self.held], tuple(x[: self.held] for x in needs))
    held = self.cache_len
    if held and (shape.cache_len > held or 2 * shape.cache_len <= held):
      self._hold(shape.cache_len)  # grown, or cut to half or less: not every step as rows go
    shape = shape._replace(cache_len=self.cache_len or shape.cache_len)
    self.state, after = self._run_steps(shape, steps, stop_after)
    self._rows, self._next = None, (self.state.rows, after)
    active = np.asarray(after[0])
    ended = [(r, q) for r, q in enumerate(self.requests) if q is not None and not active[r]]
    if not ended:
      return []
    rows = self.rows
    done = []
    for r, request in ended:
      done.append(
        Finished(
          request,
          rows.tokens_BT[r],
          rows.order_BT[r],
          rows.drawn.logprob_BT[r],
          rows.drawn.raw_logprob_BT[r],
          rows.drawn.step_BT[r],
          int(rows.forwards_B[r]),
        )
      )
      self.requests[r] = None
    return done
