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
    verified.json        each shard's size, version (mtime, or generation on gs://) and sha256
                         when its hash last matched the manifest's

Block i of T tokens is tokens [i T, (i + 1) T) of the stream (the rest is dropped), which
equals packing the whole split in memory; one preparation serves every block size.
"""

import bisect
from collections.abc import Callable, Sequence
import concurrent.futures
import hashlib
import json

import numpy as np

from ao_mdm import specs
from ao_mdm.data import datasets
from ao_mdm.data.tokenizer import Tokenizer
from ao_mdm.storage import fs, paths

FORMAT = 1
_READ_BYTES = 16 << 20  # bytes per read when checksumming and counting
MANIFEST = "manifest.json"
PLAN = "plan.json"
VERIFIED = "verified.json"
COUNTS = "token_counts.npy"


class NotPrepared(FileNotFoundError):
  """The split has no complete preparation (no manifest) yet."""


def root_dir(data_config: specs.DataSpec) -> str:
  """data.prepared_dir (local or gs://), or ao_mdm_prepared under the TFDS data dir."""
  if data_config.prepared_dir:
    return paths.check(data_config.prepared_dir, "data.prepared_dir")
  return fs.join(datasets.resolve_tfds_dir(data_config.tfds_dir), "ao_mdm_prepared")


def split_dir(data_config: specs.DataSpec, tokenizer: Tokenizer, split: str) -> str:
  """Where a split prepared with this tokenizer lives."""
  return fs.join(
    root_dir(data_config),
    datasets.dataset_tag(data_config),
    f"{tokenizer.name}-{tokenizer.sha256[:16]}",
    split,
  )


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def shard_name(index: int) -> str:
  return f"shard-{index:05d}.bin"


def record_name(index: int) -> str:
  """The name of shard `index`'s record (written after the shard: its presence says done)."""
  return f"shard-{index:05d}.json"


def read_json(path: str) -> dict | None:
  """A JSON file of a preparation, None if it is missing."""
  try:
    return fs.read_json(path)
  except FileNotFoundError:
    return None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(
      f"{path} is not valid JSON ({e}); remove {fs.parent(path)} and prepare it again"
    ) from None


def make_plan(
  data_config: specs.DataSpec,
  tokenizer: Tokenizer,
  split: str,
  docs: datasets.Documents | None,
  shard_docs: int,
) -> dict:
  """What identifies a preparation: checked against the manifest before any read. Without the
  source documents (a host that reads a preparation it did not make), the source's own
  fields are left out."""
  plan = {
    "format": FORMAT,
    "dataset": datasets.dataset_tag(data_config),
    "split": split,
    "tokenizer": tokenizer.name,
    "tokenizer_sha256": tokenizer.sha256,
    "vocab_size": int(tokenizer.vocab_size),
    "eos_id": int(tokenizer.eos_id),
    "dtype": token_dtype(tokenizer.vocab_size).name,
    "shard_docs": int(shard_docs),
  }
  if docs is not None:
    plan.update(source=docs.fingerprint, documents=len(docs))
  return plan


IDENTITY = (
  "format",
  "dataset",
  "split",
  "tokenizer",
  "tokenizer_sha256",
  "vocab_size",
  "eos_id",
  "dtype",
)
SOURCE = ("source", "documents")  # what the dataset itself gives


def check_identity(found: dict, expected: dict, path: str) -> None:
  """Refuses a preparation made for another config (or of a source that has changed since)."""
  for key in IDENTITY + SOURCE:
    if key not in expected or found.get(key) == expected[key]:
      continue
    if key in SOURCE:
      raise ValueError(
        f"{path} does not match its source: prepared with {key}={found.get(key)!r}, the "
        f"dataset now gives {expected[key]!r}; remove {fs.parent(path)} and run `ao-mdm "
        "prepare` again"
      )
    raise ValueError(
      f"{path} was prepared with {key}={found.get(key)!r}, but this config gives "
      f"{key}={expected[key]!r}; fix the config, or remove {fs.parent(path)} to prepare it "
      "again"
    )


class CorruptShard(ValueError):
  """A prepared shard whose size or sha256 is not its manifest's."""

  def __init__(self, message: str, index: int):
    super().__init__(message)
    self.index = index


def sha256_and_counts(
  path: str, dtype: np.dtype, vocab_size: int, counts: bool
) -> tuple[str, np.ndarray | None]:
  """The file's sha256 and, with `counts`, the int64 [vocab] histogram of its tokens."""
  h, total = hashlib.sha256(), np.zeros(vocab_size, np.int64) if counts else None
  with fs.open_read(path) as f:
    while chunk := f.read(_READ_BYTES):
      h.update(chunk)
      if total is not None:
        total += np.bincount(np.frombuffer(chunk, dtype), minlength=vocab_size)[:vocab_size]
  return h.hexdigest(), total


class PreparedSplit:
  """A complete, verified preparation: the token stream, its blocks and its token counts.
  Reads go through one fs.RangeReader: a pread locally, all of a call's ranges in flight at
  once on gs://."""

  def __init__(self, directory: str, manifest: dict):
    self.directory = directory
    self.manifest = manifest
    self.dtype = np.dtype(manifest["dtype"])
    self.tokens = int(manifest["tokens"])
    self.documents = int(manifest["documents"])
    self.eos_id = int(manifest["eos_id"])
    self.name = f"split {manifest['split']!r} of dataset {manifest['dataset']!r}"
    shards = manifest["shards"]
    self._paths = [fs.join(directory, s["file"]) for s in shards]
    self._starts = np.concatenate([[0], np.cumsum([s["tokens"] for s in shards])]).tolist()
    self._reader = fs.RangeReader()

  def _ranges(self, start: int, stop: int) -> list[tuple[str, int, int]]:
    """(file, first byte, end byte) of tokens [start, stop), which may span shards."""
    if not 0 <= start <= stop <= self.tokens:
      raise IndexError(f"tokens [{start}, {stop}) outside [0, {self.tokens}) of {self.name}")
    shard, pos, size = bisect.bisect_right(self._starts, start) - 1, start, self.dtype.itemsize
    ranges = []
    while pos < stop:
      end = min(stop, self._starts[shard + 1])
      offset = pos - self._starts[shard]
      ranges.append((self._paths[shard], offset * size, (offset + end - pos) * size))
      pos, shard = end, shard + 1
    return ranges

  def read_many(self, spans: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """Tokens [start, stop) of the stream for each span, in the file dtype, read at once."""
    outs = [np.empty(stop - start, self.dtype) for start, stop in spans]
    requests, views = [], []
    for (start, _), out in zip(spans, outs):
      pos = 0
      for path, first, end in self._ranges(start, start + len(out)):
        n = (end - first) // self.dtype.itemsize
        requests.append((path, first, end))
        views.append(out[pos : pos + n].data.cast("B"))
        pos += n
    try:
      self._reader.read(requests, views)
    except fs.EndedEarly as e:
      raise CorruptShard(str(e), self._paths.index(e.filename)) from None
    return outs

  def read(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the stream, in the file dtype."""
    return self.read_many([(start, stop)])[0]

  def token_counts(self) -> np.ndarray:
    """int64 [vocab] counts of every token of the split, one EOS per document included."""
    return fs.read_npy(fs.join(self.directory, COUNTS))

  def blocks(self, block_size: int) -> "Blocks":
    return Blocks(self, block_size)


class Blocks(Sequence):
  """The split's consecutive block_size-token blocks as int32 arrays: a grain data source."""

  def __init__(self, split: PreparedSplit, block_size: int):
    if block_size <= 0:
      raise ValueError(f"block_size must be positive, got {block_size}")
    self.split, self.block_size = split, block_size

  @property
  def name(self) -> str:
    return self.split.name

  def __len__(self) -> int:
    return self.split.tokens // self.block_size

  def __getitem__(self, index: int) -> np.ndarray:  # type: ignore[override]  # no slices
    if not 0 <= index < len(self):
      raise IndexError(f"block {index} outside [0, {len(self)})")
    t = self.block_size
    return self.split.read(index * t, (index + 1) * t).astype(np.int32)

  def rows(self, indices: Sequence[int]) -> np.ndarray:
    """Blocks `indices` as one int32 [len(indices), block_size] array, read at once."""
    t = self.block_size
    rows = self.split.read_many([(int(i) * t, (int(i) + 1) * t) for i in indices])
    return np.stack(rows).astype(np.int32) if rows else np.empty((0, t), np.int32)

  def array(self, limit: int | None = None) -> np.ndarray:
    """The first `limit` blocks (default: all) as one int32 [N, block_size] array."""
    n = len(self) if limit is None else min(limit, len(self))
    return self.split.read(0, n * self.block_size).astype(np.int32).reshape(n, self.block_size)


def open_split(
  data_config: specs.DataSpec,
  tokenizer: Tokenizer,
  split: str,
  docs: datasets.Documents | None = None,
  log: Callable = print,
) -> PreparedSplit:
  """The verified preparation of a split; NotPrepared without a manifest.

  Every shard's size is checked; its sha256 too unless the shard is the version (mtime, or
  generation on gs://) whose hash matched the manifest's last time (so a restart costs a stat
  per shard, not a read of the corpus). The source is compared when it is on this host; a host
  that only reads what another prepared (a bucket) needs no copy of it.
  """
  directory = split_dir(data_config, tokenizer, split)
  path = fs.join(directory, MANIFEST)
  manifest = read_json(path)
  if manifest is None:
    raise NotPrepared(
      f"{split!r} of dataset {data_config.dataset!r} is not prepared "
      f"(no {path}); `ao-mdm prepare --config=...` prepares it"
    )
  if docs is None and datasets.available(data_config):
    docs = datasets.load_documents(data_config, split, data_config.tfds_dir)
  check_identity(manifest, make_plan(data_config, tokenizer, split, docs, 0), path)
  verify(directory, manifest, log)
  return PreparedSplit(directory, manifest)


def verify(directory: str, manifest: dict, log: Callable = print, rehash: bool = False) -> int:
  """Checks every shard's size, and its sha256 unless this version of it already matched the
  manifest's hash (`rehash`: every shard); returns the bytes hashed."""
  verified = read_json(fs.join(directory, VERIFIED)) or {}
  to_hash = []
  for index, shard in enumerate(manifest["shards"]):
    path = fs.join(directory, shard["file"])
    try:
      st = fs.stat(path)
    except FileNotFoundError:
      raise CorruptShard(
        f"prepared shard {path} is missing; `ao-mdm prepare` redoes it", index
      ) from None
    if st.size != shard["bytes"]:
      raise CorruptShard(
        f"prepared shard {path} is {st.size} bytes, its manifest says "
        f"{shard['bytes']} (truncated or altered); `ao-mdm prepare` redoes it",
        index,
      )
    if rehash or verified.get(shard["file"]) != [st.size, st.version, shard["sha256"]]:
      to_hash.append((index, path, st))
  if not to_hash:
    return 0
  n_bytes = sum(st.size for _, _, st in to_hash)
  if n_bytes > 1 << 30:
    log(f"verifying {len(to_hash)} prepared shards ({n_bytes / 1e9:.1f} GB) in {directory}")
  dtype = np.dtype(manifest["dtype"])
  with concurrent.futures.ThreadPoolExecutor(min(8, len(to_hash))) as pool:
    sums = pool.map(lambda job: sha256_and_counts(job[1], dtype, 0, False)[0], to_hash)
    for (index, path, st), got in zip(to_hash, sums):
      want = manifest["shards"][index]["sha256"]
      if got != want:
        raise CorruptShard(
          f"prepared shard {path} has sha256 {got[:16]}..., its manifest says "
          f"{want[:16]}... (corrupted); `ao-mdm prepare` redoes it",
          index,
        )
      verified[manifest["shards"][index]["file"]] = [st.size, st.version, want]
  try:
    fs.write_json(fs.join(directory, VERIFIED), verified)
  except OSError:  # a read-only copy: verified again next time
    pass
  return n_bytes


# The authors' evaluation packing.


def paper_blocks(
  tokens: np.ndarray, eos_id: int, block_size: int, num_proc: int = 8, batch_docs: int = 1000
) -> np.ndarray:
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
      pieces.append(tokens[lo : lo + k * block_size].reshape(k, block_size))
  if not pieces:
    return np.zeros((0, block_size), np.int32)
  return np.concatenate(pieces).astype(np.int32)
