"""Keeping what C++ libraries write to the terminal out of a command's output."""
import contextlib
import os
import sys
from collections.abc import Iterator

_REAL_STDERR: list = []  # the real stderr's descriptor while stderr is silenced (nested: the outer)


@contextlib.contextmanager
def silenced_stderr() -> Iterator[int]:
  """File descriptor 2 goes to /dev/null inside (C++ libraries write there directly, past
  sys.stderr); yields a descriptor of the real stderr (the same one when nested)."""
  sys.stderr.flush()
  saved = os.dup(2)
  quiet = os.open(os.devnull, os.O_WRONLY)
  os.dup2(quiet, 2)
  os.close(quiet)
  _REAL_STDERR.append(_REAL_STDERR[0] if _REAL_STDERR else saved)
  try:
    yield _REAL_STDERR[-1]
  finally:
    _REAL_STDERR.pop()
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
