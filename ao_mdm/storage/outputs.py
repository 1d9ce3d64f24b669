"""Output directories written so that nothing unfinished is ever read under their name, and
removed again after an error or an interrupt."""

from collections.abc import Iterator
import contextlib
import time

from ao_mdm.runtime import interrupts
from ao_mdm.storage import fs


def remove_tree(path: str, settle_s: float = 0.2, limit_s: float = 5.0) -> None:
  """Removes a directory that threads of a library (Orbax's writers) may still be writing into:
  again until it stays gone for `settle_s` (or `limit_s` has passed)."""
  deadline = time.monotonic() + limit_s
  while fs.exists(path) and time.monotonic() < deadline:
    fs.rmtree(path)
    if not fs.exists(path):
      time.sleep(settle_s)


@contextlib.contextmanager
def output_dir(out: str) -> Iterator[str]:
  """Where to write the directory `out` so that nothing unfinished is ever read under its name:
  locally a temporary directory beside it (those of dead processes removed first), renamed to
  `out` at the end; on gs:// `out` itself (its writer puts its completion mark last). An error
  or an interrupt inside removes what was written (not in a bucket that stopped answering, which
  takes no removal either: what is left there has no completion mark)."""
  out = fs.absolute(out)
  tmp = out if fs.is_gcs(out) else fs.tmp_name(out)
  fs.remove_dead_tmps(fs.parent(out))
  remove = lambda: remove_tree(tmp)
  with interrupts.on_interrupt(remove):
    try:
      yield tmp
      if tmp != out:
        fs.move(tmp, out)
    except BaseException as e:
      if not (isinstance(e, TimeoutError) and fs.is_gcs(tmp)):
        remove()
      raise
