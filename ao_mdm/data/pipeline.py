"""The grain input pipeline: tokenize, append EOS, pack into blocks, shuffle, shard, batch.

Batches are numpy int32 arrays of shape [global_batch_size // process_count, block_size].
The whole split is tokenized and packed in memory once per process: fine for the embedded
corpus and WikiText/PTB-sized data; OpenWebText-sized corpora would need a streaming packer
(e.g. an IterDataset over the ArrayRecord source) or pre-tokenized ArrayRecord blocks instead.
"""
from typing import Any

import grain
import jax
import numpy as np

from ao_mdm.data import datasets
from ao_mdm.data.tokenizer import Tokenizer

# Reading blocks from memory is cheap: a couple of threads, a short prefetch buffer.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


def _encode_all(tokenizer: Tokenizer, docs: Any) -> list[list[int]]:
  """Token ids of every document, batched when the tokenizer supports it."""
  docs = list(docs)
  if hasattr(tokenizer, "encode_batch"):
    return tokenizer.encode_batch(docs)
  return [tokenizer.encode(d) for d in docs]


def pack_documents(token_lists: list[list[int]], eos_id: int, block_size: int) -> np.ndarray:
  """Concatenates documents, each followed by EOS, into [N, block_size] int32; drops the rest."""
  if block_size <= 0:
    raise ValueError(f"block_size must be positive, got {block_size}")
  total = sum(len(t) + 1 for t in token_lists)
  stream = np.empty(total, dtype=np.int32)
  pos = 0
  for ids in token_lists:
    stream[pos:pos + len(ids)] = ids
    stream[pos + len(ids)] = eos_id
    pos += len(ids) + 1
  n_blocks = total // block_size
  return stream[:n_blocks * block_size].reshape(n_blocks, block_size)


def token_counts(data_config: Any, tokenizer: Tokenizer, *, tfds_dir: str,
                 split: str = "train") -> np.ndarray:
  """int64 [vocab] counts of every token of the split, one EOS per document counted."""
  counts = np.zeros(tokenizer.vocab_size, np.int64)
  for ids in _encode_all(tokenizer, datasets.load_documents(data_config, split, tfds_dir)):
    counts += np.bincount(ids, minlength=tokenizer.vocab_size)[:tokenizer.vocab_size]
    counts[tokenizer.eos_id] += 1
  return counts


def split_blocks(data_config: Any, tokenizer: Tokenizer, *, block_size: int, split: str,
                 tfds_dir: str) -> np.ndarray:
  """The split's documents, in order, packed into [N, block_size] blocks (N may be 0)."""
  docs = datasets.load_documents(data_config, split, tfds_dir)
  return pack_documents(_encode_all(tokenizer, docs), tokenizer.eos_id, block_size)


def pack_for_eval(token_lists: list, eos_id: int, block_size: int, source: str) -> np.ndarray:
  """pack_documents, with one clear error when `source` is too short for a single block."""
  blocks = pack_documents(token_lists, eos_id, block_size)
  if len(blocks) == 0:
    raise ValueError(f"{source} has {sum(len(t) + 1 for t in token_lists)} tokens (EOS "
                     f"included); at least block_size={block_size} are needed for one block")
  return blocks


def eval_blocks(data_config: Any, tokenizer: Tokenizer, *, block_size: int, split: str,
                tfds_dir: str, max_blocks: int | None = None) -> np.ndarray:
  """The whole split packed in document order as int32 [N, block_size], for evaluation."""
  docs = datasets.load_documents(data_config, split, tfds_dir)
  blocks = pack_for_eval(_encode_all(tokenizer, docs), tokenizer.eos_id, block_size,
                         f"split {split!r} of dataset {data_config.dataset!r}")
  if max_blocks is not None:
    if max_blocks <= 0:
      raise ValueError(f"max_blocks must be positive or None, got {max_blocks}")
    blocks = blocks[:max_blocks]
  return blocks


def train_iterator(data_config: Any, tokenizer: Tokenizer, *, block_size: int,
                   global_batch_size: int, seed: int, tfds_dir: str, split: str = "train",
                   process_index: int | None = None,
                   process_count: int | None = None) -> grain.DatasetIterator:
  """An endless, seeded, checkpointable iterator of this process's int32 [B/P, T] batches.

  Blocks are shuffled globally with `seed` (a new order every epoch); process p takes every
  P-th block of that order, so the shards are disjoint and together cover each epoch.
  The iterator has `get_state()`/`set_state()`; Orbax saves it with
  `grain.checkpoint.CheckpointSave(iterator)` and restores it with
  `grain.checkpoint.CheckpointRestore(iterator)`.
  """
  if process_index is None:
    process_index = jax.process_index()
  if process_count is None:
    process_count = jax.process_count()
  if process_count <= 0 or not 0 <= process_index < process_count:
    raise ValueError(
        f"process_index must be in [0, {process_count}) with process_count >= 1, "
        f"got process_index={process_index}, process_count={process_count}")
  if global_batch_size <= 0 or global_batch_size % process_count:
    raise ValueError(
        f"global_batch_size {global_batch_size} must be a positive multiple of the "
        f"process count {process_count}")
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed must be in [0, 2**32), got {seed}")
  blocks = split_blocks(data_config, tokenizer, block_size=block_size, split=split,
                        tfds_dir=tfds_dir)
  if len(blocks) < process_count:
    raise ValueError(
        f"split {split!r} of dataset {data_config.dataset!r} packs into {len(blocks)} blocks "
        f"of {block_size} tokens; each of the {process_count} processes needs at least one")
  ds = (grain.MapDataset.source(blocks)
        .shuffle(seed=seed)
        [process_index::process_count]
        .repeat()  # reseeds the shuffle every epoch
        .batch(global_batch_size // process_count, drop_remainder=True))
  return iter(ds.to_iter_dataset(read_options=_READ_OPTIONS))
