"""Two local processes x 4 CPU devices train exactly like one process with 8 devices."""
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

# Two processes, about a minute on 2 cores: in CI's slow stage (make test-slow).
pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).resolve().parent / "multiprocess_worker.py"
TIMEOUT_S = 240


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_all(commands: list) -> list:
  """Start every command at once; kill them all if one hangs past TIMEOUT_S."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env) for c in commands]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired as e:
    raise AssertionError(f"a worker hung for more than {TIMEOUT_S} s: {e.cmd}") from e
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, f"{p.args} exited with {p.returncode}:\n{out[-4000:]}"
  return outputs


def test_two_processes_match_one(tmp_path):
  port = free_port()
  worker = [sys.executable, str(WORKER)]
  multi = [worker + ["--devices=4", "--num_processes=2", f"--process_id={i}", f"--port={port}",
                     f"--out={tmp_path / 'multi.npz'}"] for i in range(2)]
  single = worker + ["--devices=8", f"--out={tmp_path / 'single.npz'}"]
  run_all(multi + [single])
  got, want = np.load(tmp_path / "multi.npz"), np.load(tmp_path / "single.npz")
  assert sorted(got.files) == sorted(want.files) and len(got.files) > 10
  assert np.all(np.isfinite(got["loss"]))
  for name in want.files:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
