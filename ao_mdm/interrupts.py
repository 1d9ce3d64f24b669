"""Ctrl-C and SIGTERM: every command stops cleanly; training first saves at a step boundary.

`ao-mdm` calls `install()` first: from then on Ctrl-C raises KeyboardInterrupt (the CLI exits
130 with no traceback) and is counted, so that code which caught a library's exception can ask
`interrupted()` whether it was an interrupt surfacing in another form (a restore must never
take one for a corrupt checkpoint). The training loop runs inside `StopRequest`.
"""
import os
import signal
import sys

_COUNT = [0]  # Ctrl-Cs seen by this process


def _raise(signum, frame) -> None:
  del signum, frame
  _COUNT[0] += 1
  raise KeyboardInterrupt


def install() -> None:
  signal.signal(signal.SIGINT, _raise)


def interrupted() -> bool:
  return _COUNT[0] > 0


class StopRequest:
  """While alive, SIGTERM and a first Ctrl-C set `requested` (the loop saves at the next step
  boundary and exits: `exit_code` 0 after SIGTERM, as a preemption, 130 after Ctrl-C); a Ctrl-C
  after a request exits at once, leaving the last complete checkpoint."""

  def __init__(self):
    self.requested, self.exit_code = False, 0
    if interrupted():  # a Ctrl-C during start-up that a library swallowed
      raise KeyboardInterrupt
    self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

  def _handle(self, signum, frame) -> None:
    del frame
    if signum == signal.SIGINT:
      _COUNT[0] += 1
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
