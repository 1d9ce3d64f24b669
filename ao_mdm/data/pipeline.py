"""The grain input pipeline over prepared data (data/prepared.py): blocks, a global
seeded shuffle, disjoint per-process shards and batches; and evaluation blocks.

Batches are numpy int32 arrays of shape [global_batch_size // process_count, block_size]. The
blocks are read from the prepared token shards on demand, so memory and start-up time do not
grow with the corpus.
"""

from collections.abc import Sequence
import sys
from typing import Protocol

import grain
import jax
import numpy as np

from ao_mdm.data import prepared

# One background thread reading a batch ahead keeps up (about 30M tokens/s, docs/performance.md).
READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)
PACKINGS = ("stream", "paper")


def pack_documents(token_lists: list[list[int]], eos_id: int, block_size: int) -> np.ndarray:
  """Concatenates documents, each followed by EOS, into [N, block_size] int32; drops the rest."""
  if block_size <= 0:
    raise ValueError(f"block_size must be positive, got {block_size}")
  total = sum(len(t) + 1 for t in token_lists)
  stream = np.empty(total, dtype=np.int32)
  pos = 0
  for ids in token_lists:
    stream[pos : pos + len(ids)] = ids
    stream[pos + len(ids)] = eos_id
    pos += len(ids) + 1
  n_blocks = total // block_size
  return stream[: n_blocks * block_size].reshape(n_blocks, block_size)


def _check_some(blocks: np.ndarray, tokens: int, block_size: int, source: str) -> np.ndarray:
  if len(blocks) == 0:
    raise ValueError(
      f"{source} has {tokens} tokens (EOS included); at least "
      f"block_size={block_size} are needed for one block"
    )
  return blocks


def pack_for_eval(token_lists: list, eos_id: int, block_size: int, source: str) -> np.ndarray:
  """pack_documents of a small local file (eval --text_file), refused if it fills no block."""
  return _check_some(
    pack_documents(token_lists, eos_id, block_size),
    sum(len(t) + 1 for t in token_lists),
    block_size,
    source,
  )


def eval_blocks(
  split: prepared.PreparedSplit,
  block_size: int,
  *,
  max_blocks: int | None = None,
  packing: str = "stream",
) -> np.ndarray:
  """int32 [N, block_size] blocks of a prepared split, in document order.

  `stream`: the split's consecutive blocks (the first `max_blocks`); `paper`: every block as the
  authors' data.py packs an evaluation split (prepared.paper_blocks).
  """
  if packing not in PACKINGS:
    raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
  if max_blocks is not None and max_blocks <= 0:
    raise ValueError(f"max_blocks must be positive or None, got {max_blocks}")
  if packing == "paper":
    blocks = prepared.paper_blocks(split.read(0, split.tokens), split.eos_id, block_size)
    blocks = blocks[:max_blocks]
  else:
    blocks = split.blocks(block_size).array(max_blocks)
  return _check_some(blocks, split.tokens, block_size, split.name)


class RowSource(Protocol):
  """What batches are drawn from: prepared.Blocks, pairs.Rows (fine-tuning pairs) or
  sudoku.Grids (generated grids)."""

  block_size: int

  @property
  def name(self) -> str: ...

  def __len__(self) -> int: ...

  def rows(self, indices: Sequence[int]) -> np.ndarray: ...


class ShuffledBatches(grain.MapDataset):
  """Endless batches of one process's blocks: epoch e orders all N blocks by a permutation
  seeded with seed + e (grain's index shuffle: no memory per block); process p of P takes
  positions p, p + P, ... of it (N // P each, so every process's epochs align); batch i holds
  its next B. One grain element per batch keeps grain's per-element cost off each block.
  """

  def __init__(
    self,
    blocks: "RowSource",
    batch_size: int,
    seed: int,
    process_index: int,
    process_count: int,
  ):
    super().__init__()
    self._blocks, self._b, self._seed = blocks, batch_size, seed
    self._p, self._count = process_index, process_count
    self._per_epoch = len(blocks) // process_count

  def __len__(self) -> int:
    return sys.maxsize

  def __getitem__(self, index: int) -> np.ndarray:
    epoch, position = np.divmod(index * self._b + np.arange(self._b), self._per_epoch)
    shuffle = grain.experimental.index_shuffle
    rows = [
      shuffle(
        int(q) * self._count + self._p,
        max_index=len(self._blocks) - 1,
        seed=(self._seed + int(e)) % 2**32,
        rounds=4,
      )
      for q, e in zip(position, epoch)
    ]
    return self._blocks.rows(rows)


def train_iterator(
  blocks: "RowSource",
  *,
  global_batch_size: int,
  seed: int,
  process_index: int | None = None,
  process_count: int | None = None,
) -> grain.DatasetIterator:
  """An endless, seeded, checkpointable iterator of this process's int32 [b, T] batches
  (b = global_batch_size / process_count).

  Blocks are shuffled globally with `seed`, a new order every epoch; the processes' shards are
  disjoint and together cover each epoch but for fewer than P blocks (ShuffledBatches). The
  iterator has `get_state()`/`set_state()`; Orbax saves it with
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
      f"got process_index={process_index}, process_count={process_count}"
    )
  if global_batch_size <= 0 or global_batch_size % process_count:
    raise ValueError(
      f"global_batch_size {global_batch_size} must be a positive multiple of the "
      f"process count {process_count}"
    )
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed must be in [0, 2**32), got {seed}")
  if len(blocks) < process_count:
    raise ValueError(
      f"{blocks.name} packs into {len(blocks)} blocks of {blocks.block_size} tokens; "
      f"each of the {process_count} processes needs at least one"
    )
  ds = ShuffledBatches(
    blocks, global_batch_size // process_count, seed, process_index, process_count
  )
  return iter(ds.to_iter_dataset(read_options=READ_OPTIONS))
