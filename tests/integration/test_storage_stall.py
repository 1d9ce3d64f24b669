"""A bucket that stops answering while a command reads a checkpoint (or writes an export): each
phase (Orbax's manager creation, its step listing, the restore of params through tensorstore, of
the data iterator) ends in one error line within --storage_timeout, not a hang.

The stall is made where it should be, not after a guessed sleep: a proxy in front of the local
GCS server forwards requests until one of the phase's arrives, then answers nothing more, its
connections held open (what a SIGSTOPped server does). Every case starts a command: slow stage."""

from collections.abc import Callable
import http.client
import http.server
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.config import base_config
from ao_mdm.storage import fs
from ao_mdm.train import loop
from helpers import ROOT

# They time bounded detections or signal processes after delays: the slow stage runs them one
# at a time (`alone`), never beside another test.
pytestmark = pytest.mark.alone

BOUND_S = 5  # --storage_timeout of every case
SMALL = {
  "model.vocab_size": 512,
  "model.block_size": 32,
  "model.n_layer": 2,
  "model.n_embd": 32,
  "model.n_head": 2,
  "model.cond_dim": 32,
  "train.batch_size": 8,
  "train.eval_batches": 1,
  "train.eval_every": 0,
  "train.checkpoint_every": 10,
}


class StallingProxy:
  """An HTTP proxy in front of a GCS server: it forwards every request until one for which
  `stall_on(method, path, user_agent)` holds; that one and every later one get no answer, their
  connections held open until close()."""

  def __init__(self, upstream: str, stall_on: Callable[[str, str, str], bool]):
    self.upstream = urllib.parse.urlparse(upstream).netloc
    self.stalled_at: float | None = None  # time.monotonic() of the first unanswered request
    self.release = threading.Event()
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"  # keep-alive, as the clients use it

      def log_message(self, *args):
        del args

      def forward(self):
        body = self._body()
        if proxy.stalled_at is None and stall_on(
          self.command, self.path, self.headers.get("User-Agent", "")
        ):
          proxy.stalled_at = time.monotonic()
        if proxy.stalled_at is not None:
          proxy.release.wait()
          self.close_connection = True
          return
        headers = {
          k: v
          for k, v in self.headers.items()
          if k.lower() not in ("host", "connection", "content-length", "transfer-encoding")
        }
        upstream = http.client.HTTPConnection(proxy.upstream, timeout=60)
        upstream.request(self.command, self.path, body=body, headers=headers)
        response = upstream.getresponse()
        data = response.read()
        upstream.close()
        self.send_response_only(response.status, response.reason)
        for key, value in response.getheaders():
          if key.lower() not in ("connection", "content-length", "transfer-encoding"):
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
          return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
          chunks.append(self.rfile.read(size + 2)[:size])
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
          pass
        return b"".join(chunks)

      do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.server.daemon_threads = True
    self.server.handle_error = lambda *args: None  # a client that hangs up mid-answer
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def close(self) -> None:
    self.release.set()
    self.server.shutdown()
    self.server.server_close()


@pytest.fixture(scope="module")
def run(gcs_server, data_dir) -> str:
  """A 10-step run of a small model in the bucket, checkpointed at step 10."""
  del gcs_server
  config = base_config()
  for key, value in SMALL.items():
    section, name = key.split(".")
    config[section][name] = value
  config.train.num_steps = 10
  config.data.tfds_dir = data_dir
  path = f"gs://bucket/stall-{time.time_ns()}"
  loop.train_and_evaluate(specs.parse(config), path, log=lambda line: None)
  return path


def _stalled(command: list, stall_on: Callable) -> tuple:
  """(process, seconds from the stall to the exit): `command` run against a proxy that stalls
  at the first request `stall_on` matches."""
  proxy = StallingProxy(os.environ["STORAGE_EMULATOR_HOST"], stall_on)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "STORAGE_EMULATOR_HOST": proxy.url}
  del env["TENSORSTORE_GCS_HTTP_URL"]  # this process's, the server's: the command sets its own
  try:
    proc = subprocess.run(
      [sys.executable, "-m", "ao_mdm.cli.main", *command, f"--storage_timeout={BOUND_S}"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
      env=env,
    )
    ended = time.monotonic()
  finally:
    proxy.close()
  assert proxy.stalled_at is not None, f"the phase was never reached:\n{proc.stderr[-2000:]}"
  return proc, ended - proxy.stalled_at


def _one_error_line_in_bound(proc, waited: float) -> str:
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("error: ") and "no answer from Cloud Storage" in lines[0], lines
  assert f"within {BOUND_S} s" in lines[0], lines
  assert waited < BOUND_S + checkpoints.PROBE_S + 6, waited  # the bound, a probe, the exit
  return lines[0]


def _request(pattern: str, agent: str, method: str = "GET") -> Callable:
  """A request `method` of the client `agent` (python-gcsfs: Orbax's paths; tensorstore: its
  arrays; gcloud-python: the project's own calls) whose path matches `pattern`."""
  return lambda m, path, user_agent: (
    m == method and agent in user_agent and re.search(pattern, path) is not None
  )


def _phases(key: str) -> dict:
  """The first request of each phase of a restore from checkpoints/ under the object prefix
  `key`."""
  quoted = urllib.parse.quote(f"{key}/checkpoints", safe="")
  return {
    # Orbax's CheckpointManager begins by asking whether its directory exists ...
    "manager creation": _request(rf"/o/{quoted}$", "gcsfs"),
    # ... then lists the step directories (one page of many results, not an existence check)
    "step listing": _request(rf"prefix={re.escape(key)}/checkpoints/&maxResults=\d\d", "gcsfs"),
    "restore of params": _request(rf"{quoted}%2F10%2F(ema|state)%2F", "tensorstore"),
    "restore of the data iterator": _request(rf"^/download/.*{quoted}%2F10%2Fdata%2F", "gcsfs"),
  }


@pytest.mark.slow  # three commands, each ends about 7 s after its stall
@pytest.mark.parametrize("phase", ["manager creation", "step listing", "restore of params"])
def test_sample_from_a_bucket_that_stalls_while_reading_ends_with_one_line(run, phase):
  """The same code reads the params of eval, export, export-torch, harness and --init_from."""
  key = run[len("gs://bucket/") :]
  proc, waited = _stalled(
    ["sample", f"--checkpoint={run}", "--num_samples=1", "--steps=4"], _phases(key)[phase]
  )
  print(f"sample, {phase}: the error line {waited:.1f} s after the stall (bound {BOUND_S} s)")
  _one_error_line_in_bound(proc, waited)


def _resume(run: str, workdir: str, data_dir: str) -> list:
  """The command that resumes a copy of `run` in `workdir` (its own: a stalled run leaves its
  lock behind) for two more steps."""
  fs.copytree(run, workdir)
  return [
    "train",
    f"--config={ROOT}/configs/tiny.py",
    f"--workdir={workdir}",
    *[f"--config.{k}={v}" for k, v in SMALL.items()],
    "--config.train.num_steps=12",
    f"--config.data.tfds_dir={data_dir}",
  ]


@pytest.mark.slow  # four trainings, each ends about 7 s after its stall
@pytest.mark.parametrize(
  "phase", ["manager creation", "step listing", "restore of params", "restore of the data iterator"]
)
def test_train_resuming_from_a_bucket_that_stalls_ends_with_one_line(run, phase, data_dir):
  """The line names step 10 once Orbax has listed it, the checkpoint a restart resumes from;
  before, that the steps were not listed yet."""
  workdir = f"{run}-resume-{phase.replace(' ', '-')}"
  proc, waited = _stalled(
    _resume(run, workdir, data_dir), _phases(workdir[len("gs://bucket/") :])[phase]
  )
  print(
    f"train resuming, {phase}: the error line {waited:.1f} s after the stall (bound {BOUND_S} s)"
  )
  line = _one_error_line_in_bound(proc, waited)
  listed = phase.startswith("restore")
  assert (
    f"the newest complete checkpoint is step 10 in {workdir}"
    if listed
    else f"its checkpoints in {workdir} were not listed yet"
  ) in line, line


@pytest.mark.slow  # one training, about 25 s
def test_train_whose_compile_cache_stalls_ends_with_one_line(run, data_dir):
  """train's compilation cache in the bucket (its default, WORKDIR/xla_cache) stalls at its
  first read: each compile goes on without the cache, and no warning of JAX's about a failed
  cache write joins the one line."""
  workdir = f"{run}-resume-compile-cache"
  command = [*_resume(run, workdir, data_dir), f"--compile_cache={workdir}/xla_cache"]
  proc, waited = _stalled(command, _request("xla_cache", "gcloud-python"))
  print(f"train, compile cache: the error line {waited:.1f} s after the stall (bound {BOUND_S} s)")
  _one_error_line_in_bound(proc, waited)


@pytest.mark.slow  # one export, about 20 s
def test_an_export_into_a_bucket_that_stalls_while_writing_ends_with_one_line(run):
  """Orbax's write of the params, probed like its reads; what is left is no export (the
  commit mark comes last)."""
  out = f"{run}-export"
  proc, waited = _stalled(
    ["export", f"--checkpoint={run}", f"--out={out}"], _request(r"", "tensorstore", method="POST")
  )
  print(f"export, writing params: the error line {waited:.1f} s after the stall")
  _one_error_line_in_bound(proc, waited)
  assert not fs.exists(fs.join(out, "0", "commit_success.txt"))
