"""This process's memory: the C heap's freed pages handed back to the system. XLA's compiles
allocate and free a lot; glibc keeps what was freed resident unless asked."""

import ctypes
import ctypes.util


def trim_heap() -> bool:
  """glibc's malloc_trim(0): what the C heap holds free goes back to the system (a server calls
  it once its programs are compiled). False where the C library has no such call."""
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.malloc_trim(0))
  except (OSError, AttributeError):
    return False
