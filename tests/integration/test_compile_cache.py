"""The persistent compilation cache: a second process loads the first one's programs, a corrupt
entry is survived and rewritten, eviction keeps the bound, `off` writes nothing; and the GPU
script's dry run."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from ao_mdm.storage import compile_cache
from helpers import ROOT

CHILD = """
import json, sys
import jax, jax.numpy as jnp
from jax._src import monitoring
from ao_mdm.storage import compile_cache
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
compile_cache.enable(sys.argv[1])
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0) * 3.0)
value = float(f(jnp.arange(12.0).reshape(3, 4)).sum())
print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"), "value": value}))
"""


def run_child(cache: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  out = subprocess.run(
    [sys.executable, "-c", CHILD, cache],
    capture_output=True,
    text=True,
    env={**env, "JAX_PLATFORMS": "cpu"},
    timeout=120,
    cwd=ROOT,
  )
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.strip().splitlines()[-1])


def entries(cache) -> list:
  return sorted(p for p in pathlib.Path(cache).glob("*.xla"))


def test_a_second_process_loads_the_first_ones_programs(tmp_path):
  cache = str(tmp_path / "cache")
  first = run_child(cache)
  written = entries(cache)
  assert first["hits"] == 0 and written
  second = run_child(cache)
  assert second["hits"] >= 1 and second["value"] == first["value"]
  assert entries(cache) == written


def test_a_corrupt_entry_is_ignored_and_written_again(tmp_path):
  cache = str(tmp_path / "cache")
  want = run_child(cache)["value"]
  for path in entries(cache):  # torn writes: every entry cut in half
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
  again = run_child(cache)
  assert again["hits"] == 0 and again["value"] == want  # recompiled, not loaded
  assert run_child(cache)["hits"] >= 1  # rewritten whole, so loaded the next time
  for path in entries(cache):
    assert compile_cache.Cache(cache).get(path.name[: -len(".xla")]) is not None


def test_eviction_keeps_the_bound_and_the_recently_used(tmp_path):
  cache = compile_cache.Cache(str(tmp_path / "c"), max_bytes=3000)
  for i in range(3):
    cache.put(f"k{i}", bytes([i]) * 900)
    os.utime(tmp_path / "c" / f"k{i}.xla", (1000 + i, 1000 + i))  # distinct recency
  assert cache.get("k0") == bytes([0]) * 900  # k0 becomes the most recent
  cache.put("k3", b"x" * 900)
  names = sorted(p.name for p in (tmp_path / "c").glob("*.xla"))
  assert names == ["k0.xla", "k2.xla", "k3.xla"]  # k1, least recently used, went
  assert sum(p.stat().st_size for p in (tmp_path / "c").glob("*.xla")) <= 3000
  cache.put("big", b"y" * 5000)  # larger than the bound: not kept, nothing evicted for it
  assert not (tmp_path / "c" / "big.xla").exists() and len(entries(tmp_path / "c")) == 3


def test_where_the_cache_lives(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  monkeypatch.setenv(compile_cache.JAX_ENV, str(tmp_path / "jax"))  # JAX's own variable
  assert compile_cache.where(None, "run") == str(tmp_path / "jax")
  assert compile_cache.where(str(tmp_path / "flag"), "run") == str(tmp_path / "flag")
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "ours"))  # ours comes first
  assert compile_cache.where(None, "run") == str(tmp_path / "ours")
  monkeypatch.delenv(compile_cache.ENV)
  monkeypatch.delenv(compile_cache.JAX_ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.where(None) == str(tmp_path / "xdg" / "ao_mdm" / "xla")
  assert compile_cache.where(None, "gs://b/run") == "gs://b/run/xla_cache"
  assert compile_cache.where("off", "run") is None
  monkeypatch.setenv(compile_cache.ENV, "off")
  assert compile_cache.where(None, "run") is None
  assert compile_cache.where(str(tmp_path / "d"), "run") == str(tmp_path / "d")


@pytest.mark.slow  # two trainings (about 40 s)
def test_train_keeps_its_cache_in_the_work_dir_and_off_writes_nothing(data_dir, tmp_path):
  env = {
    k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", compile_cache.ENV)
  }
  env.update(JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path / "xdg"))
  args = [
    sys.executable,
    "-m",
    "ao_mdm.cli.main",
    "train",
    f"--config={ROOT}/configs/tiny.py",
    f"--config.data.tfds_dir={data_dir}",
    "--config.model.vocab_size=512",
    "--config.model.block_size=32",
    "--config.model.n_layer=1",
    "--config.model.n_embd=32",
    "--config.model.n_head=2",
    "--config.train.batch_size=4",
    "--config.train.num_steps=1",
    "--config.train.eval_batches=1",
    "--config.train.eval_every=0",
  ]
  for workdir, extra in ((tmp_path / "on", []), (tmp_path / "off", ["--compile_cache=off"])):
    out = subprocess.run(
      [*args, f"--workdir={workdir}", *extra],
      capture_output=True,
      text=True,
      env=env,
      timeout=300,
      cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
  assert entries(tmp_path / "on" / "xla_cache")
  assert not (tmp_path / "off" / "xla_cache").exists() and not (tmp_path / "xdg").exists()


@pytest.mark.slow  # trains one step of the demo model (its run is what the sampling step reads)
def test_the_gpu_script_dry_run_checks_every_command(tmp_path):
  """With no PYTHON and no activated venv (python3 on PATH has no ao_mdm), the dry run finds
  the checkout's .venv, as the launchers do."""
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
  venv_bin = os.path.dirname(sys.executable)
  env.update(
    JAX_PLATFORMS="cpu",
    PATH=os.pathsep.join(
      p for p in env.get("PATH", "").split(os.pathsep) if os.path.abspath(p) != venv_bin
    ),
  )
  if not os.path.exists(ROOT / ".venv" / "bin" / "python"):
    env["PYTHON"] = sys.executable  # a checkout without make's .venv
  out = subprocess.run(
    ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out"), "--dry_run"],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env=env,
  )
  assert out.returncode == 0, out.stdout + out.stderr
  plans = [line for line in out.stdout.splitlines() if line.startswith("plan: ")]
  assert len(plans) == 9 and "every command's flags were accepted" in out.stdout
  assert any("--config.model.attention=cudnn" in p for p in plans)
