"""Two local processes x 4 CPU devices train exactly like one process with 8 devices."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import ROOT, SMALL_TRAIN_FLAGS

# Two processes, about a minute on 2 cores: in the slow stage (make test-slow). Those that run
# `ao-mdm train` are `alone` (one at a time): a process starved of CPU by another test misses
# its heartbeats, and some are signalled after delays. The workers of test_two_processes_match_one
# watch no heartbeats.
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
  procs = [
    subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for c in commands
  ]
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


@pytest.mark.parametrize("mode", ["train", "grpo"])
def test_two_processes_match_one(mode, tmp_path):
  """Train steps, or GRPO steps whose answers each process draws to its own prompts: the same
  losses and params (and the same answers, bitwise) from two processes as from one."""
  port = free_port()
  worker = [sys.executable, str(WORKER)] + (["--grpo"] if mode == "grpo" else [])
  multi = [
    worker
    + [
      "--devices=4",
      "--num_processes=2",
      f"--process_id={i}",
      f"--port={port}",
      f"--out={tmp_path / 'multi.npz'}",
    ]
    for i in range(2)
  ]
  single = worker + ["--devices=8", f"--out={tmp_path / 'single.npz'}"]
  run_all(multi + [single])
  got, want = np.load(tmp_path / "multi.npz"), np.load(tmp_path / "single.npz")
  assert sorted(got.files) == sorted(want.files) and len(got.files) > 10
  for loss in [x for x in got.files if x.endswith("loss")]:
    assert np.all(np.isfinite(got[loss])) and np.any(got[loss] != 0), (loss, got[loss])
  # Speculative rollouts draw with one key per prompt length and process: exact draws, but which
  # ones depends on how the prompts are split among the processes.
  for name in [x for x in want.files if not x.startswith("speculative/")]:
    if "answers" in name:
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


# `ao-mdm train` as two processes of 2 CPU devices each, joined through a coordinator on
# 127.0.0.1: signals to one or both, a process killed, each stop resumed to the end and compared
# with a run that was never stopped.
SMALL = SMALL_TRAIN_FLAGS
STEPS = 12


def two_trains(workdir: str, data_dir: str, *flags, steps: int = STEPS) -> list:
  """Both processes of a run of `steps` steps, started at once."""
  port = free_port()
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "PYTHONUNBUFFERED": "1",  # a killed one's lines
    "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
  }
  return [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "ao_mdm.cli.main",
        "train",
        f"--config={ROOT}/configs/tiny.py",
        f"--workdir={workdir}",
        f"--config.data.tfds_dir={data_dir}",
        *SMALL,
        f"--config.train.num_steps={steps}",
        "--config.train.eval_every=0",
        *flags,
        f"--coordinator=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={i}",
      ],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]


def finish(procs: list) -> list:
  """(returncode, stdout, stderr) of each process, once both ended (killed past TIMEOUT_S)."""
  outs = []
  try:
    for p in procs:
      outs.append((*p.communicate(timeout=TIMEOUT_S),))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def records(workdir: str) -> dict:
  """step -> loss of metrics.jsonl, the last record of a step winning (a resume rewrites)."""
  from ao_mdm.storage import fs

  path = fs.join(workdir, "metrics.jsonl")
  if not fs.isfile(path):
    return {}
  import json

  return {
    r["step"]: r["loss"] for r in map(json.loads, fs.read_text(path).splitlines()) if "loss" in r
  }


def wait_for_step(procs: list, workdir: str, step: int) -> None:
  deadline = time.time() + TIMEOUT_S
  while (
    max(records(workdir), default=0) < step
    and time.time() < deadline
    and all(p.poll() is None for p in procs)
  ):
    time.sleep(0.05)
  assert max(records(workdir), default=0) >= step, [p.poll() for p in procs]


def catches_sigterm(proc) -> None:
  """Waits until `proc` has its SIGTERM handler (the signal's bit in /proc's SigCgt mask): a
  signal before it is the default's, which no program can catch."""
  deadline = time.time() + TIMEOUT_S
  while time.time() < deadline and proc.poll() is None:
    with open(f"/proc/{proc.pid}/status") as f:
      caught = int([x for x in f if x.startswith("SigCgt:")][0].split()[1], 16)
    if caught >> (signal.SIGTERM - 1) & 1:
      return
    time.sleep(0.01)
  raise AssertionError(f"process {proc.pid} never caught SIGTERM")


def error_lines(err: str) -> list:
  return [line for line in err.splitlines() if line.startswith("error: ")]


def assert_same_run(workdir: str, straight: str) -> None:
  """Losses of every step and the final params and EMA equal the straight run's, bitwise."""
  import jax

  from ao_mdm.checkpoint import checkpoints

  assert records(workdir) == records(straight) and sorted(records(workdir)) == list(
    range(1, STEPS + 1)
  )
  for weights in ("params", "ema"):
    _, want = checkpoints.load_params(straight, weights)
    _, got = checkpoints.load_params(workdir, weights)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def stop_and_resume(workdir: str, data_dir: str, straight: str, act, *flags) -> list:
  """A run stopped by `act(procs)`, then resumed to the end: its stop's results, checked equal
  to the straight run after the resume."""
  procs = two_trains(workdir, data_dir, "--config.train.checkpoint_every=100", *flags)
  act(procs)
  stopped = finish(procs)
  resumed = finish(two_trains(workdir, data_dir, "--config.train.checkpoint_every=100", *flags))
  assert [r[0] for r in resumed] == [0, 0], resumed[0][2][-3000:]
  assert_same_run(workdir, straight)
  return stopped


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
  """A two-process run never stopped: what every stopped and resumed run must equal."""
  workdir = str(tmp_path_factory.mktemp("straight") / "run")
  outs = finish(two_trains(workdir, data_dir, "--config.train.checkpoint_every=100"))
  assert [r[0] for r in outs] == [0, 0], outs[0][2][-3000:]
  return workdir


def saved_step(stopped: list, said: str) -> int:
  """The step both processes saved, from process 0's line."""
  line = [x for x in stopped[0][1].splitlines() if x.startswith(f"{said}: saved a checkpoint")]
  assert len(line) == 1, stopped[0][1][-2000:]
  return int(line[0].split("at step ")[1].split()[0])


@pytest.mark.alone
def test_sigterm_to_one_process_stops_both_at_one_step(straight, data_dir, tmp_path):
  workdir = str(tmp_path / "run")

  def act(procs):
    wait_for_step(procs, workdir, 3)
    procs[1].send_signal(signal.SIGTERM)  # a preemption notice reaches one host

  stopped = stop_and_resume(workdir, data_dir, straight, act)
  assert [r[0] for r in stopped] == [0, 0], stopped[1][2][-3000:]
  assert 3 < saved_step(stopped, "preempted") < STEPS
  assert not any(error_lines(r[2]) or "Traceback" in r[2] for r in stopped)


@pytest.mark.alone
def test_sigterm_to_both_at_different_moments_and_during_start_up(straight, data_dir, tmp_path):
  workdir = str(tmp_path / "run")

  def act(procs):
    catches_sigterm(procs[0])  # as early as can be: before joining, building, restoring
    procs[0].send_signal(signal.SIGTERM)
    wait_for_step(procs, workdir, 1)
    procs[1].send_signal(signal.SIGTERM)

  stopped = stop_and_resume(workdir, data_dir, straight, act)
  assert [r[0] for r in stopped] == [0, 0], stopped[0][2][-3000:]
  assert saved_step(stopped, "preempted") <= 3  # at the first boundaries, not when both asked


@pytest.mark.alone
def test_ctrl_c_to_one_process_exits_130_on_both(straight, data_dir, tmp_path):
  workdir = str(tmp_path / "run")

  def act(procs):
    wait_for_step(procs, workdir, 4)
    procs[0].send_signal(signal.SIGINT)

  stopped = stop_and_resume(workdir, data_dir, straight, act, "--config.train.eval_every=5")
  assert [r[0] for r in stopped] == [130, 130], stopped[1][2][-3000:]
  assert 4 < saved_step(stopped, "interrupted") < STEPS


def wait_for_checkpoint(procs: list, workdir: str, step: int) -> None:
  """Until the checkpoint of `step` is complete (under its final name)."""
  path = os.path.join(workdir, "checkpoints", str(step))
  deadline = time.time() + TIMEOUT_S
  while not os.path.isdir(path) and time.time() < deadline and all(p.poll() is None for p in procs):
    time.sleep(0.02)
  assert os.path.isdir(path), [p.poll() for p in procs]


@pytest.mark.alone
def test_a_killed_process_ends_the_other_with_one_line_in_bounded_time(
  straight, data_dir, tmp_path
):
  """SIGKILL of either process (1, then the coordinator 0) right after a checkpoint completes,
  at the default --heartbeat_timeout: the other exits 2 with one line naming it and the newest
  complete checkpoint within the timeout and a few seconds; the restart resumes from the step
  the line named; the run ends equal to the straight run."""
  from ao_mdm.runtime import hosts

  workdir, every, named = str(tmp_path / "run"), 5, None
  for victim, step in ((1, every), (0, 2 * every)):
    procs = two_trains(workdir, data_dir, f"--config.train.checkpoint_every={every}")
    wait_for_checkpoint(procs, workdir, step)
    wait_for_step(procs, workdir, step)  # its record, written while the next step runs
    start = time.time()
    procs[victim].kill()
    stopped = finish(procs)
    survivor, elapsed = stopped[1 - victim], time.time() - start
    if named is not None:  # this run restarted the one stopped before
      assert f"resumed from step {named} in {workdir}" in stopped[0][1], stopped[0][1][-2000:]
    # within the timeout and a few seconds: 25 s at most at the default (docs/launching.md)
    assert survivor[0] == 2 and elapsed < min(hosts.HEARTBEAT_S + 8, 25), (survivor, elapsed)
    assert survivor[2].splitlines() == error_lines(survivor[2]), survivor[2][-3000:]
    line = error_lines(survivor[2])[0]
    assert f"process {victim} of 2 stopped" in line, line
    assert f"--heartbeat_timeout={hosts.HEARTBEAT_S} s" in line, line
    assert "newest complete checkpoint is step " in line and workdir in line, line
    named = int(line.split("newest complete checkpoint is step ")[1].split()[0])
    complete = [int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()]
    assert named == max(complete) >= step, (line, complete)
  resumed = finish(two_trains(workdir, data_dir, f"--config.train.checkpoint_every={every}"))
  assert [r[0] for r in resumed] == [0, 0], resumed[0][2][-3000:]
  assert f"resumed from step {named} in {workdir}" in resumed[0][1], resumed[0][1][-2000:]
  assert_same_run(workdir, straight)


@pytest.mark.alone
def test_finetuning_then_grpo_in_two_processes(sp_export, data_dir, tmp_path):
  """`ao-mdm train` on pairs as two processes: fine-tuning from an export, GRPO from that run
  (every process writes its shards of the reference), then GRPO resumed (both read it back)."""
  import json

  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.storage import fs

  sft, workdir = str(tmp_path / "sft"), str(tmp_path / "grpo")
  pairs = ("--config.model.cond_dim=32", "--config.data.pairs=arithmetic:64")
  grpo = (
    "--config.grpo.reward=ao_mdm.train.grpo:exact_match",
    "--config.grpo.group=4",
    "--config.grpo.updates=2",
    "--config.train.checkpoint_every=1",
  )
  runs = (
    (sft, pairs + (f"--init_from={sp_export}",), 1),
    (workdir, pairs + grpo + (f"--init_from={sft}",), 1),
    (workdir, pairs + grpo, 2),
  )
  for run, flags, steps in runs:
    outs = finish(two_trains(run, data_dir, *flags, steps=steps))
    assert [r[0] for r in outs] == [0, 0], (outs[0][2][-3000:], outs[1][2][-3000:])
    assert not any(error_lines(r[2]) for r in outs)
  assert "resumed from step 1" in outs[0][1], outs[0][1][-2000:]
  logged = [json.loads(x) for x in fs.read_text(f"{workdir}/metrics.jsonl").splitlines()]
  assert [r["step"] for r in logged if "reward" in r] == [1, 2]
  reference = checkpoints.load_params(f"{workdir}/reference", log=lambda _: None)[1]
  jax_tree_equal(reference, checkpoints.load_params(sft, "ema", log=lambda _: None)[1])


def jax_tree_equal(a, b) -> None:
  import jax

  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.alone
def test_ctrl_c_to_the_local_launcher_is_an_interrupt_not_a_failure(data_dir, tmp_path):
  """launch/local_multiprocess.sh: Ctrl-C (SIGINT to its process group, as a terminal sends it)
  saves one step in both processes and the launcher exits 130 without calling it a failure."""
  workdir = str(tmp_path / "run")
  env = {
    **os.environ,
    "PORT": str(free_port()),
    "DEVICES_PER_PROCESS": "2",
    "AO_MDM": os.path.join(os.path.dirname(sys.executable), "ao-mdm"),
  }
  launcher = subprocess.Popen(
    [
      "bash",
      str(ROOT / "launch/local_multiprocess.sh"),
      "2",
      f"{ROOT}/configs/tiny.py",
      workdir,
      f"--config.data.tfds_dir={data_dir}",
      *SMALL,
      "--config.train.num_steps=200",
      "--config.train.eval_every=0",
      "--config.train.checkpoint_every=1000",
    ],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    start_new_session=True,
  )
  try:
    wait_for_step([launcher], workdir, 3)
    os.killpg(launcher.pid, signal.SIGINT)
    out, err = launcher.communicate(timeout=TIMEOUT_S)
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
  assert launcher.returncode == 130, err[-3000:]
  assert "failed" not in err and "interrupted: saved a checkpoint at step" in out, err[-3000:]
