"""Ctrl-C and SIGTERM: every command stops cleanly; training first saves at a step boundary.

`ao-mdm` calls `install()` first: from then on Ctrl-C and SIGTERM run the cleanups registered
with `on_interrupt` (an output's temporary file removed, finished samples kept), print one line
and exit at once (130 after Ctrl-C, 143 after SIGTERM), so no library is interrupted mid-work
(no traceback, no half-written file, and a restore can never take an interrupt for a corrupt
checkpoint). The training loop runs inside `StopRequest`, which saves first.
"""

from collections.abc import Callable, Iterator
import contextlib
import os
import signal
import sys

from ao_mdm.runtime import quiet

_CLEANUPS: list = []


def _exit_now(signum, frame) -> None:
  """Runs the cleanups with stderr silenced (threads of a library still at work, e.g. Orbax's
  writers losing their temp dir, would print tracebacks), then says what they report."""
  del frame
  with quiet.silenced_stderr() as stderr:
    said = []
    for cleanup in reversed(_CLEANUPS):
      try:
        said.append(cleanup())
      except Exception as e:  # exit regardless
        said.append(f"cleanup after the interrupt failed: {e}")
    sys.stdout.flush()
    how = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
    lines = [line for line in said if line] + [how]
    os.write(stderr, ("\n".join(lines) + "\n").encode())
    os._exit(128 + signum)


_HELD: list = []  # SIGTERMs that came before training's StopRequest, which takes them over


def _hold(signum, frame) -> None:
  del frame
  _HELD.append(signum)


def install(hold: bool = False) -> None:
  """Ctrl-C and SIGTERM run the registered cleanups and exit. With `hold` (training) a SIGTERM
  is held for the training loop's StopRequest instead, so that a preemption notice during
  start-up (joining, preparing, restoring, compiling) stops the run at its first step boundary,
  saved and agreed by every process; Ctrl-C until that StopRequest exists still exits at once."""
  signal.signal(signal.SIGINT, _exit_now)
  signal.signal(signal.SIGTERM, _hold if hold else _exit_now)


@contextlib.contextmanager
def on_interrupt(cleanup: Callable[[], str | None]) -> Iterator[None]:
  """Runs `cleanup` if Ctrl-C ends the process inside this block; a line it returns is printed
  (on stderr, before "interrupted")."""
  _CLEANUPS.append(cleanup)
  try:
    yield
  finally:
    _CLEANUPS.remove(cleanup)


STOP_TERM, STOP_INT = 1, 2  # StopRequest.code after SIGTERM (a preemption) and after Ctrl-C


class StopRequest:
  """While alive, SIGTERM and a first Ctrl-C set `requested` (the loop saves at the next step
  boundary and exits: `exit_code` 0 after SIGTERM, as a preemption, 130 after Ctrl-C); a Ctrl-C
  after a request exits at once, leaving the last complete checkpoint. `code` (0, STOP_TERM,
  STOP_INT) is what processes of one run agree on (train/cluster.py)."""

  def __init__(self):
    self.requested, self.exit_code = False, 0
    self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
    self.requested = bool(_HELD)
    _HELD.clear()

  @property
  def code(self) -> int:
    if not self.requested:
      return 0
    return STOP_INT if self.exit_code == 130 else STOP_TERM

  def _handle(self, signum, frame) -> None:
    del frame
    if signum == signal.SIGINT:
      if self.requested:
        quiet.say("interrupted again: exiting now; the last complete checkpoint stays")
        os._exit(130)
      self.exit_code = 130
      quiet.say(
        "interrupted: saving a checkpoint at the next step boundary (Ctrl-C again to exit at once)"
      )
    self.requested = True

  def restore(self) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
