"""Prepared data: a split tokenized once into token shards with a manifest (data/prepare.py
writes it), read here by block.

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
import hashlib
import json
import os
import re
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

from ao_mdm.data import datasets
from ao_mdm.data.tokenizer import Tokenizer

FORMAT = 1
_READ_BYTES = 16 << 20  # bytes per read when checksumming and counting
MANIFEST = "manifest.json"
PLAN = "plan.json"
VERIFIED = "verified.json"
COUNTS = "token_counts.npy"


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


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def shard_name(index: int) -> str:
  return f"shard-{index:05d}.bin"


TMP_NAME = re.compile(r"\.tmp-(.+)-(\d+)\.[0-9a-f]{8}(\.npy)?$")


def tmp_path(path: str) -> str:
  """A temporary name beside `path` that says which host and process write it."""
  return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}.{os.urandom(4).hex()}"


def write_json(path: str, obj: Any) -> None:
  tmp = tmp_path(path)
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def read_json(path: str) -> Optional[dict]:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON ({e}); remove {os.path.dirname(path)} and "
                     "prepare it again") from None


def make_plan(data_config: Any, tokenizer: Tokenizer, split: str, docs: datasets.Documents,
          shard_docs: int) -> dict:
  """What identifies a preparation: checked against the manifest before any read."""
  return {"format": FORMAT, "dataset": datasets.dataset_tag(data_config), "split": split,
          "source": docs.fingerprint, "tokenizer": tokenizer.name,
          "tokenizer_sha256": tokenizer.sha256, "vocab_size": int(tokenizer.vocab_size),
          "eos_id": int(tokenizer.eos_id), "dtype": token_dtype(tokenizer.vocab_size).name,
          "documents": len(docs), "shard_docs": int(shard_docs)}


IDENTITY = ("format", "dataset", "split", "source", "tokenizer", "tokenizer_sha256",
             "vocab_size", "eos_id", "dtype")


def check_identity(found: dict, expected: dict, path: str) -> None:
  for key in IDENTITY + ("documents",):
    if found.get(key) != expected[key]:
      raise ValueError(
          f"{path} was prepared with {key}={found.get(key)!r}, but this config gives "
          f"{key}={expected[key]!r}; fix the config, or remove {os.path.dirname(path)} to "
          "prepare it again")


class CorruptShard(ValueError):
  """A prepared shard whose size or sha256 is not its manifest's."""

  def __init__(self, message: str, index: int):
    super().__init__(message)
    self.index = index


def sha256_and_counts(path: str, dtype: np.dtype, vocab_size: int,
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
    return np.load(os.path.join(self.directory, COUNTS))

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
  path = os.path.join(directory, MANIFEST)
  manifest = read_json(path)
  if manifest is None:
    raise NotPrepared(f"{split!r} of dataset {data_config.dataset!r} is not prepared "
                      f"(no {path}); `ao-mdm prepare --config=...` prepares it")
  if docs is None:
    docs = datasets.load_documents(data_config, split, data_config.get("tfds_dir", ""))
  check_identity(manifest, make_plan(data_config, tokenizer, split, docs, 0), path)
  _verify(directory, manifest, log)
  return PreparedSplit(directory, manifest)


def _verify(directory: str, manifest: dict, log: Callable) -> None:
  verified = read_json(os.path.join(directory, VERIFIED)) or {}
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
    sums = pool.map(lambda job: sha256_and_counts(job[1], dtype, 0, False)[0], to_hash)
    for (index, path, st), got in zip(to_hash, sums):
      want = manifest["shards"][index]["sha256"]
      if got != want:
        raise CorruptShard(f"prepared shard {path} has sha256 {got[:16]}..., its manifest says "
                           f"{want[:16]}... (corrupted); `ao-mdm prepare` redoes it", index)
      verified[manifest["shards"][index]["file"]] = [st.st_size, st.st_mtime_ns]
  try:
    write_json(os.path.join(directory, VERIFIED), verified)
  except OSError:  # a read-only copy: verified again next time
    pass


# The authors' evaluation packing.

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
