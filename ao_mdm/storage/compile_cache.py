"""The persistent XLA compilation cache: compiled programs kept on disk (or in a bucket), so a
restart, a second host or the next command loads them instead of compiling again.

JAX's own file cache writes entries in place and keeps an entry it cannot read; this one is
JAX's cache interface over storage/fs.py: each entry is written atomically (a temporary file
and a rename, or one object write) with the sha256 of its bytes, so a torn or corrupt entry is
detected, removed and written again by the next compile, never loaded. The least recently used
entries (file mtimes, touched on each hit; write times in a bucket) go when the entries exceed
`max_bytes`. Several processes may share a cache: writes are atomic and a vanished entry is a
miss.

`ao-mdm train` keeps it in the work dir (`WORKDIR/xla_cache`: every host and restart of the run
shares it), the other commands in $XDG_CACHE_HOME/ao_mdm/xla (~/.cache/ao_mdm/xla);
`--compile_cache=DIR` or AO_MDM_COMPILE_CACHE=DIR moves it, `off` turns it off. Removing the
directory clears it.
"""

import hashlib
import os

from ao_mdm.storage import fs

ENV = "AO_MDM_COMPILE_CACHE"
JAX_ENV = "JAX_COMPILATION_CACHE_DIR"  # the convention users bring from JAX
OFF = "off"
WORKDIR_SUBDIR = "xla_cache"
MAX_BYTES = 4 << 30
_MAGIC = b"aomdmxc1"
_SUFFIX = ".xla"


def user_dir() -> str:
  """$XDG_CACHE_HOME/ao_mdm/xla, by default ~/.cache/ao_mdm/xla."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return fs.join(base, "ao_mdm", "xla")


def where(flag: str | None, workdir: str | None = None) -> str | None:
  """The cache directory a command uses: --compile_cache, else AO_MDM_COMPILE_CACHE, else JAX's
  own JAX_COMPILATION_CACHE_DIR, else the work dir's (train) or the user's; None when the
  chosen one says `off`."""
  chosen = flag or os.environ.get(ENV) or os.environ.get(JAX_ENV) or ""
  if chosen == OFF:
    return None
  if chosen:
    return chosen
  return fs.join(workdir, WORKDIR_SUBDIR) if workdir else user_dir()


class Cache:
  """JAX's CacheInterface (`get`, `put`) over a local or gs:// directory."""

  def __init__(self, path: str, max_bytes: int = MAX_BYTES):
    self.path, self.max_bytes = path, max_bytes  # the directory is made by the first entry
    self._counted: int | None = None  # bytes of the entries, once listed

  def _entry(self, key: str) -> str:
    return fs.join(self.path, f"{key}{_SUFFIX}")

  def get(self, key: str) -> bytes | None:
    path = self._entry(key)
    try:
      data = fs.read_bytes(path)
    except (FileNotFoundError, OSError):
      return None
    value = data[len(_MAGIC) + 32 :]
    if (
      data[: len(_MAGIC)] != _MAGIC
      or hashlib.sha256(value).digest() != data[len(_MAGIC) : len(_MAGIC) + 32]
    ):
      fs.remove(path)  # torn or corrupt: the compile that follows writes it again
      return None
    if not fs.is_gcs(path):
      try:
        os.utime(path)  # the entry's recency, for eviction
      except OSError:
        pass
    return value

  def put(self, key: str, value: bytes) -> None:
    data = _MAGIC + hashlib.sha256(value).digest() + value
    if len(data) > self.max_bytes:
      return
    try:
      self._evict(len(data))
      fs.write_bytes(self._entry(key), data)
    except OSError:  # a bucket that stops answering too: the command's next call says so
      return  # a full disk or a lost connection costs a compile next time, nothing else
    if self._counted is not None:
      self._counted += len(data)

  def entries(self) -> list[tuple[int, int, str]]:
    """(recency, bytes, path) of every entry, oldest first."""
    out = []
    for name in fs.listdir(self.path) if fs.isdir(self.path) else []:
      if name.endswith(_SUFFIX):
        path = fs.join(self.path, name)
        try:
          st = fs.stat(path)
        except FileNotFoundError:
          continue
        out.append((st.version, st.size, path))
    return sorted(out)

  def _evict(self, incoming: int) -> None:
    """Removes the least recently used entries until `incoming` more bytes fit."""
    if self._counted is not None and self._counted + incoming <= self.max_bytes:
      return
    entries = self.entries()
    total = sum(size for _, size, _ in entries)
    for _, size, path in entries:
      if total + incoming <= self.max_bytes:
        break
      fs.remove(path)
      total -= size
    self._counted = total


def enable(path: str | None, max_bytes: int = MAX_BYTES) -> Cache | None:
  """Makes JAX compile through the cache at `path` (None: no persistent cache) from now on;
  every program is cached, however fast it compiled. Before the first compile of the process."""
  import jax

  if path is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  cache: Cache | None = Cache(path, max_bytes)
  try:  # JAX builds its cache through this function the first time it compiles
    from jax._src import compilation_cache

    # Cache has CacheInterface's get and put, not its base class: this module loads before JAX
    compilation_cache.get_file_cache = lambda _: (cache, path)  # type: ignore[assignment,return-value]
    compilation_cache.reset_cache()
  except (ImportError, AttributeError):  # another JAX: its own file cache, bounded alike
    cache = None
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return cache
