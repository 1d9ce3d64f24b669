"""An exclusive lease on a path: one holder at a time (the training run of a work dir).

Locally an flock, which the kernel drops when its holder dies, so a killed run never leaves a
stale lock. On gs:// (no locks on objects) an object created only if absent (a generation
precondition, ifGenerationMatch=0) and renewed every lease_s / 4 by a thread, each renewal
conditional on the generation it last wrote. A lease not renewed for lease_s (its holder died
without releasing it), or held by a dead process of this very host, is taken over, with a line.
"""

from collections.abc import Callable
import json
import os
import socket
import threading
import time

from ao_mdm.runtime import hosts
from ao_mdm.storage import fs

LEASE_S = 120.0  # a gs:// lease not renewed for this long is stale


class LeaseHeld(FileExistsError):
  """Another live holder has the lease; the message says who."""


def describe(record: dict) -> str:
  since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("since", time.time())))
  return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, since {since}"


class Lease:
  """The lease on `path` for `holder`, a name for humans (raises LeaseHeld if another has it,
  naming its host and process); `release()` gives
  it up. `lost` turns true if another process took it over meanwhile (this one stalled past
  the lease, e.g. a host that froze), so the holder can stop rather than write beside it."""

  def __init__(
    self, path: str, holder: str, lease_s: float = LEASE_S, log: Callable[[str], None] = print
  ):
    self.path, self.lease_s, self.lost = path, lease_s, False
    self._record = {
      "holder": holder,
      "host": socket.gethostname(),
      "pid": os.getpid(),
      "since": time.time(),
      "lease_s": lease_s,
    }
    self._stop = threading.Event()
    self._file = self._thread = None
    self._version = 0
    if fs.is_gcs(path):
      self._take(log)
      self._thread = threading.Thread(target=self._renew, daemon=True)
      self._thread.start()
    else:
      self._file = fs.flock(path)
      if self._file is None:
        raise LeaseHeld(fs.read_text(path).strip() or "another process")
      self._file.seek(0)
      self._file.truncate()
      self._file.write(describe(self._record) + "\n")
      self._file.flush()

  def _data(self) -> bytes:
    return json.dumps({**self._record, "renewed": time.time()}).encode()

  def _take(self, log: Callable[[str], None]) -> None:
    for _ in range(5):
      try:
        self._version = fs.write_bytes(self.path, self._data(), if_version=0)
        return
      except fs.VersionMismatch:
        pass
      try:
        data, version = fs.read_versioned(self.path)
      except (FileNotFoundError, fs.VersionMismatch):
        continue  # released or renewed meanwhile: look again
      try:
        found = json.loads(data)
        age = time.time() - float(found["renewed"])
        lease = float(found.get("lease_s", self.lease_s))
      except (ValueError, KeyError, TypeError):
        found, age, lease = {}, float("inf"), self.lease_s
      gone = (
        found.get("host") == socket.gethostname()
        and isinstance(found.get("pid"), int)
        and not hosts.alive(found["pid"])
      )
      if age <= lease and not gone:
        raise LeaseHeld(describe(found))
      try:
        self._version = fs.write_bytes(self.path, self._data(), if_version=version)
      except fs.VersionMismatch:
        continue  # another process took it over first: look again
      why = (
        "its process is gone"
        if gone
        else f"not renewed for {age:.0f} s, lease {lease:.0f} s"
        if found
        else "unreadable"
      )
      log(f"took over the lock {self.path} of {describe(found) if found else 'a holder'} ({why})")
      return
    raise LeaseHeld("another process (the lock kept changing hands while this one looked)")

  def _renew(self) -> None:
    while not self._stop.wait(self.lease_s / 4):
      try:
        self._version = fs.write_bytes(self.path, self._data(), if_version=self._version)
      except fs.VersionMismatch:
        self.lost = True
        return
      except OSError:
        pass  # a transient failure: the next renewal, well within the lease, tries again

  def release(self) -> None:
    """Gives the lease up, removing the lock file; safe to call twice."""
    if self._file is not None:
      if not self._file.closed:
        fs.remove(self.path)  # while the flock is still held
        self._file.close()
      return
    if self._thread is not None and not self._stop.is_set():
      self._stop.set()
      self._thread.join()
      if not self.lost:
        try:
          fs.remove(self.path, if_version=self._version)
        except OSError:
          pass  # a lease left behind is taken over once stale
