"""Keeping what C++ libraries write to the terminal out of a command's output: file descriptor 2
sent to /dev/null for a while, or for the rest of a process, while our own lines still reach
the terminal; the environment that keeps their start-up quiet."""

from collections.abc import Iterator
import contextlib
import glob
import os
import sys

_TERMINAL: list = []  # descriptors of the terminal's stderr while fd 2 goes elsewhere (nested)
_SILENCED_FOR_GOOD: list = []


def terminal_fd() -> int:
  """A descriptor that reaches the terminal's stderr, whatever fd 2 is now."""
  return _TERMINAL[0] if _TERMINAL else 2


def say(line: str) -> None:
  """One line on the terminal's stderr as one raw write (safe in a signal handler, where a
  print could collide with the write it interrupted)."""
  os.write(terminal_fd(), (line + "\n").encode())


def _devnull_on(fd: int) -> None:
  (sys.stdout if fd == 1 else sys.stderr).flush()
  quiet = os.open(os.devnull, os.O_WRONLY)
  os.dup2(quiet, fd)
  os.close(quiet)


@contextlib.contextmanager
def silenced_stderr() -> Iterator[int]:
  """File descriptor 2 goes to /dev/null inside (C++ libraries write there directly, past
  sys.stderr); yields a descriptor of the terminal's stderr."""
  sys.stderr.flush()
  saved = os.dup(2)
  _TERMINAL.append(_TERMINAL[0] if _TERMINAL else saved)
  _devnull_on(2)
  try:
    yield _TERMINAL[-1]
  finally:
    _TERMINAL.pop()
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def silence_for_good() -> None:
  """For the rest of the process, file descriptors 1 and 2 go to /dev/null while Python's
  sys.stdout and sys.stderr (our lines, warnings, tracebacks) keep the terminal: what a
  distributed runtime writes as it connects and as it fails is dropped (a multi-process
  training run)."""
  if _SILENCED_FOR_GOOD:
    return
  _SILENCED_FOR_GOOD.append(True)
  sys.stdout.flush()
  sys.stdout = os.fdopen(os.dup(1), "w", buffering=1)
  sys.stderr.flush()
  _TERMINAL.insert(0, os.dup(2))
  sys.stderr = os.fdopen(os.dup(_TERMINAL[0]), "w", buffering=1)
  _devnull_on(1)
  _devnull_on(2)


ACCELERATORS = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")  # TPU, TPU, NVIDIA GPU


def environment() -> None:
  """Before JAX loads: no TensorFlow start-up lines, and no TPU start-up on a host without one.

  With libtpu installed (the [tpu] extra) JAX probes for a TPU and prints errors where there is
  none. A host with a TPU (/dev/accel*, /dev/vfio/N) or an NVIDIA GPU keeps JAX's own choice;
  `compile` targets TPU topologies through the CPU platform either way.
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  if not any(glob.glob(p) for p in ACCELERATORS):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
