"""runtime.memory.trim_heap hands the C heap's free pages back (what a server does once its
programs are compiled)."""

import psutil

from ao_mdm.runtime import memory


def test_trim_heap_returns_freed_holes_to_the_system():
  proc = psutil.Process()
  rss = lambda: proc.memory_info().rss / 2**20
  blocks = [bytearray(64 * 1024) for _ in range(4000)]  # 250 MiB, below malloc's mmap threshold
  del blocks[::2]  # 125 MiB of 64 KiB holes between live blocks: the heap cannot shrink alone
  held = rss()
  assert memory.trim_heap()
  assert held - rss() > 60, (held, rss())
  assert len(blocks) == 2000
