"""`ao-mdm prepare`: a split tokenized once into the token shards that data/prepared.py reads
(layout there), by parallel workers and disjoint shard ranges per host; safe to kill and rerun.
`ensure` is what `train` and `eval` call: the prepared split, prepared first if missing."""

from collections.abc import Callable, Iterator
import concurrent.futures
import ctypes
import hashlib
import multiprocessing
import os
import queue
import signal
import threading
import time

import numpy as np

from ao_mdm import specs
from ao_mdm.data import datasets, prepared
from ao_mdm.data import tokenizer as tokenizer_lib
from ao_mdm.data.prepared import CorruptShard, NotPrepared, PreparedSplit
from ao_mdm.data.tokenizer import Tokenizer
from ao_mdm.runtime import hosts, interrupts
from ao_mdm.storage import fs

SHARD_DOCS = 1024  # documents per shard: the unit of parallel work and of redoing after a kill
_CHUNK_DOCS = 256  # documents read and tokenized at once by a worker


class _ShardWriter:
  """Tokenizes a range of documents into one shard file: run by each worker process."""

  def __init__(self, docs: datasets.Documents, tokenizer: Tokenizer, directory: str):
    self.docs, self.tokenizer, self.directory = docs, tokenizer, directory
    self.dtype = prepared.token_dtype(tokenizer.vocab_size)

  def __call__(self, job: tuple[int, int, int]) -> tuple[int, int]:
    index, first, last = job
    path = fs.join(self.directory, prepared.shard_name(index))
    h, tokens = hashlib.sha256(), 0
    with fs.open_write(path) as f:  # appears complete or not at all
      for start in range(first, last, _CHUNK_DOCS):
        ids = self.tokenizer.encode_batch(
          self.docs.read(start, min(start + _CHUNK_DOCS, last)), num_threads=1
        )
        chunk = _with_eos(ids, self.tokenizer.eos_id, self.dtype)
        h.update(chunk.data)
        f.write(chunk.tobytes())
        tokens += len(chunk)
    fs.write_json(
      fs.join(self.directory, prepared.record_name(index)),
      {
        "file": prepared.shard_name(index),
        "documents": [first, last],
        "tokens": tokens,
        "bytes": tokens * self.dtype.itemsize,
        "sha256": h.hexdigest(),
      },
    )
    return index, tokens


def _with_eos(ids: list[list[int]], eos_id: int, dtype: np.dtype) -> np.ndarray:
  """The documents' ids, each followed by EOS, as one array."""
  ends = np.cumsum([len(x) + 1 for x in ids])
  out = np.empty(int(ends[-1]) if len(ends) else 0, dtype)
  start = 0
  for x, end in zip(ids, ends):
    out[start : end - 1] = x
    start = end
  out[ends - 1] = eos_id
  return out


_WORKER: list = []  # the _ShardWriter of a worker process, made by its initializer


def _quiet_logging() -> None:
  from absl import logging

  logging.set_verbosity(logging.FATAL)  # errors reach the parent as exceptions


class _QuietFirst:
  """Sent first among a worker's arguments: unpickling it quiets the worker's logging before the
  next argument, the source, is rebuilt (which logs TFDS's notes on a local source)."""

  def __reduce__(self):
    return _quiet_logging, ()


def _init_worker(_, *args) -> None:
  """A worker's set-up (its logging already quiet: _QuietFirst): deaf to Ctrl-C (the parent's to
  handle), gone with the parent, then its _ShardWriter."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _die_with_parent()
  _WORKER[:] = [_ShardWriter(*args)]


def _die_with_parent() -> None:
  """On Linux the kernel kills this process when its parent dies (PR_SET_PDEATHSIG): a parent
  killed mid-way leaves no worker behind printing broken-pipe tracebacks."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
  except (OSError, AttributeError):  # not Linux
    return
  if os.getppid() == 1:  # the parent died before the call
    os._exit(1)


def _write_shard(job: tuple[int, int, int]) -> tuple[int, int]:
  return _WORKER[0](job)


def _check_shard(job: tuple[str, str, int]) -> tuple[str, str, np.ndarray]:
  path, dtype, vocab = job
  sha, counts = prepared.sha256_and_counts(path, np.dtype(dtype), vocab, True)
  assert counts is not None  # asked for
  return path, sha, counts


def _write_shards(jobs: list, workers: int, desc: str, writer_args: tuple):
  """Yields (shard, tokens) for every job, unordered. This process writes shards and, with
  workers > 1, so do workers - 1 spawned processes (not forked: JAX may already run threads
  here); each takes the next job when it finishes one. A progress bar when jobs are many."""
  import tqdm

  pending, lock = iter(jobs), threading.Lock()
  done: queue.SimpleQueue = queue.SimpleQueue()

  def take():
    with lock:
      return next(pending, None)

  def submit(_=None):
    job = take()
    if job is not None:
      pool.apply_async(
        _write_shard, (job,), callback=lambda r: (done.put(r), submit()), error_callback=done.put
      )

  helpers = min(workers, len(jobs)) - 1
  # The pool's semaphores outlive an interrupted run (it exits at once): the tracker process
  # that multiprocessing starts with the pool would warn of them, which says nothing to a user.
  warnings_before = os.environ.get("PYTHONWARNINGS")
  os.environ["PYTHONWARNINGS"] = "ignore:resource_tracker:UserWarning"
  try:
    pool = (
      multiprocessing.get_context("spawn").Pool(
        helpers, initializer=_init_worker, initargs=(_QuietFirst(), *writer_args)
      )
      if helpers > 0
      else None
    )
  finally:
    if warnings_before is None:
      os.environ.pop("PYTHONWARNINGS")
    else:
      os.environ["PYTHONWARNINGS"] = warnings_before
  for _ in range(max(helpers, 0)):
    submit()
  writer, yielded = _ShardWriter(*writer_args), 0
  try:
    with (
      tqdm.tqdm(
        total=len(jobs), desc=desc, unit="shard", disable=len(jobs) < 8, mininterval=2.0
      ) as bar,
      interrupts.on_interrupt(pool.terminate if pool else lambda: None),
    ):
      while yielded < len(jobs):
        job = take()
        if job is not None:
          done.put(writer(job))
        while not done.empty() or (job is None and yielded < len(jobs)):
          result = done.get()
          if isinstance(result, BaseException):
            raise result
          yield result
          bar.update()
          yielded += 1
  finally:
    if pool is not None:
      pool.terminate()
      pool.join()


def default_workers() -> int:
  return len(os.sched_getaffinity(0))


def _forget(directory: str, index: int) -> None:
  """Makes shard `index` one to redo: the manifest goes until every shard is verified again."""
  for name in (prepared.MANIFEST, prepared.VERIFIED, prepared.record_name(index)):
    fs.remove(fs.join(directory, name))


def _done(directory: str, index: int, first: int, last: int) -> bool:
  """Shard `index` was written completely for documents [first, last)."""
  side = prepared.read_json(fs.join(directory, prepared.record_name(index)))
  if side is None or side.get("documents") != [first, last]:
    return False
  try:
    return fs.stat(fs.join(directory, side["file"])).size == side["bytes"]
  except FileNotFoundError:
    return False


def prepare(
  data_config: specs.DataSpec,
  tokenizer: Tokenizer,
  split: str,
  *,
  workers: int = 0,
  process_index: int = 0,
  process_count: int = 1,
  shard_docs: int = 0,
  log: Callable = print,
) -> PreparedSplit | None:
  """Tokenizes this process's range of the split's shards; returns the split once every shard
  of every process is present (None before). Safe to kill and run again: finished shards stay,
  the rest are redone; a corrupt shard of a complete preparation is redone."""
  shard_docs = shard_docs or SHARD_DOCS
  if shard_docs < 1:
    raise ValueError(f"shard_docs must be >= 1, got {shard_docs}")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(
      f"process_id must be in [0, {process_count}) with num_processes >= 1, "
      f"got process_id={process_index}, num_processes={process_count}"
    )
  workers = workers or default_workers()
  tfds_dir = data_config.tfds_dir
  docs = datasets.load_documents(data_config, split, tfds_dir)
  directory = prepared.split_dir(data_config, tokenizer, split)
  try:
    return prepared.open_split(data_config, tokenizer, split, docs, log)
  except NotPrepared:
    pass
  except CorruptShard as e:
    log(f"{e}: preparing it again")
    _forget(directory, e.index)
  fs.makedirs(directory)
  plan = prepared.make_plan(data_config, tokenizer, split, docs, shard_docs)
  found = prepared.read_json(fs.join(directory, prepared.PLAN))
  if found is not None and found != plan:
    prepared.check_identity(found, plan, fs.join(directory, prepared.PLAN))
    if found.get("shard_docs") != shard_docs:
      raise ValueError(
        f"{directory} is partly prepared with shard_docs={found['shard_docs']}, "
        f"not {shard_docs}; use that value or remove the directory"
      )
  if found != plan:
    fs.write_json(fs.join(directory, prepared.PLAN), plan)
  fs.remove_dead_tmps(directory)  # of killed workers
  n_shards = max(1, -(-len(docs) // shard_docs))
  ranges = [(k, k * shard_docs, min(len(docs), (k + 1) * shard_docs)) for k in range(n_shards)]
  mine = ranges[
    process_index * n_shards // process_count : (process_index + 1) * n_shards // process_count
  ]
  jobs = [job for job in mine if not _done(directory, *job)]
  start = time.perf_counter()
  tokens = sum(
    t for _, t in _write_shards(jobs, workers, f"prepare {split}", (docs, tokenizer, directory))
  )
  if jobs:
    seconds = time.perf_counter() - start
    log(
      f"prepared {len(jobs)} of {n_shards} shards of {plan['dataset']}/{split}: "
      f"{tokens:,} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9) / 1e6:.2f}M tokens/s)"
    )
  missing = [k for k, first, last in ranges if not _done(directory, k, first, last)]
  if missing:
    log(
      f"{len(missing)} of {n_shards} shards of {plan['dataset']}/{split} are still to be "
      f"prepared by other processes; the manifest is written when all are present"
    )
    return None
  return _finalize(directory, plan, ranges, workers)


def _finalize(directory: str, plan: dict, ranges: list, workers: int) -> PreparedSplit:
  """Checks every shard against its record, counts the tokens, writes the manifest last."""
  # _done read each record; one removed since (its shard being redone) is a FileNotFoundError
  sides = [fs.read_json(fs.join(directory, prepared.record_name(k))) for k, _, _ in ranges]
  jobs = [(fs.join(directory, s["file"]), plan["dtype"], plan["vocab_size"]) for s in sides]
  sums, counts = {}, np.zeros(plan["vocab_size"], np.int64)
  with concurrent.futures.ThreadPoolExecutor(min(workers, 8)) as pool:  # hashing frees the GIL
    for path, sha, c in pool.map(_check_shard, jobs):
      sums[path] = sha
      counts += c
  verified = {}
  for (k, _, _), side, job in zip(ranges, sides, jobs):
    if sums[job[0]] != side["sha256"]:
      fs.remove(fs.join(directory, prepared.record_name(k)))
      raise ValueError(
        f"prepared shard {job[0]} does not match its record (sha256 "
        f"{sums[job[0]][:16]}... vs {side['sha256'][:16]}...); run the same "
        "command again to redo it"
      )
    st = fs.stat(job[0])
    verified[side["file"]] = [st.size, st.version, side["sha256"]]
  if counts[plan["eos_id"]] != plan["documents"]:
    raise ValueError(
      f"{directory}: {counts[plan['eos_id']]} EOS tokens for {plan['documents']} "
      "documents (the tokenizer emitted EOS inside a document)"
    )
  fs.write_npy(fs.join(directory, prepared.COUNTS), counts)
  counts_sha = hashlib.sha256(fs.read_bytes(fs.join(directory, prepared.COUNTS))).hexdigest()
  manifest = {
    **plan,
    "tokens": int(counts.sum()),
    "shards": sides,
    "token_counts": {"file": prepared.COUNTS, "sha256": counts_sha},
  }
  fs.write_json(fs.join(directory, prepared.VERIFIED), verified)
  fs.write_json(fs.join(directory, prepared.MANIFEST), manifest)  # last: the preparation counts
  return PreparedSplit(directory, manifest)


def ensure(
  data_config: specs.DataSpec,
  tokenizer: Tokenizer,
  split: str,
  *,
  workers: int = 0,
  process_index: int = 0,
  process_count: int = 1,
  barrier: Callable[[str], None] | None = None,
  all_true: Callable[[bool], bool] | None = None,
  log: Callable = print,
) -> PreparedSplit:
  """The prepared split, prepared first if needed (what `train` and `eval` call).

  With several processes, `all_true(found)` first makes every process take the same path (one
  may find the manifest that another has just written); then each prepares its range, process
  0 completes and finalizes, and a process that still finds no manifest (no shared file system)
  prepares the rest itself.
  """
  try:
    found = prepared.open_split(data_config, tokenizer, split, log=log)
  except NotPrepared:
    found = None
  if process_count > 1 and all_true is not None and not all_true(found is not None):
    found = None
  if found is not None:
    return found
  done = prepare(
    data_config,
    tokenizer,
    split,
    workers=workers,
    process_index=process_index,
    process_count=process_count,
    log=log,
  )
  if process_count > 1:
    assert barrier is not None, "several processes need a barrier"
    barrier(f"prepared own range of {split}")
    if process_index == 0 and done is None:
      done = prepare(data_config, tokenizer, split, workers=workers, log=log)
    barrier(f"prepared {split}")
  done = done or prepare(data_config, tokenizer, split, workers=workers, log=log)
  assert done is not None  # one process prepares every shard
  return done


def prepare_splits(
  config: specs.Spec,
  splits: list,
  workers: int | None,
  workdir: str | None,
  process_id: int | None,
  num_processes: int | None,
  verify: bool = False,
) -> Iterator[str]:
  """What `ao-mdm prepare` does: prepares each split (this host's share), yielding a line per
  split done.
  A split prepared before is checked by size and version only, unless `verify` (every shard's
  sha256 again); the line says which."""
  for split in splits:  # every name is checked before any work
    datasets.check_split(config.data, split)
  index, count = hosts.launcher_process(process_id, num_processes)
  tokenizer = tokenizer_lib.run_tokenizer(config, workdir)
  for split in splits:
    done: PreparedSplit | None
    try:
      done = prepared.open_split(config.data, tokenizer, split)
      if verify:
        try:
          prepared.verify(done.directory, done.manifest, rehash=True)
        except CorruptShard as e:
          yield f"{e}: preparing it again"
          _forget(done.directory, e.index)
          raise
      how = (
        "already prepared; every shard hashed again: verified"
        if verify
        else "already prepared; sizes and versions match the manifest (--verify hashes every "
        "shard again)"
      )
    except (NotPrepared, CorruptShard):
      done = prepare(
        config.data,
        tokenizer,
        split,
        workers=workers or 0,
        process_index=index,
        process_count=count,
      )
      how = "every shard hashed: verified"
    if done is not None:
      yield (
        f"{split}: {done.documents:,} documents, {done.tokens:,} tokens in "
        f"{len(done.manifest['shards'])} shards, {how}: {done.directory}"
      )
