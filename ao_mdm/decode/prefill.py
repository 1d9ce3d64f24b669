"""How a Batcher's new rows get their prompts' cache: prefill forwards of a few static widths,
and the prompt caches it keeps (`prefixes`), from which a request whose prompt shares a prefix
with a recent one copies those slots rather than computing them."""

import collections

import jax.numpy as jnp
import numpy as np

from ao_mdm.decode import engine

MIN_PREFILL = 8  # the narrowest prefill forward; wider ones double up to T


def widths(t: int) -> list[int]:
  """The widths a prefill forward is compiled for: powers of two from MIN_PREFILL, and T. A
  prompt pays at most twice its length (32 tokens of T = 1024 paid 128 in steps of T / 8)."""
  out = [MIN_PREFILL]
  while out[-1] < t:
    out.append(min(2 * out[-1], t))
  return out


def width(n: int, t: int) -> int:
  """The narrowest prefill width that holds n slots."""
  return min(w for w in widths(t) if w >= n)


PREFIX_MIN = 8  # shorter shared prefixes are recomputed: a second prefill forward costs more


def prompt_ids(positions: tuple, token_ids: tuple) -> tuple:
  """The known tokens at positions 0, 1, 2, ... (the first order slots, left to right)."""
  known = dict(zip(positions, token_ids))
  n = 0
  while n in known:
    n += 1
  return tuple(known[i] for i in range(n))


class PrefixStore:
  """Prompts -> their row's cache (a KVCache of one row), at most `size`, the least recently
  used dropped first."""

  def __init__(self, size: int):
    self.size = size
    self._caches: collections.OrderedDict[tuple, engine.KVCache] = collections.OrderedDict()

  def longest(self, ids: tuple) -> tuple[int, engine.KVCache | None]:
    """(slots to copy, the stored cache to copy them from) for the longest prefix that `ids`
    shares with a stored prompt, or (0, None). Slot s reads tokens 0..s-1 and predicts
    position s, so with n tokens in common, slots 0..n can be copied."""
    best: tuple[int, engine.KVCache | None, tuple] = (0, None, ())
    for key, kv in self._caches.items():
      n = min(len(key), len(ids))
      same = np.asarray(key[:n]) == np.asarray(ids[:n])
      m = min((n if same.all() else int(same.argmin())) + 1, len(key), len(ids))
      if m > best[0]:
        best = (m, kv, key)
    if best[0] < PREFIX_MIN:
      return 0, None
    self._caches.move_to_end(best[2])
    return best[0], best[1]

  def remember(self, ids: tuple, cache: engine.KVCache, row: int) -> None:
    """Keeps row `row` of `cache` as the prompt's, unless it is short or already kept."""
    if not self.size or len(ids) < PREFIX_MIN or ids in self._caches:
      return
    self._caches[ids] = cache.take(jnp.asarray([row]))
    while len(self._caches) > self.size:
      self._caches.popitem(last=False)

  def clear(self) -> None:
    self._caches.clear()
