"""The serving engine (docs/serving.md): one thread owns the model and a decode.batching.Batcher
per decoding policy served; jobs (one completion choice each) wait in a bounded queue, join free
rows of their policy's batch between steps and leave when done, and each job hears of the text
that became final at every step."""

import collections
from collections.abc import Callable
import dataclasses
import threading
import time
from typing import Any

import numpy as np

from ao_mdm.decode import batching, common, prefill, schedules
from ao_mdm.runtime import memory

EVENTS = ("text", "done", "error")  # what a job's `emit` is called with


TRIM_AFTER_S = 1.0  # an engine idle this long hands its freed heap back (runtime/memory.py)


class QueueFull(Exception):
  """The engine's queue holds --max_queue jobs already."""


@dataclasses.dataclass(eq=False)
class Job:
  """One choice of a completion: prompt ids, the span to generate (`max_tokens` positions, then
  the suffix's ids), its draw; `emit(kind, payload)` is called from the engine thread."""

  prompt: tuple
  max_tokens: int
  emit: Callable[[str, dict], Any]
  suffix: tuple = ()
  stop: tuple = ()
  seed: int = 0
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  tokens_per_step: int = 1
  policy: str = "parallel"  # one of Engine.batchers
  score_prompt: bool = False  # echo: the prompt's own L2R log-probs too
  rank: bool = False  # best_of: the exact log-prob of the completion given the prompt too
  inside: tuple = ()  # an infill's known (position, id) pairs among the max_tokens after the prompt
  cancelled: bool = False
  failed: str = ""  # fail_all's message
  row: int | None = None
  scored: list | None = None  # the prompt's log-probs (score_prompt)
  counted: int = 0  # generated tokens counted in Stats.tokens
  sent: int = 0  # characters of the generated text already emitted
  ids: tuple = ()  # the generated ids already emitted (their text is within `sent`)
  enqueued: float = dataclasses.field(default_factory=time.monotonic)
  first_token_s: float | None = None


@dataclasses.dataclass
class Stats:
  """What /metrics exports besides the current load (Engine.queue, Engine.active): counts since
  the start."""

  forwards: int = 0
  tokens: int = 0
  row_steps: int = 0  # active rows, summed over the steps
  finished: int = 0
  failed: int = 0
  cancelled: int = 0  # clients gone
  # Drained by the metrics reader; bounded, for a server nobody scrapes.
  ttft_s: collections.deque = dataclasses.field(
    default_factory=lambda: collections.deque(maxlen=4096)
  )
  step_s: collections.deque = dataclasses.field(
    default_factory=lambda: collections.deque(maxlen=4096)
  )
  # (time, tokens, row_steps) after each step, for the rates of a recent window.
  marks: collections.deque = dataclasses.field(
    default_factory=lambda: collections.deque(maxlen=4096)
  )

  def recent(self, now: float, window_s: float) -> tuple[int, int, float]:
    """(tokens, row steps, seconds) of the steps in the last window_s seconds."""
    inside = [m for m in list(self.marks) if m[0] >= now - window_s]
    if len(inside) < 2:
      return 0, 0, 0.0
    (t0, tokens0, rows0), (t1, tokens1, rows1) = inside[0], inside[-1]
    return tokens1 - tokens0, rows1 - rows0, t1 - t0


class Engine:
  """Decodes jobs, `tokens_per_step` tokens per forward at most, each by its policy (default the
  parallel one in L2R order: exact sampling at one token a step) in that policy's batch of
  `max_batch` rows (the model's KV cache exact for every row, whatever the others do)."""

  def __init__(
    self,
    params: Any,
    cfg: Any,
    tokenizer: Any,
    *,
    max_batch: int,
    max_queue: int,
    max_tokens_per_step: int,
    prefix_cache: int = 0,
    policies: tuple[str, ...] = ("parallel",),
  ):
    self.cfg, self.tokenizer = cfg, tokenizer
    self.vocab_limit = min(tokenizer.vocab_size, cfg.vocab_size)
    k = max_tokens_per_step
    self.batchers = {
      name: batching.Batcher.continuing(
        params,
        cfg,
        batch=max_batch,
        policy=name,
        prefixes=prefix_cache,
        tokens_per_step=k,
        eos_id=tokenizer.eos_id,
        vocab_limit=self.vocab_limit,
      )
      for name in policies
    }
    self.params, self.max_queue, self.max_tokens_per_step = params, max_queue, k
    self.queue: collections.deque[Job] = collections.deque()
    self.active: dict[tuple[str, int], Job] = {}  # (policy, row) -> its job
    self.stats = Stats()
    self.lock = threading.Condition()
    self.stopping = False
    self.failing = ""  # fail_all's message
    self.admitting = 0  # jobs between the queue and `active` (scoring, prefill, compiles)
    self.warming = "not started"  # what start()'s compiles have done; "" once all are
    self._scorer: Any = None
    self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

  def start(self, warm_up: bool = True) -> "Engine":
    """The engine thread; with warm_up, it first compiles every program a request may need
    (`warming` says how far; jobs submitted meanwhile wait in the queue)."""
    self.warming = "compiling" if warm_up else ""
    self.thread.start()
    return self

  def stop(self) -> None:
    with self.lock:
      self.stopping = True
      self.lock.notify()
    self.thread.join()

  def submit(self, jobs: list[Job]) -> None:
    """Queues the jobs of one request together, or none of them (QueueFull; ValueError for a
    policy this engine does not run: queued, it would stop every admission)."""
    for job in jobs:
      if job.policy not in self.batchers:
        raise ValueError(f"policy={job.policy!r}; this engine runs {', '.join(self.batchers)}")
    with self.lock:
      if len(self.queue) + len(jobs) > self.max_queue:
        raise QueueFull(f"the queue holds {len(self.queue)} of {self.max_queue} jobs")
      self.queue.extend(jobs)
      self.lock.notify()

  def cancel(self, job: Job) -> None:
    """The job leaves the queue, or ends at the next step boundary, its row freed (a client
    gone)."""
    with self.lock:
      job.cancelled = True
      if job in self.queue:
        self.queue.remove(job)
      self.lock.notify()

  def fail_all(self, message: str) -> None:
    """Every queued and running job ends with an error `message` at the next step boundary."""
    with self.lock:
      for job in self.queue:
        job.emit("error", {"message": message})
      self.stats.failed += len(self.queue)
      self.queue.clear()
      self.failing = message  # the running ones: by the engine thread, which owns `active`
      self.lock.notify()

  def busy(self) -> int:
    """Jobs queued, being admitted or running."""
    with self.lock:
      return len(self.queue) + self.admitting + len(self.active)

  # The engine thread.

  def _loop(self) -> None:
    if self.warming:
      for i, (name, batcher) in enumerate(self.batchers.items()):
        note = lambda done, total, i=i, name=name: setattr(
          self, "warming", f"policy {i + 1} of {len(self.batchers)} ({name}): compiled {done} "
          f"of {total} programs"
        )  # fmt: skip
        batcher.warm_up(note)
      self.warming = ""
    trimmed = False
    while True:
      with self.lock:
        idle = False
        while not self.stopping and not self.queue and not self.active and not idle:
          idle = not self.lock.wait(None if trimmed else TRIM_AFTER_S)
        if self.stopping:
          return
      if idle:
        # Idle for TRIM_AFTER_S: the heap pages that compiles and steps freed go back, once
        # (after the warm-up: 5.2 -> 2.6 GiB for ao_small's 16 rows), not between requests,
        # outside the lock (a request that comes meanwhile is queued at once).
        memory.trim_heap()
        trimmed = True
        continue
      trimmed = False
      try:
        self._admit()
        self._drop_cancelled()
        if self.active:
          self._step()
      except Exception as e:  # a bug of ours: the running jobs fail, the engine goes on
        self._fail_active(f"{type(e).__name__}: {e}")

  def _fail_active(self, message: str, policy: str | None = None) -> None:
    """Every running job (of `policy`, or of all) fails with `message`."""
    for (name, row), job in list(self.active.items()):
      if policy not in (None, name):
        continue
      if self.batchers[name].requests[row] is not None:
        self.batchers[name].cancel(row)
      self.stats.failed += 1
      job.emit("error", {"message": message})
      del self.active[name, row]

  def _admit(self) -> None:
    """Queued jobs into the free rows of their policies' batches, in queue order (a job whose
    batch is full waits, the others pass it), each policy's prefilled by one forward."""
    while True:
      with self.lock:
        free = {name: b.free_rows() for name, b in self.batchers.items()}
        jobs = []
        for job in list(self.queue):
          if free[job.policy]:
            free[job.policy] -= 1
            jobs.append(job)
            self.queue.remove(job)
        if not jobs:
          return
        self.admitting = len(jobs)
      try:
        joining = []
        for job in jobs:
          try:
            job.scored = self._prompt_logprobs(job) if job.score_prompt else None
          except Exception as e:  # this job fails; the others go on
            self._fail(job, e)
            continue
          if job.max_tokens == 0:
            self._finish(job, "length")
          else:
            joining.append(job)
        for name in self.batchers:
          self._insert([job for job in joining if job.policy == name])
      finally:
        with self.lock:
          self.admitting = 0

  def _insert(self, jobs: list[Job]) -> None:
    """Jobs of one policy into free rows by one prefill; when it fails, each job alone, so that
    only the jobs that fail alone fail."""
    if not jobs:
      return
    policy = jobs[0].policy
    try:
      rows = self.batchers[policy].add_many([self._request(job) for job in jobs])
    except Exception as e:
      if len(jobs) == 1:
        self._fail(jobs[0], e)
      else:
        for job in jobs:
          self._insert([job])
      return
    for job, row in zip(jobs, rows):
      job.row = row
      self.active[policy, row] = job

  def _fail(self, job: Job, e: Exception) -> None:
    self.stats.failed += 1
    job.emit("error", {"message": f"{type(e).__name__}: {e}"})

  @staticmethod
  def _known(job: Job) -> tuple[list, list]:
    """(positions, ids) the job gives: its prompt, an infill's known ids, its suffix."""
    p, m, s = len(job.prompt), job.max_tokens, len(job.suffix)
    inside = [q for q, _ in job.inside]
    positions = [*range(p), *inside, *range(p + m, p + m + s)]
    return positions, [*job.prompt, *(i for _, i in job.inside), *job.suffix]

  def _request(self, job: Job) -> batching.Request:
    p, m = len(job.prompt), job.max_tokens
    positions, ids = self._known(job)
    return batching.Request(
      tuple(positions),
      tuple(ids),
      steps=schedules.steps_within(p + m - len(job.inside), p, job.tokens_per_step),
      end=p + m + len(job.suffix),
      seed=job.seed,
      temperature=job.temperature,
      top_p=job.top_p,
      top_k=job.top_k,
    )

  def _drop_cancelled(self) -> None:
    for (name, row), job in list(self.active.items()):
      job.failed = job.failed or self.failing
      if job.cancelled or job.failed:
        self.batchers[name].cancel(row)
        del self.active[name, row]
        self.stats.cancelled += job.cancelled
      if job.failed and not job.cancelled:
        self.stats.failed += 1
        job.emit("error", {"message": job.failed})

  def _step(self) -> None:
    """One step of each policy's batch that has running jobs."""
    for name, batcher in self.batchers.items():
      jobs = {row: job for (policy, row), job in self.active.items() if policy == name}
      if jobs:
        self._step_batch(name, batcher, jobs)

  def _step_batch(self, name: str, batcher: batching.Batcher, jobs: dict[int, Job]) -> None:
    start = time.monotonic()
    try:
      batcher.step()  # its finished rows keep their tokens until refilled: read from the rows
    except Exception as e:  # the batch is lost: every job in it fails, the engine goes on
      self._fail_active(f"{type(e).__name__}: {e}", name)
      return
    self.stats.forwards += 1
    self.stats.row_steps += len(jobs)
    rows = batcher.rows
    for row, job in jobs.items():
      done = batcher.requests[row] is None
      p = len(job.prompt)
      if job.inside:  # an infill's text, its known ids among the drawn ones, once all are drawn
        if not done:
          continue
        ids = rows.tokens_BT[row][p : p + job.max_tokens]
      else:  # the text so far: the generated positions drawn without a gap (every one, in L2R)
        drawn = rows.drawn.step_BT[row][p : p + job.max_tokens] >= 0
        ids = rows.tokens_BT[row][p : p + int(np.argmin(np.append(drawn, False)))]
      try:
        reason = self._progress(job, ids, rows.drawn.raw_logprob_BT[row], done)
      except Exception as e:  # this job fails; the others go on
        if not done:
          batcher.cancel(row)
        del self.active[name, row]
        self._fail(job, e)
        continue
      if reason:
        if not done:
          batcher.cancel(row)
        del self.active[name, row]
        self._finish(job, reason)
    now = time.monotonic()
    self.stats.step_s.append(now - start)
    self.stats.marks.append((now, self.stats.tokens, self.stats.row_steps))

  def _progress(self, job: Job, row_ids: np.ndarray, raw_T: np.ndarray, done: bool) -> str | None:
    """Emits the generated text that is final (nothing a stop string could still cut, no
    unfinished character) with the ids that make it and their log-probs; returns the finish
    reason once the job is over: "stop" (EOS or a stop string) or "length"."""
    eos = self.tokenizer.eos_id
    ids: list = row_ids.tolist()
    reason = None
    if eos in ids:
      ids, reason = ids[: ids.index(eos)], "stop"
    self.stats.tokens += len(ids) - job.counted
    job.counted = len(ids)
    decode = lambda n: self.tokenizer.decode([i for i in ids[:n] if i < self.vocab_limit])
    text = decode(len(ids))
    for s in job.stop:  # the earliest stop string cuts
      if s in text:
        text, reason = text[: text.index(s)], "stop"
    if done and reason is None:
      reason = "length"
    final = len(text)
    if reason is None:  # hold back what an unfinished character or a stop string may change
      while final > 0 and text[final - 1] == "\ufffd":
        final -= 1
      final = max(final - max((len(s) - 1 for s in job.stop), default=0), job.sent)
    n = len(job.ids)  # the ids whose text is within the final text
    while n < len(ids) and len(decode(n + 1)) <= final:
      n += 1
    if final > job.sent or n > len(job.ids):
      if job.first_token_s is None:
        job.first_token_s = time.monotonic() - job.enqueued
        self.stats.ttft_s.append(job.first_token_s)
      p = len(job.prompt)
      job.emit(
        "text",
        {
          "text": text[job.sent : final],
          "ids": ids[len(job.ids) : n],
          "logprobs": raw_T[p + len(job.ids) : p + n].tolist(),
        },
      )
      job.sent, job.ids = final, tuple(ids[:n])
    return reason

  def _finish(self, job: Job, reason: str) -> None:
    done: dict[str, Any] = {"finish_reason": reason, "prompt_logprobs": job.scored}
    if job.rank:
      try:
        done["logprob"] = self._completion_logprob(job)
      except Exception as e:  # this job fails; the others go on
        self._fail(job, e)
        return
    self.stats.finished += 1
    job.emit("done", done)

  @property
  def scorer(self) -> Any:
    """The scorer of echo's prompt log-probs (eval/scoring.Scorer), made at first use."""
    from ao_mdm.eval import scoring

    if self._scorer is None:
      self._scorer = scoring.Scorer(self.params, self.cfg)
    return self._scorer

  def _prompt_logprobs(self, job: Job) -> list:
    """The prompt's L2R log-probs, each token given those before it (the first given none),
    as `ao-mdm eval` scores: one forward over a bucketed width."""
    t, p = self.cfg.block_size, len(job.prompt)
    width = prefill.width(p, t)
    tokens = np.zeros((1, t), np.int32)
    tokens[0, :p] = job.prompt
    nll = self.scorer.slot_nll(tokens, np.arange(width)[None])
    return (-nll[0, :p]).tolist()

  def _completion_logprob(self, job: Job) -> float:
    """Exact log p(the drawn ids emitted | the known ones), later positions left out
    (decode/common.drawn_logprob)."""
    p, m, t = len(job.prompt), job.max_tokens, self.cfg.block_size
    tokens = np.zeros((1, t), np.int32)
    tokens[0, : p + m + len(job.suffix)] = [
      *job.prompt,
      *job.ids,
      *[0] * (m - len(job.ids)),
      *job.suffix,
    ]
    known = np.zeros((1, t), bool)
    known[0, self._known(job)[0]] = True
    drawn = ~known & (np.arange(t) >= p) & (np.arange(t) < p + len(job.ids))
    return float(common.drawn_logprob(self.params, self.cfg, tokens, known, drawn)[0])
