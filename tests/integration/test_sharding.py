"""The sharded train step on 8 simulated CPU devices matches one device (float32).

The devices must exist before JAX starts, so tests/sharding_worker.py runs in a subprocess.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from helpers import default_compiler_flags

WORKER = pathlib.Path(__file__).resolve().parent / "sharding_worker.py"
TIMEOUT_S = 240

# An 8-device worker that trains on several meshes (about 1.5 min): in the slow stage, which runs
# one test at a time (beside another test the worker ran past its 240 s bound).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharding")
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": f"{default_compiler_flags()} --xla_force_host_platform_device_count=8",
  }
  try:
    proc = subprocess.run(
      [sys.executable, str(WORKER), str(out)],
      capture_output=True,
      text=True,
      env=env,
      timeout=TIMEOUT_S,
    )
  except subprocess.TimeoutExpired as e:
    raise AssertionError(f"{WORKER.name} hung for more than {TIMEOUT_S} s") from e
  assert proc.returncode == 0, f"{WORKER.name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
  return out


def assert_same(got_path, want_path):
  got, want = np.load(got_path), np.load(want_path)
  assert sorted(got.files) == sorted(want.files)
  for name in want.files:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("mesh", ["mesh_8_1_1", "mesh_2_2_2", "mesh_1_4_2"])
def test_mesh_matches_one_device(results, mesh):
  assert_same(results / f"{mesh}.npz", results / "reference.npz")


def test_params_sharded_by_rules(results):
  specs = json.loads((results / "specs.json").read_text())
  # mlp_in kernel: ('layers', 'embed', 'mlp') -> (None, 'fsdp', 'tensor'); shape (2, 32, 128).
  assert specs["mesh_2_2_2/mlp_in"] == {
    "spec": [None, "fsdp", "tensor"],
    "shard_shape": [2, 16, 64],
  }
  assert specs["mesh_1_4_2/mlp_in"]["shard_shape"] == [2, 8, 64]
  # token_embed: ('vocab', 'embed') -> ('tensor', 'fsdp'); shape (256, 32).
  assert specs["mesh_1_4_2/token_embed"] == {"spec": ["tensor", "fsdp"], "shard_shape": [128, 8]}
  # Pure data parallelism keeps params whole.
  assert specs["mesh_8_1_1/mlp_in"]["shard_shape"] == [2, 32, 128]


def test_gradient_accumulation_matches_one_batch(results):
  assert_same(results / "accum_m4.npz", results / "accum_m1.npz")
  assert_same(results / "accum_m4_mesh_2_1_2.npz", results / "accum_m1.npz")


def test_splash_attention_on_a_mesh_matches_xla_on_one_device(results):
  """The kernel under shard_map (batch over data and fsdp, heads over tensor)
  trains as XLA attention on one device does."""
  assert_same(results / "attention_splash_mesh_2_2_2.npz", results / "attention_xla.npz")
