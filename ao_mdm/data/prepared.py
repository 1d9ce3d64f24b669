"""Prepared data: a split tokenized once into token shards with a manifest, then read by block.

One directory per (dataset, tokenizer, split) under `data.prepared_dir` (default
`<TFDS data dir>/ao_mdm_prepared`): `<dataset>/<tokenizer>-<sha256[:16]>/<split>/`, holding

    shard-00000.bin ...  the split's token stream: each document's ids, then EOS, in document
                         order; little-endian uint16 (uint32 for vocabularies over 65,536).
                         Shard k holds documents [k * shard_docs, (k + 1) * shard_docs), so the
                         files do not depend on how many workers or hosts wrote them.
    shard-00000.json     that shard's documents, tokens, bytes and sha256 (written after it)
    plan.json            what is being prepared: source, tokenizer, documents, shard_docs
    token_counts.npy     int64 [vocab] counts of every token of the split (the unigram baseline)
    manifest.json        written last, once every shard is present and verified; nothing
                         without it is accepted as prepared
    verified.json        each shard's size and mtime when its sha256 was last checked

Block i of T tokens is tokens [i T, (i + 1) T) of the stream (the rest is dropped), which
equals packing the whole split in memory; one preparation serves every block size.
"""
import bisect
import concurrent.futures
import functools
import hashlib
import json
import multiprocessing
import os
import queue
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import numpy as np

from ao_mdm import interrupts
from ao_mdm.data import datasets
from ao_mdm.data import tokenizer as tokenizer_lib
from ao_mdm.data.tokenizer import Tokenizer

FORMAT = 1
SHARD_DOCS = 1024  # documents per shard: the unit of parallel work and of redoing after a kill
_CHUNK_DOCS = 256  # documents read and tokenized at once by a worker
_READ_BYTES = 16 << 20  # bytes per read when checksumming and counting
_MANIFEST = "manifest.json"
_PLAN = "plan.json"
_VERIFIED = "verified.json"
_COUNTS = "token_counts.npy"


class NotPrepared(FileNotFoundError):
  """The split has no complete preparation (no manifest) yet."""


def root_dir(data_config: Any) -> str:
  """data.prepared_dir, or ao_mdm_prepared under the TFDS data dir."""
  if data_config.get("prepared_dir"):
    return os.path.expanduser(data_config.prepared_dir)
  return os.path.join(datasets.resolve_tfds_dir(data_config.get("tfds_dir", "")),
                      "ao_mdm_prepared")


def split_dir(data_config: Any, tokenizer: Tokenizer, split: str) -> str:
  """Where a split prepared with this tokenizer lives."""
  return os.path.join(root_dir(data_config), datasets.dataset_tag(data_config),
                      f"{tokenizer.name}-{tokenizer.sha256[:16]}", split)


def launcher_process(process_id: Optional[int] = None,
                     num_processes: Optional[int] = None) -> tuple[int, int]:
  """This host's (index, count) for `ao-mdm prepare`: the flags, else SLURM's or a multi-host
  TPU VM's variables, else (0, 1)."""
  if process_id is not None or num_processes is not None:
    if process_id is None or num_processes is None:
      raise ValueError("give --process_id and --num_processes together (or neither)")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id={process_id} must be in [0, {num_processes}) and "
                       f"--num_processes={num_processes} >= 1")
    return process_id, num_processes
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
    return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if "," in hosts and os.environ.get("TPU_WORKER_ID", "").isdigit():
    return int(os.environ["TPU_WORKER_ID"]), len(hosts.split(","))
  return 0, 1


def _dtype(vocab_size: int) -> np.dtype:
  return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def _shard_name(index: int) -> str:
  return f"shard-{index:05d}.bin"


_TMP_NAME = re.compile(r"\.tmp-(.+)-(\d+)\.[0-9a-f]{8}(\.npy)?$")


def _tmp(path: str) -> str:
  """A temporary name beside `path` that says which host and process write it."""
  return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}.{os.urandom(4).hex()}"


def _write_json(path: str, obj: Any) -> None:
  tmp = _tmp(path)
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def _read_json(path: str) -> Optional[dict]:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON ({e}); remove {os.path.dirname(path)} and "
                     "prepare it again") from None


def _plan(data_config: Any, tokenizer: Tokenizer, split: str, docs: datasets.Documents,
          shard_docs: int) -> dict:
  """What identifies a preparation: checked against the manifest before any read."""
  return {"format": FORMAT, "dataset": datasets.dataset_tag(data_config), "split": split,
          "source": docs.fingerprint, "tokenizer": tokenizer.name,
          "tokenizer_sha256": tokenizer.sha256, "vocab_size": int(tokenizer.vocab_size),
          "eos_id": int(tokenizer.eos_id), "dtype": _dtype(tokenizer.vocab_size).name,
          "documents": len(docs), "shard_docs": int(shard_docs)}


_IDENTITY = ("format", "dataset", "split", "source", "tokenizer", "tokenizer_sha256",
             "vocab_size", "eos_id", "dtype")


def _check_identity(found: dict, expected: dict, path: str) -> None:
  for key in _IDENTITY + ("documents",):
    if found.get(key) != expected[key]:
      raise ValueError(
          f"{path} was prepared with {key}={found.get(key)!r}, but this config gives "
          f"{key}={expected[key]!r}; fix the config, or remove {os.path.dirname(path)} to "
          "prepare it again")


# Reading.

class CorruptShard(ValueError):
  """A prepared shard whose size or sha256 is not its manifest's."""

  def __init__(self, message: str, index: int):
    super().__init__(message)
    self.index = index


def _sha256_and_counts(path: str, dtype: np.dtype, vocab_size: int,
                       counts: bool) -> tuple[str, Optional[np.ndarray]]:
  """The file's sha256 and, with `counts`, the int64 [vocab] histogram of its tokens."""
  h, total = hashlib.sha256(), np.zeros(vocab_size, np.int64) if counts else None
  with open(path, "rb") as f:
    while chunk := f.read(_READ_BYTES):
      h.update(chunk)
      if counts:
        total += np.bincount(np.frombuffer(chunk, dtype), minlength=vocab_size)[:vocab_size]
  return h.hexdigest(), total


class PreparedSplit:
  """A complete, verified preparation: the token stream, its blocks and its token counts."""

  def __init__(self, directory: str, manifest: dict):
    self.directory = directory
    self.manifest = manifest
    self.dtype = np.dtype(manifest["dtype"])
    self.tokens = int(manifest["tokens"])
    self.documents = int(manifest["documents"])
    self.eos_id = int(manifest["eos_id"])
    self.name = f"split {manifest['split']!r} of dataset {manifest['dataset']!r}"
    shards = manifest["shards"]
    self._paths = [os.path.join(directory, s["file"]) for s in shards]
    self._starts = np.concatenate([[0], np.cumsum([s["tokens"] for s in shards])]).tolist()
    self._fds: dict = {}
    self._lock = threading.Lock()

  def __getstate__(self):  # file descriptors stay with their process
    return {**self.__dict__, "_fds": {}, "_lock": None}

  def __setstate__(self, state):
    self.__dict__.update(state, _lock=threading.Lock())

  def _fd(self, shard: int) -> int:
    key = (os.getpid(), shard)
    if key not in self._fds:
      with self._lock:
        if key not in self._fds:
          self._fds[key] = os.open(self._paths[shard], os.O_RDONLY)
    return self._fds[key]

  def read(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the stream, in the file dtype; a block may span shards."""
    if not 0 <= start <= stop <= self.tokens:
      raise IndexError(f"tokens [{start}, {stop}) outside [0, {self.tokens}) of {self.name}")
    out = np.empty(stop - start, self.dtype)
    shard, pos, size = bisect.bisect_right(self._starts, start) - 1, start, self.dtype.itemsize
    while pos < stop:
      end = min(stop, self._starts[shard + 1])
      view = memoryview(out[pos - start:end - start]).cast("B")
      if os.preadv(self._fd(shard), [view], (pos - self._starts[shard]) * size) != len(view):
        raise CorruptShard(f"{self._paths[shard]} ended early (truncated while in use)", shard)
      pos, shard = end, shard + 1
    return out

  def token_counts(self) -> np.ndarray:
    """int64 [vocab] counts of every token of the split, one EOS per document included."""
    return np.load(os.path.join(self.directory, _COUNTS))

  def blocks(self, block_size: int) -> "Blocks":
    return Blocks(self, block_size)


class Blocks(Sequence):
  """The split's consecutive block_size-token blocks as int32 arrays: a grain data source."""

  def __init__(self, split: PreparedSplit, block_size: int):
    if block_size <= 0:
      raise ValueError(f"block_size must be positive, got {block_size}")
    self.split, self.block_size = split, block_size

  def __len__(self) -> int:
    return self.split.tokens // self.block_size

  def __getitem__(self, index: int) -> np.ndarray:
    if not 0 <= index < len(self):
      raise IndexError(f"block {index} outside [0, {len(self)})")
    t = self.block_size
    return self.split.read(index * t, (index + 1) * t).astype(np.int32)

  def rows(self, indices: Sequence[int]) -> np.ndarray:
    """Blocks `indices` as one int32 [len(indices), block_size] array."""
    t, out = self.block_size, np.empty((len(indices), self.block_size), np.int32)
    for row, index in enumerate(indices):
      out[row] = self.split.read(index * t, (index + 1) * t)
    return out

  def array(self, limit: Optional[int] = None) -> np.ndarray:
    """The first `limit` blocks (default: all) as one int32 [N, block_size] array."""
    n = len(self) if limit is None else min(limit, len(self))
    return self.split.read(0, n * self.block_size).astype(np.int32).reshape(n, self.block_size)


def open_split(data_config: Any, tokenizer: Tokenizer, split: str,
               docs: Optional[datasets.Documents] = None, log: Callable = print) -> PreparedSplit:
  """The verified preparation of a split; NotPrepared without a manifest.

  Every shard's size is checked; its sha256 too unless its size and mtime are those recorded
  when it was last verified (so a restart costs a stat per shard, not a read of the corpus).
  """
  directory = split_dir(data_config, tokenizer, split)
  path = os.path.join(directory, _MANIFEST)
  manifest = _read_json(path)
  if manifest is None:
    raise NotPrepared(f"{split!r} of dataset {data_config.dataset!r} is not prepared "
                      f"(no {path}); `ao-mdm prepare --config=...` prepares it")
  if docs is None:
    docs = datasets.load_documents(data_config, split, data_config.get("tfds_dir", ""))
  _check_identity(manifest, _plan(data_config, tokenizer, split, docs, 0), path)
  _verify(directory, manifest, log)
  return PreparedSplit(directory, manifest)


def _verify(directory: str, manifest: dict, log: Callable) -> None:
  verified = _read_json(os.path.join(directory, _VERIFIED)) or {}
  to_hash = []
  for index, shard in enumerate(manifest["shards"]):
    path = os.path.join(directory, shard["file"])
    try:
      st = os.stat(path)
    except FileNotFoundError:
      raise CorruptShard(f"prepared shard {path} is missing; `ao-mdm prepare` redoes it",
                         index) from None
    if st.st_size != shard["bytes"]:
      raise CorruptShard(f"prepared shard {path} is {st.st_size} bytes, its manifest says "
                         f"{shard['bytes']} (truncated or altered); `ao-mdm prepare` redoes it",
                         index)
    if verified.get(shard["file"]) != [st.st_size, st.st_mtime_ns]:
      to_hash.append((index, path, st))
  if not to_hash:
    return
  n_bytes = sum(st.st_size for _, _, st in to_hash)
  if n_bytes > 1 << 30:
    log(f"verifying {len(to_hash)} prepared shards ({n_bytes / 1e9:.1f} GB) in {directory}")
  dtype = np.dtype(manifest["dtype"])
  with concurrent.futures.ThreadPoolExecutor(min(8, len(to_hash))) as pool:
    sums = pool.map(lambda job: _sha256_and_counts(job[1], dtype, 0, False)[0], to_hash)
    for (index, path, st), got in zip(to_hash, sums):
      want = manifest["shards"][index]["sha256"]
      if got != want:
        raise CorruptShard(f"prepared shard {path} has sha256 {got[:16]}..., its manifest says "
                           f"{want[:16]}... (corrupted); `ao-mdm prepare` redoes it", index)
      verified[manifest["shards"][index]["file"]] = [st.st_size, st.st_mtime_ns]
  try:
    _write_json(os.path.join(directory, _VERIFIED), verified)
  except OSError:  # a read-only copy: verified again next time
    pass


# Preparing.

class _ShardWriter:
  """Tokenizes a range of documents into one shard file: run by each worker process."""

  def __init__(self, docs: datasets.Documents, tokenizer: Tokenizer, directory: str):
    self.docs, self.tokenizer, self.directory = docs, tokenizer, directory
    self.dtype = _dtype(tokenizer.vocab_size)

  def __call__(self, job: tuple[int, int, int]) -> tuple[int, int]:
    index, first, last = job
    path = os.path.join(self.directory, _shard_name(index))
    tmp, h, tokens = _tmp(path), hashlib.sha256(), 0
    with open(tmp, "wb") as f:
      for start in range(first, last, _CHUNK_DOCS):
        ids = self.tokenizer.encode_batch(self.docs.read(start, min(start + _CHUNK_DOCS, last)),
                                          num_threads=1)
        chunk = _with_eos(ids, self.tokenizer.eos_id, self.dtype)
        h.update(chunk)
        f.write(chunk.data)
        tokens += len(chunk)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    _write_json(path[:-len(".bin")] + ".json", {
        "file": _shard_name(index), "documents": [first, last], "tokens": tokens,
        "bytes": tokens * self.dtype.itemsize, "sha256": h.hexdigest()})
    return index, tokens


def _with_eos(ids: list[list[int]], eos_id: int, dtype: np.dtype) -> np.ndarray:
  """The documents' ids, each followed by EOS, as one array."""
  ends = np.cumsum([len(x) + 1 for x in ids])
  out = np.empty(int(ends[-1]) if len(ends) else 0, dtype)
  start = 0
  for x, end in zip(ids, ends):
    out[start:end - 1] = x
    start = end
  out[ends - 1] = eos_id
  return out


_WORKER: list = []  # the _ShardWriter of a worker process, made by its initializer


def _init_worker(*args) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
  _WORKER[:] = [_ShardWriter(*args)]


def _write_shard(job: tuple[int, int, int]) -> tuple[int, int]:
  return _WORKER[0](job)


def _check_shard(job: tuple[str, str, int]) -> tuple[str, str, np.ndarray]:
  path, dtype, vocab = job
  return (path, *_sha256_and_counts(path, np.dtype(dtype), vocab, True))


def _write_shards(jobs: list, workers: int, desc: str, writer_args: tuple):
  """Yields (shard, tokens) for every job, unordered. This process writes shards and, with
  workers > 1, so do workers - 1 spawned processes (not forked: JAX may already run threads
  here); each takes the next job when it finishes one. A progress bar when jobs are many."""
  import tqdm  # pylint: disable=g-import-not-at-top
  pending, lock, done = iter(jobs), threading.Lock(), queue.SimpleQueue()

  def take():
    with lock:
      return next(pending, None)

  def submit(_=None):
    job = take()
    if job is not None:
      pool.apply_async(_write_shard, (job,), callback=lambda r: (done.put(r), submit()),
                       error_callback=done.put)

  helpers = min(workers, len(jobs)) - 1
  pool = multiprocessing.get_context("spawn").Pool(
      helpers, initializer=_init_worker, initargs=writer_args) if helpers > 0 else None
  for _ in range(max(helpers, 0)):
    submit()
  writer, yielded = _ShardWriter(*writer_args), 0
  try:
    with tqdm.tqdm(total=len(jobs), desc=desc, unit="shard", disable=len(jobs) < 8,
                   mininterval=2.0) as bar, \
        interrupts.on_interrupt(pool.terminate if pool else lambda: None):
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


def _clean_stale(directory: str) -> None:
  """Removes temporary files left by killed processes of this host (never a live one's)."""
  host = socket.gethostname()
  for name in os.listdir(directory):
    match = _TMP_NAME.search(name)
    if not match or match[1] != host:
      continue
    try:
      os.kill(int(match[2]), 0)
    except ProcessLookupError:
      os.remove(os.path.join(directory, name))
    except PermissionError:
      pass


def _done(directory: str, index: int, first: int, last: int) -> bool:
  """Shard `index` was written completely for documents [first, last)."""
  side = _read_json(os.path.join(directory, f"shard-{index:05d}.json"))
  if side is None or side.get("documents") != [first, last]:
    return False
  try:
    return os.path.getsize(os.path.join(directory, side["file"])) == side["bytes"]
  except FileNotFoundError:
    return False


def prepare(data_config: Any, tokenizer: Tokenizer, split: str, *, workers: int = 0,
            process_index: int = 0, process_count: int = 1, shard_docs: int = 0,
            log: Callable = print) -> Optional[PreparedSplit]:
  """Tokenizes this process's range of the split's shards; returns the split once every shard
  of every process is present (None before). Safe to kill and run again: finished shards stay,
  the rest are redone; a corrupt shard of a complete preparation is redone."""
  shard_docs = shard_docs or SHARD_DOCS
  if shard_docs < 1:
    raise ValueError(f"shard_docs must be >= 1, got {shard_docs}")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_id must be in [0, {process_count}) with num_processes >= 1, "
                     f"got process_id={process_index}, num_processes={process_count}")
  workers = workers or default_workers()
  tfds_dir = data_config.get("tfds_dir", "")
  docs = datasets.load_documents(data_config, split, tfds_dir)
  directory = split_dir(data_config, tokenizer, split)
  try:
    return open_split(data_config, tokenizer, split, docs, log)
  except NotPrepared:
    pass
  except CorruptShard as e:  # redo that shard; the manifest goes until it is verified again
    log(f"{e}: preparing it again")
    for name in (_MANIFEST, _VERIFIED, f"shard-{e.index:05d}.json"):
      if os.path.exists(os.path.join(directory, name)):
        os.remove(os.path.join(directory, name))
  os.makedirs(directory, exist_ok=True)
  plan = _plan(data_config, tokenizer, split, docs, shard_docs)
  found = _read_json(os.path.join(directory, _PLAN))
  if found is not None and found != plan:
    _check_identity(found, plan, os.path.join(directory, _PLAN))
    if found.get("shard_docs") != shard_docs:
      raise ValueError(f"{directory} is partly prepared with shard_docs={found['shard_docs']}, "
                       f"not {shard_docs}; use that value or remove the directory")
  _write_json(os.path.join(directory, _PLAN), plan)
  _clean_stale(directory)
  n_shards = max(1, -(-len(docs) // shard_docs))
  ranges = [(k, k * shard_docs, min(len(docs), (k + 1) * shard_docs)) for k in range(n_shards)]
  mine = ranges[process_index * n_shards // process_count:
                (process_index + 1) * n_shards // process_count]
  jobs = [job for job in mine if not _done(directory, *job)]
  start = time.perf_counter()
  tokens = sum(t for _, t in _write_shards(jobs, workers, f"prepare {split}",
                                           (docs, tokenizer, directory)))
  if jobs:
    seconds = time.perf_counter() - start
    log(f"prepared {len(jobs)} of {n_shards} shards of {plan['dataset']}/{split}: "
        f"{tokens:,} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9) / 1e6:.2f}M tokens/s)")
  missing = [k for k, first, last in ranges if not _done(directory, k, first, last)]
  if missing:
    log(f"{len(missing)} of {n_shards} shards of {plan['dataset']}/{split} are still to be "
        f"prepared by other processes; the manifest is written when all are present")
    return None
  return _finalize(directory, plan, ranges, workers)


def _finalize(directory: str, plan: dict, ranges: list, workers: int) -> PreparedSplit:
  """Checks every shard against its record, counts the tokens, writes the manifest last."""
  sides = [_read_json(os.path.join(directory, f"shard-{k:05d}.json")) for k, _, _ in ranges]
  jobs = [(os.path.join(directory, s["file"]), plan["dtype"], plan["vocab_size"]) for s in sides]
  sums, counts = {}, np.zeros(plan["vocab_size"], np.int64)
  with concurrent.futures.ThreadPoolExecutor(min(workers, 8)) as pool:  # hashing frees the GIL
    for path, sha, c in pool.map(_check_shard, jobs):
      sums[path] = sha
      counts += c
  verified = {}
  for (k, _, _), side, job in zip(ranges, sides, jobs):
    if sums[job[0]] != side["sha256"]:
      os.remove(os.path.join(directory, f"shard-{k:05d}.json"))
      raise ValueError(f"prepared shard {job[0]} does not match its record (sha256 "
                       f"{sums[job[0]][:16]}... vs {side['sha256'][:16]}...); run the same "
                       "command again to redo it")
    st = os.stat(job[0])
    verified[side["file"]] = [st.st_size, st.st_mtime_ns]
  if counts[plan["eos_id"]] != plan["documents"]:
    raise ValueError(f"{directory}: {counts[plan['eos_id']]} EOS tokens for {plan['documents']} "
                     "documents (the tokenizer emitted EOS inside a document)")
  tmp = _tmp(os.path.join(directory, _COUNTS)) + ".npy"  # np.save appends .npy otherwise
  np.save(tmp, counts)
  os.replace(tmp, os.path.join(directory, _COUNTS))
  with open(os.path.join(directory, _COUNTS), "rb") as f:
    counts_sha = hashlib.sha256(f.read()).hexdigest()
  manifest = {**plan, "tokens": int(counts.sum()), "shards": sides,
              "token_counts": {"file": _COUNTS, "sha256": counts_sha}}
  _write_json(os.path.join(directory, _VERIFIED), verified)
  _write_json(os.path.join(directory, _MANIFEST), manifest)
  return PreparedSplit(directory, manifest)


def ensure(data_config: Any, tokenizer: Tokenizer, split: str, *, workers: int = 0,
           process_index: int = 0, process_count: int = 1,
           barrier: Optional[Callable[[str], None]] = None,
           log: Callable = print) -> PreparedSplit:
  """The prepared split, prepared first if needed (what `train` and `eval` call).

  With several processes each prepares its range, then process 0 completes and finalizes; a
  process that still finds no manifest (no shared file system) prepares the rest itself.
  """
  try:
    return open_split(data_config, tokenizer, split, log=log)
  except NotPrepared:
    pass
  done = prepare(data_config, tokenizer, split, workers=workers, process_index=process_index,
                 process_count=process_count, log=log)
  if process_count > 1:
    barrier(f"prepared own range of {split}")
    if process_index == 0 and done is None:
      done = prepare(data_config, tokenizer, split, workers=workers, log=log)
    barrier(f"prepared {split}")
  return done or prepare(data_config, tokenizer, split, workers=workers, log=log)


# The authors' evaluation packing.

def prepare_command(config: Any, splits: list, workers: Optional[int], workdir: Optional[str],
                    process_id: Optional[int], num_processes: Optional[int]) -> Iterator[str]:
  """`ao-mdm prepare`: prepares each split (this host's share), yielding a line per split done."""
  index, count = launcher_process(process_id, num_processes)
  tokenizer = tokenizer_lib.run_tokenizer(config, workdir)
  for split in splits:
    done = prepare(config.data, tokenizer, split, workers=workers or 0, process_index=index,
                   process_count=count)
    if done is not None:
      yield (f"{split}: {done.documents:,} documents, {done.tokens:,} tokens in "
             f"{len(done.manifest['shards'])} shards, verified: {done.directory}")


def paper_blocks(tokens: np.ndarray, eos_id: int, block_size: int, num_proc: int = 8,
                 batch_docs: int = 1000) -> np.ndarray:
  """int32 [N, T] blocks as the authors' data.py packs an evaluation split.

  Their `group_texts` runs under `Dataset.map(batched=True, num_proc=8)`: the split is cut into
  min(8, documents) contiguous shards (the first `documents % 8` one document longer), each
  shard into batches of 1,000 documents, and every batch is concatenated and cut into blocks
  on its own, dropping its remainder. `tokens` is the split's stream (documents end with EOS).
  """
  ends = np.flatnonzero(tokens == eos_id) + 1
  starts = np.concatenate([[0], ends[:-1]])
  n = len(ends)
  procs = min(num_proc, n)
  div, mod = divmod(n, procs) if procs else (0, 0)
  pieces = []
  for rank in range(procs):
    first = div * rank + min(rank, mod)
    last = first + div + (1 if rank < mod else 0)
    for batch in range(first, last, batch_docs):
      lo, hi = starts[batch], ends[min(batch + batch_docs, last) - 1]
      k = (hi - lo) // block_size
      pieces.append(tokens[lo:lo + k * block_size].reshape(k, block_size))
  if not pieces:
    return np.zeros((0, block_size), np.int32)
  return np.concatenate(pieces).astype(np.int32)
