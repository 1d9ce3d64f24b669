"""Ctrl-C and SIGTERM: every command stops cleanly; training first saves at a step boundary.

`ao-mdm` calls `install()` first: from then on Ctrl-C and SIGTERM run the cleanups registered
with `on_interrupt` (an output's temporary file removed, finished samples kept), print one line
and exit at once (130 after Ctrl-C, 143 after SIGTERM), so no library is interrupted mid-work
(no traceback, no half-written file, and a restore can never take an interrupt for a corrupt
checkpoint). The training loop runs inside `StopRequest`, which saves first.
"""
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Optional

from ao_mdm.storage import fs

_CLEANUPS: list = []


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


def _exit_now(signum, frame) -> None:
  """Runs the cleanups with stderr silenced (threads of a library still at work, e.g. Orbax's
  writers losing their temp dir, would print tracebacks), then says what they report."""
  del frame
  with silenced_stderr() as stderr:
    said = []
    for cleanup in reversed(_CLEANUPS):
      try:
        said.append(cleanup())
      except Exception as e:  # pylint: disable=broad-except  (exit regardless)
        said.append(f"cleanup after the interrupt failed: {e}")
    sys.stdout.flush()
    how = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
    lines = [line for line in said if line] + [how]
    os.write(stderr, ("\n".join(lines) + "\n").encode())
    os._exit(128 + signum)  # pylint: disable=protected-access


def install() -> None:
  """Ctrl-C and SIGTERM run the registered cleanups and exit (a training loop's StopRequest
  takes both over while it runs, to save first)."""
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, _exit_now)


def remove_tree(path: str, settle_s: float = 0.2, limit_s: float = 5.0) -> None:
  """Removes a directory that threads of a library (Orbax's writers) may still be writing into:
  again until it stays gone for `settle_s` (or `limit_s` has passed)."""
  deadline = time.monotonic() + limit_s
  while fs.exists(path) and time.monotonic() < deadline:
    fs.rmtree(path)
    if not fs.exists(path):
      time.sleep(settle_s)


@contextlib.contextmanager
def on_interrupt(cleanup: Callable[[], Optional[str]]) -> Iterator[None]:
  """Runs `cleanup` if Ctrl-C ends the process inside this block; a line it returns is printed
  (on stderr, before "interrupted")."""
  _CLEANUPS.append(cleanup)
  try:
    yield
  finally:
    _CLEANUPS.remove(cleanup)


@contextlib.contextmanager
def output_dir(out: str) -> Iterator[str]:
  """Where to write the directory `out` so that nothing unfinished is ever read under its name:
  locally a temporary directory beside it (those of dead processes removed first), renamed to
  `out` at the end; on gs:// `out` itself (its writer puts its completion mark last). An error
  or an interrupt inside removes what was written."""
  out = fs.absolute(out)
  tmp = out if fs.is_gcs(out) else fs.tmp_name(out)
  fs.remove_dead_tmps(fs.parent(out))
  remove = lambda: remove_tree(tmp)
  with on_interrupt(remove):
    try:
      yield tmp
      if tmp != out:
        fs.move(tmp, out)
    except BaseException:
      remove()
      raise


class StopRequest:
  """While alive, SIGTERM and a first Ctrl-C set `requested` (the loop saves at the next step
  boundary and exits: `exit_code` 0 after SIGTERM, as a preemption, 130 after Ctrl-C); a Ctrl-C
  after a request exits at once, leaving the last complete checkpoint."""

  def __init__(self):
    self.requested, self.exit_code = False, 0
    self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

  def _handle(self, signum, frame) -> None:
    del frame
    if signum == signal.SIGINT:
      if self.requested:
        print("interrupted again: exiting now; the last complete checkpoint stays",
              file=sys.stderr, flush=True)
        os._exit(130)  # pylint: disable=protected-access
      self.exit_code = 130
      print("interrupted: saving a checkpoint at the next step boundary (Ctrl-C again to exit "
            "at once)", file=sys.stderr, flush=True)
    self.requested = True

  def restore(self) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
