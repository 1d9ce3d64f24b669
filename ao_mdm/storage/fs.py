"""File operations on a local path or a gs://BUCKET/... URL: what every other module uses for a
path a user gave.

An object store has no directories (a directory is a prefix), no rename (a move is a copy, then
a delete) and no append (an append composes the object with the new bytes). Writes are atomic
either way: a temporary file and a rename locally, one object write (or one finished upload) on
gs://. Many byte ranges are read at once through tensorstore on gs:// (the data path), with
os.preadv locally. Orbax and tensorstore write arrays to gs:// themselves.
"""

from collections.abc import Iterator, Sequence
import contextlib
import io
import json
import os
import re
import socket
import threading
import time
from typing import IO, NamedTuple
import uuid

from ao_mdm.runtime import hosts
from ao_mdm.storage import gcs
from ao_mdm.storage.gcs import VersionMismatch  # callers catch it

GCS = gcs.GCS


class Stat(NamedTuple):
  size: int
  version: int  # mtime in ns locally, the object's generation on gs://: changes with every write


def is_gcs(path: str) -> bool:
  return str(path).startswith(GCS)


def join(path: str, *parts: str) -> str:
  if is_gcs(path):
    return "/".join([path.rstrip("/"), *(p.strip("/") for p in parts)])
  return os.path.join(path, *parts)


def parent(path: str) -> str:
  if is_gcs(path):
    head = path.rstrip("/").rsplit("/", 1)[0]
    return head if len(head) > len(GCS) else path
  return os.path.dirname(os.path.abspath(path))


def basename(path: str) -> str:
  return path.rstrip("/").rsplit("/", 1)[-1] if is_gcs(path) else os.path.basename(path)


def absolute(path: str) -> str:
  """The path as it names the same place from any directory (what a record should hold)."""
  return path if is_gcs(path) else os.path.abspath(path)


def is_bucket(path: str) -> bool:
  return is_gcs(path) and not gcs.split(path)[1]


# Queries.


def exists(path: str) -> bool:
  if not is_gcs(path):
    return os.path.exists(path)
  return isfile(path) or isdir(path)


def isfile(path: str) -> bool:
  if not is_gcs(path):
    return os.path.isfile(path)
  if is_bucket(path):
    return False
  with gcs.errors(path):
    return gcs.blob(path).exists(timeout=gcs.wait_s(), retry=gcs.retry())


def isdir(path: str) -> bool:
  """A directory, or on gs:// a prefix that holds objects (a bucket root always is one)."""
  if not is_gcs(path):
    return os.path.isdir(path)
  if is_bucket(path):
    gcs.check_bucket(path)
    return True
  blobs, prefixes = gcs.listing(path, recursive=False, limit=1)
  return bool(blobs or prefixes)


def listdir(path: str) -> list[str]:
  """Names of the entries right under a directory, sorted; FileNotFoundError if there is none."""
  if not is_gcs(path):
    return sorted(os.listdir(path))
  blobs, prefixes = gcs.listing(path, recursive=False)
  names = {b.name.rsplit("/", 1)[-1] for b in blobs}
  names |= {p.rstrip("/").rsplit("/", 1)[-1] for p in prefixes}
  names.discard("")
  if not names and not is_bucket(path):
    raise FileNotFoundError(f"{path}: no such directory")
  return sorted(names)


def files(path: str) -> list[str]:
  """Every file under a directory, as paths relative to it, sorted."""
  if not is_gcs(path):
    return sorted(
      os.path.relpath(os.path.join(d, f), path) for d, _, names in os.walk(path) for f in names
    )
  blobs, _ = gcs.listing(path, recursive=True)
  start = len(gcs.split(path)[1]) + 1 if not is_bucket(path) else 0
  return sorted(b.name[start:] for b in blobs)


def stat(path: str) -> Stat:
  if not is_gcs(path):
    st = os.stat(path)
    return Stat(st.st_size, st.st_mtime_ns)
  blob = gcs.blob(path)
  with gcs.errors(path):
    blob.reload(timeout=gcs.wait_s(), retry=gcs.retry())
  return Stat(int(blob.size), int(blob.generation))


# Reads.


def read_bytes(path: str) -> bytes:
  if not is_gcs(path):
    with open(path, "rb") as f:
      return f.read()
  with gcs.errors(path):
    return gcs.blob(path).download_as_bytes(timeout=gcs.wait_s(), retry=gcs.retry())


def read_versioned(path: str) -> tuple[bytes, int]:
  """(content, version) of one and the same version of a file."""
  if not is_gcs(path):
    version = stat(path).version
    return read_bytes(path), version
  blob = gcs.blob(path)
  with gcs.errors(path):
    blob.reload(timeout=gcs.wait_s(), retry=gcs.retry())
    data = blob.download_as_bytes(if_generation_match=blob.generation, timeout=gcs.wait_s())
  return data, int(blob.generation)


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def read_json(path: str):
  return json.loads(read_bytes(path))


def read_npy(path: str):
  """A .npy array (never a pickled object)."""
  import numpy as np

  return np.load(io.BytesIO(read_bytes(path)), allow_pickle=False)


@contextlib.contextmanager
def open_read(path: str) -> Iterator[IO[bytes]]:
  """A binary file read as a stream."""
  if not is_gcs(path):
    with open(path, "rb") as f:
      yield f
    return
  with gcs.errors(path), gcs.blob(path).open("rb", timeout=gcs.wait_s(), retry=gcs.retry()) as f:
    yield f


@contextlib.contextmanager
def open_text(path: str) -> Iterator[IO[str]]:
  """A text file read as a stream (a large corpus is never held in memory)."""
  if not is_gcs(path):
    with open(path, encoding="utf-8") as f:
      yield f
    return
  with (
    gcs.errors(path),
    gcs.blob(path).open("rt", encoding="utf-8", timeout=gcs.wait_s(), retry=gcs.retry()) as f,
  ):
    yield f


class EndedEarly(EOFError):
  """A file shorter than a read of it expected; `filename` names it."""

  def __init__(self, path: str):
    super().__init__(f"{path} ended early (truncated while in use?)")
    self.filename = path


class RangeReader:
  """Byte ranges of files, many at a time: os.preadv locally (descriptors kept open per
  process), tensorstore's asynchronous reads on gs:// (all ranges of a call in flight at once)."""

  def __init__(self) -> None:
    self._fds: dict = {}
    self._stores: dict = {}
    self._lock = threading.Lock()

  def __getstate__(self):  # descriptors and stores stay with their process
    return {}

  def __setstate__(self, state):
    del state
    self.__init__()

  def _fd(self, path: str) -> int:
    key = (os.getpid(), path)
    if key not in self._fds:
      with self._lock:
        if key not in self._fds:
          self._fds[key] = os.open(path, os.O_RDONLY)
    return self._fds[key]

  def _store(self, bucket: str):
    key = (os.getpid(), bucket)
    if key not in self._stores:
      gcs.configure()
      import tensorstore as ts

      with self._lock:
        if key not in self._stores:
          self._stores[key] = ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result()
    return self._stores[key]

  def read(self, requests: Sequence[tuple[str, int, int]], out: Sequence[memoryview]) -> None:
    """Fills out[i] with bytes [start, stop) of file i; EndedEarly (its `filename` the file) if a
    file ends early."""
    pending = []
    for (path, start, stop), view in zip(requests, out):
      if not path.startswith(GCS):
        if os.preadv(self._fd(path), [view], start) != stop - start:
          raise EndedEarly(path)
        continue
      bucket, key = gcs.split(path)
      future = self._store(bucket).read(key, byte_range=slice(start, stop))
      pending.append((path, stop - start, view, future))
    begun = time.monotonic()
    deadline = begun + gcs.wait_s()  # for all the reads together
    for path, size, view, future in pending:
      try:
        result = future.result(timeout=max(deadline - time.monotonic(), 0.01))
      except TimeoutError:
        gcs.unanswered(begun)
        raise gcs.no_answer(path) from None
      except ValueError as e:  # tensorstore's OUT_OF_RANGE
        if "OUT_OF_RANGE" in str(e):
          raise EndedEarly(path) from None
        raise OSError(f"{path}: {str(e).splitlines()[0]}") from None
      if result.state == "missing":
        raise FileNotFoundError(f"{path}: no such object")
      if len(result.value) != size:
        raise EndedEarly(path)
      view[:] = result.value


# Writes: atomic, never a half-written file under the final name.


def makedirs(path: str) -> None:
  """Creates a local directory and its parents (on gs:// there is nothing to create)."""
  if not is_gcs(path):
    os.makedirs(path, exist_ok=True)


_TMP = re.compile(r"\.tmp-(.+)-(\d+)\.[0-9a-f]{8}$")  # tmp_name's: (host, pid)


def tmp_name(path: str) -> str:
  """A temporary name beside `path` that says which host and process write it."""
  return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}.{uuid.uuid4().hex[:8]}"


def write_bytes(path: str, data: bytes, if_version: int | None = None) -> int:
  """Writes the whole file at once and returns its new version. if_version=0: only if there is
  none yet; another number (gs:// only): only over that version; else VersionMismatch."""
  if is_gcs(path):
    blob = gcs.blob(path)
    with gcs.errors(path):
      blob.upload_from_string(
        data,
        if_generation_match=if_version,
        timeout=gcs.wait_s(),
        retry=gcs.retry() if if_version is None else None,
      )
    return int(blob.generation)
  makedirs(parent(path))
  if if_version == 0:
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
      raise VersionMismatch(f"{path} exists") from None
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    return stat(path).version
  if if_version is not None:
    raise ValueError("a conditional overwrite needs a gs:// path")
  with open_write(path) as f:
    f.write(data)
  return stat(path).version


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def write_json(path: str, obj) -> None:
  write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def write_npy(path: str, array) -> None:
  import numpy as np

  buffer = io.BytesIO()
  np.save(buffer, array, allow_pickle=False)
  write_bytes(path, buffer.getvalue())


@contextlib.contextmanager
def open_write(path: str) -> Iterator[IO[bytes]]:
  """A binary file written as a stream that appears under its name only once complete: a
  temporary file renamed at the end locally, a resumable upload finished at the end on gs://.
  An error or a kill inside leaves nothing under `path`."""
  if is_gcs(path):  # an error inside cancels the upload
    with (
      gcs.errors(path),
      gcs.blob(path).open(
        "wb", chunk_size=16 << 20, ignore_flush=True, timeout=gcs.wait_s(), retry=gcs.retry()
      ) as writer,
    ):
      yield writer
    return
  makedirs(parent(path))
  tmp = tmp_name(path)
  try:
    with open(tmp, "wb") as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.lexists(tmp):
      os.remove(tmp)


def append(path: str, data: bytes) -> None:
  """Adds bytes at the end of a file (creating it). On gs:// the bytes are one small object
  composed onto the end of the file: a process killed during it loses only these bytes."""
  if not is_gcs(path):
    makedirs(parent(path))
    with open(path, "ab") as f:
      f.write(data)
    return
  if not isfile(path):
    write_bytes(path, data)
    return
  part = gcs.blob(f"{path}.append-{uuid.uuid4().hex[:12]}")
  with gcs.errors(path):
    part.upload_from_string(data, timeout=gcs.wait_s(), retry=gcs.retry())
    try:
      gcs.blob(path).compose([gcs.blob(path), part], timeout=gcs.wait_s(), retry=gcs.retry())
    finally:
      part.delete(timeout=gcs.wait_s(), retry=gcs.retry())


def remove(path: str, if_version: int | None = None) -> None:
  """Removes a file if it is there (on gs://, with if_version, only that version of it)."""
  if not is_gcs(path):
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)
    return
  from google.api_core import exceptions

  with gcs.errors(path), contextlib.suppress(exceptions.NotFound):
    gcs.blob(path).delete(if_generation_match=if_version, timeout=gcs.wait_s(), retry=gcs.retry())


def rmtree(path: str) -> None:
  """Removes a directory and everything under it, if it is there."""
  if not is_gcs(path):
    import shutil

    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      remove(path)
    return
  from google.api_core import exceptions

  blobs, _ = gcs.listing(path, recursive=True)
  with gcs.errors(path):
    for blob in blobs:
      with contextlib.suppress(exceptions.NotFound):
        blob.delete(timeout=gcs.wait_s(), retry=gcs.retry())


def copy(src: str, dst: str) -> None:
  """Copies one file between any two places (local, gs://, or one of each)."""
  if is_gcs(src) and is_gcs(dst):  # server-side
    source, (bucket, key) = gcs.blob(src), gcs.split(dst)
    with gcs.errors(src):
      source.bucket.copy_blob(
        source, gcs.client().bucket(bucket), key, timeout=gcs.wait_s(), retry=gcs.retry()
      )
    return
  write_bytes(dst, read_bytes(src))


def copytree(src: str, dst: str) -> None:
  for name in files(src):
    copy(join(src, name), join(dst, name))


def move(src: str, dst: str) -> None:
  """Moves a file or directory: a rename locally; on gs:// a copy of every object, then the
  deletion of the source (a kill in between leaves both, never neither)."""
  if not is_gcs(src) and not is_gcs(dst):
    makedirs(parent(dst))
    os.replace(src, dst)
    return
  if isfile(src):
    copy(src, dst)
    remove(src)
  else:
    copytree(src, dst)
    rmtree(src)


def remove_dead_tmps(directory: str) -> None:
  """Removes the temporary files and directories (tmp_name's) in a local directory of processes
  of this host that are gone: writes killed by a signal no cleanup could catch. (On gs:// an
  unfinished write leaves nothing to remove.)"""
  if is_gcs(directory) or not os.path.isdir(directory):
    return
  host = socket.gethostname()
  for entry in os.listdir(directory):
    match = _TMP.search(entry)
    if match and match[1] == host and not hosts.alive(int(match[2])):
      rmtree(os.path.join(directory, entry))


def local_dirs(root: str) -> set:
  """The directories under a local root (itself included), for remove_new_empty_dirs."""
  return {d for d, _, _ in os.walk(root)} if os.path.isdir(root) else set()


def remove_new_empty_dirs(root: str, existed: set) -> None:
  """Removes the empty directories under a local root that are not in `existed` (what a failed
  write made), deepest first."""
  for d, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
    if d not in existed and not os.listdir(d):
      os.rmdir(d)


def flock(path: str):
  """An open local file holding an exclusive flock, or None if another process holds it (the
  kernel drops it when its holder dies); on a file system without locks, the file unlocked."""
  import errno
  import fcntl

  makedirs(parent(path))
  f = open(path, "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      f.close()
      return None
  return f
