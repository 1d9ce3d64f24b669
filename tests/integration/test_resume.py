"""Exact resume after SIGKILL; SIGTERM and Ctrl-C; unreadable and foreign checkpoints; one run
per work dir."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.config import base_config
from ao_mdm.train import loop
from helpers import ROOT, SMALL_TRAIN_FLAGS

# Those marked `alone` time bounded detections or signal processes after delays: the slow
# stage runs them one at a time, never beside another test.

SMALL = [*SMALL_TRAIN_FLAGS, "--config.train.eval_every=0"]


def _command(workdir, tfds_dir, steps, every):
  return [
    sys.executable,
    "-m",
    "ao_mdm.cli.main",
    "train",
    f"--config={ROOT}/configs/tiny.py",
    f"--workdir={workdir}",
    f"--config.data.tfds_dir={tfds_dir}",
    f"--config.train.num_steps={steps}",
    f"--config.train.checkpoint_every={every}",
    *SMALL,
  ]


def _losses(workdir):
  """Per-step loss, the last record of each step winning (a resumed run rewrites them)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if "loss" in r:
        out[r["step"]] = r["loss"]
  return out


def _complete_steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


@pytest.mark.alone
@pytest.mark.slow  # three training processes; test_train covers resume in-process by default
def test_exact_resume_after_sigkill(data_dir, tmp_path):
  """`ao-mdm prepare`, then a straight run and a run killed and resumed read the same blocks."""
  straight = str(tmp_path / "straight")
  prepared_dir = f"--config.data.prepared_dir={tmp_path / 'prepared'}"
  cmd = _command(
    straight, data_dir, 6, 3
  )  # [python, -m, ao_mdm.cli.main, train, config, workdir, tfds]
  prepare = subprocess.run(
    cmd[:3] + ["prepare"] + cmd[4:7] + [prepared_dir, SMALL[0]],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert prepare.returncode == 0 and "train: " in prepare.stdout, prepare.stderr
  subprocess.run(
    _command(straight, data_dir, 6, 3) + [prepared_dir],
    check=True,
    capture_output=True,
    timeout=300,
  )
  killed = str(tmp_path / "killed")
  proc = subprocess.Popen(
    _command(killed, data_dir, 6, 3) + [prepared_dir],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
  )
  deadline = time.time() + 300
  while 3 not in _complete_steps(killed) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert 3 in _complete_steps(killed)
  for step in _complete_steps(killed):  # a kill after step 3 is the same as a kill before it
    if step > 3:
      shutil.rmtree(os.path.join(killed, "checkpoints", str(step)))
  resumed = subprocess.run(
    _command(killed, data_dir, 6, 3) + [prepared_dir],
    check=True,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert "resumed from step 3" in resumed.stdout and "prepared" not in resumed.stdout
  a, b = _losses(straight), _losses(killed)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
  assert a == b  # bitwise: the same floats, including the data order after the restart
  for weights in ("params", "ema"):
    _, pa = checkpoints.load_params(straight, weights)
    _, pb = checkpoints.load_params(killed, weights)
    jax.tree.map(np.testing.assert_array_equal, pa, pb)


def _running(workdir, data_dir):
  """A long training process, returned once it logs its first step."""
  proc = subprocess.Popen(
    _command(workdir, data_dir, 100000, 100000),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  deadline = time.time() + 300
  while not os.path.exists(os.path.join(workdir, "metrics.jsonl")) and time.time() < deadline:
    time.sleep(0.05)
  return proc


@pytest.mark.parametrize(
  "signum, code, said",
  [
    pytest.param(signal.SIGTERM, 0, "preempted", marks=pytest.mark.slow),  # 22 s; Ctrl-C stays
    (signal.SIGINT, 130, "interrupted"),
  ],
)
@pytest.mark.alone
def test_sigterm_and_ctrl_c_save_at_a_step_boundary(data_dir, tmp_path, signum, code, said):
  workdir = str(tmp_path / "run")
  proc = _running(workdir, data_dir)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == code and "Traceback" not in err, err
  assert f"{said}: saved a checkpoint at step" in out
  steps = _complete_steps(workdir)
  assert len(steps) == 1 and not [
    n for n in os.listdir(os.path.join(workdir, "checkpoints")) if "tmp" in n
  ]
  config, _ = checkpoints.load_params(workdir, "params")
  assert config.train.num_steps == 100000


def _small_config(tfds_dir, steps):
  c = base_config()
  c.model.update(vocab_size=512, block_size=32, n_layer=2, n_embd=32, n_head=2)
  c.train.update(
    batch_size=8,
    num_steps=steps,
    warmup_steps=2,
    log_every=1,
    eval_batches=1,
    eval_every=0,
    checkpoint_every=2,
  )
  c.data.tfds_dir = tfds_dir
  return c


@pytest.mark.slow  # trains a run first (15-25 s)
def test_workdir_with_other_model_shape_is_refused(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(specs.parse(_small_config(data_dir, 2)), workdir)
  other = _small_config(data_dir, 4)
  other.model.n_embd = 64
  with pytest.raises(ValueError, match="different model: model.n_embd: checkpoint 32 vs config 64"):
    loop.train_and_evaluate(specs.parse(other), workdir)


def test_unknown_config_override_is_refused(tmp_path):
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "ao_mdm.cli.main",
      "train",
      f"--config={ROOT}/configs/tiny.py",
      f"--workdir={tmp_path}",
      "--config.train.num_stepz=3",
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode != 0 and "num_stepz" in out.stderr


def _steps_in(directory):
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


@pytest.mark.slow  # trains a run first (15-25 s)
def test_unreadable_and_foreign_steps_are_set_aside_and_saving_goes_on(data_dir, tmp_path, capsys):
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(specs.parse(_small_config(data_dir, 4)), workdir)
  ckpts = os.path.join(workdir, "checkpoints")
  for root, _, files in os.walk(os.path.join(ckpts, "4", "state")):
    for name in files:
      with open(os.path.join(root, name), "r+b") as f:
        f.truncate(3)
  os.makedirs(os.path.join(ckpts, "9", "params"))  # e.g. `export --out=WORKDIR/checkpoints/9`
  os.makedirs(os.path.join(ckpts, "5.orbax-checkpoint-tmp-1234", "state"))  # a killed write
  capsys.readouterr()
  loop.train_and_evaluate(specs.parse(_small_config(data_dir, 6)), workdir)
  out = capsys.readouterr().out
  assert "removed checkpoints/5.orbax-checkpoint-tmp-1234" in out
  assert "moved checkpoints/9 (not-a-training-checkpoint) aside" in out
  assert "skipped checkpoint step 4" in out and "moved checkpoints/4 (unreadable) aside" in out
  assert "resumed from step 2" in out
  assert sorted(os.listdir(ckpts)) == ["2", "4", "6"]  # saved past them, nothing else left
  aside = sorted(os.listdir(os.path.join(workdir, "checkpoints_set_aside")))
  assert [n.split(".")[:2] for n in aside] == [
    ["4", "unreadable"],
    ["9", "not-a-training-checkpoint"],
  ]
  steps = [
    json.loads(line)["step"]
    for line in open(os.path.join(workdir, "metrics.jsonl"))
    if "loss" in line
  ]
  assert steps == [1, 2, 3, 4, 5, 6]  # the first run's steps 3-4 were dropped on resume


@pytest.mark.slow  # trains a run first (15-25 s)
def test_every_checkpoint_unreadable_stops_unless_start_over(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(specs.parse(_small_config(data_dir, 2)), workdir)
  for root, _, files in os.walk(os.path.join(workdir, "checkpoints", "2", "config")):
    for name in files:
      open(os.path.join(root, name), "w").close()
  with pytest.raises(
    ValueError,
    match=r"no checkpoint in .* can be read \(steps 2, each listed "
    r"above\); they are left as they are.*--start_over",
  ):
    loop.train_and_evaluate(specs.parse(_small_config(data_dir, 2)), workdir)
  assert _steps_in(os.path.join(workdir, "checkpoints")) == [2]
  result = loop.train_and_evaluate(
    specs.parse(_small_config(data_dir, 2)), workdir, start_over=True
  )
  assert "initial" in result  # trained from step 0
  assert _steps_in(os.path.join(workdir, "checkpoints")) == [2]
  aside = sorted(os.listdir(os.path.join(workdir, "checkpoints_set_aside")))
  assert [n.split(".")[0] for n in aside] == ["2", "metrics", "tensorboard"]  # records too
  assert aside[0].startswith("2.unreadable")


@pytest.mark.slow  # a run of 6 steps and a train process (about 12 s)
def test_every_checkpoint_damaged_is_one_line_each_from_the_command(data_dir, tmp_path):
  """`ao-mdm train` over steps damaged three ways (every file cut short, the arrays cut short,
  the config emptied): a line per step saying why it was skipped, one error line, no library
  output."""
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(specs.parse(_small_config(data_dir, 6)), workdir)
  ckpts = os.path.join(workdir, "checkpoints")
  assert _steps_in(ckpts) == [2, 4, 6]
  for step, damage in (
    (6, lambda d, p: os.truncate(p, 3)),
    (4, lambda d, p: f"{os.sep}d" in d and os.truncate(p, 10)),
    (2, lambda d, p: "config" in d and open(p, "w").close()),
  ):
    for d, _, names in os.walk(os.path.join(ckpts, str(step))):
      for name in names:
        damage(d, os.path.join(d, name))
  out = subprocess.run(
    _command(workdir, data_dir, 8, 2), capture_output=True, text=True, timeout=300, cwd=ROOT
  )
  assert out.returncode == 2 and out.stderr.splitlines() == [
    s for s in out.stderr.splitlines() if s.startswith("error: no checkpoint in ")
  ], out.stderr
  assert len(out.stderr.splitlines()) == 1
  assert [s.split(":")[0] for s in out.stdout.splitlines() if s.startswith("skipped")] == [
    f"skipped checkpoint step {s} in {ckpts}" for s in (6, 4, 2)
  ], out.stdout


@pytest.mark.alone
def test_a_second_run_in_the_same_workdir_is_refused(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  lock = checkpoints.WorkdirLock(workdir)
  try:
    with pytest.raises(
      ValueError,
      match=rf"--workdir {workdir} is in use by another `ao-mdm "
      rf"train` \(host .*, pid {os.getpid()}, since",
    ):
      loop.train_and_evaluate(specs.parse(_small_config(data_dir, 2)), workdir)
  finally:
    lock.release()
  assert not os.path.exists(workdir)  # nothing else was written: the lock's dir goes too
  checkpoints.WorkdirLock(workdir).release()  # free again once released


@pytest.mark.alone
@pytest.mark.slow  # several processes, each interrupted at another moment
def test_ctrl_c_elsewhere_exits_130_and_leaves_no_partial_output(data_dir, tmp_path):
  """export and sample, interrupted at growing delays: each run either finished (exit 0) or
  stopped (130), never with a traceback, and whatever output exists is whole (an export that
  loads; sample records that parse: the samples finished before the Ctrl-C)."""
  run = str(tmp_path / "run")
  loop.train_and_evaluate(specs.parse(_small_config(data_dir, 2)), run)
  outcomes = []
  # Fixed delays land anywhere from the imports on; "first sample" waits for a finished sample,
  # so one run is sure to be stopped mid-work however slow the machine.
  for delay in (1.0, 2.5, 4.0, 6.0, 9.0, "first sample"):
    for command, out in (
      ("export", tmp_path / f"export{delay}"),
      ("sample", tmp_path / f"s{delay}.jsonl"),
    ):
      if delay == "first sample" and command == "export":
        continue
      args = (
        [f"--checkpoint={run}", f"--out={out}"]
        if command == "export"
        else [
          f"--checkpoint={run}",
          f"--out={out}",
          "--num_samples=100000",
          "--batch_size=1",
          "--steps=4",
        ]
      )
      proc = subprocess.Popen(
        [sys.executable, "-m", "ao_mdm.cli.main", command, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
      )
      if isinstance(delay, float):
        time.sleep(delay)
      else:
        partial, deadline = tmp_path / f"{out.name}.partial", time.time() + 120
        while not (partial.exists() and partial.stat().st_size) and time.time() < deadline:
          assert proc.poll() is None, proc.communicate()
          time.sleep(0.05)
      proc.send_signal(signal.SIGINT)
      _, err = proc.communicate(timeout=120)
      outcomes.append((command, proc.returncode, out.exists()))
      # -2: the signal came while Python was still importing, before `ao-mdm` took Ctrl-C
      # over (a shell reports that as 130 too).
      assert proc.returncode in (0, 130, -2) and "Traceback" not in err, err
      assert proc.returncode or out.exists()
      siblings = [n for n in os.listdir(tmp_path) if n.startswith(out.name) and n != out.name]
      assert not siblings, siblings  # no .tmp / .partial
      if command == "export" and out.exists():
        config, _ = checkpoints.load_params(str(out))
        assert config.train.num_steps == 2
      if command == "sample" and out.exists():
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert records and all(len(r["tokens"]) == 32 for r in records)
  # Some runs were stopped mid-work: nothing of an export, and samples kept.
  assert ("export", 130, False) in outcomes and ("sample", 130, True) in outcomes, outcomes
  # Training start-up (tokenizer, data, compile) stops too: with nothing saved, or, had the
  # loop begun (a fast machine), with a checkpoint of the step it reached.
  workdir = tmp_path / "startup"
  proc = subprocess.Popen(
    _command(str(workdir), data_dir, 100, 100),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  time.sleep(4)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode in (130, -2) and "Traceback" not in err, err
  assert ("interrupted: saved a checkpoint" in out) == bool(_complete_steps(str(workdir)))


@pytest.mark.alone
@pytest.mark.slow
def test_a_second_train_process_is_refused_and_a_second_ctrl_c_exits_at_once(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  first = _running(workdir, data_dir)
  second = subprocess.run(
    _command(workdir, data_dir, 10, 10), capture_output=True, text=True, timeout=120
  )
  errors = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
  assert second.returncode == 2 and len(errors) == 1 and "Traceback" not in second.stderr
  assert "is in use by another `ao-mdm train` (host " in errors[0]
  assert f"pid {first.pid}," in errors[0]
  first.send_signal(signal.SIGINT)
  time.sleep(0.05)
  first.send_signal(signal.SIGINT)  # exits at once, unless the save already landed
  out, err = first.communicate(timeout=60)
  assert first.returncode == 130 and "Traceback" not in err, err
  assert "interrupted again: exiting now" in err or "interrupted: saved a checkpoint" in out


@pytest.mark.alone
def test_a_second_ctrl_c_during_the_save_exits_at_once(monkeypatch):
  from ao_mdm.runtime import interrupts

  exits = []
  monkeypatch.setattr(interrupts.os, "_exit", exits.append)
  # What the process had (SIG_IGN where a non-interactive shell started it in the background).
  before = signal.getsignal(signal.SIGINT)
  stop = interrupts.StopRequest()
  try:
    assert signal.getsignal(signal.SIGINT) == stop._handle
    stop._handle(signal.SIGTERM, None)
    assert stop.requested and stop.exit_code == 0 and not exits  # preemption: save, exit 0
    stop._handle(signal.SIGINT, None)
    assert exits == [130]  # a Ctrl-C after a request: at once
  finally:
    stop.restore()
  stop = interrupts.StopRequest()
  try:
    stop._handle(signal.SIGINT, None)
    assert stop.requested and stop.exit_code == 130 and exits == [130]
  finally:
    stop.restore()
  assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.alone
def test_a_sigterm_before_the_loop_is_held_for_it(monkeypatch):
  """`ao-mdm train` holds a SIGTERM from its start (joining, restoring, compiling) for the
  loop's StopRequest, which saves at the first step boundary; Ctrl-C before it exits at once."""
  from ao_mdm.runtime import interrupts

  exits = []
  monkeypatch.setattr(interrupts.os, "_exit", exits.append)
  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    interrupts.install(hold=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)  # the handler runs at the next bytecode of the main thread
    assert not exits
    stop = interrupts.StopRequest()
    assert stop.requested and stop.exit_code == 0
    stop.restore()
    stop = interrupts.StopRequest()
    assert not stop.requested  # taken over once
    stop.restore()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)
    assert exits == [130]
  finally:
    interrupts.StopRequest().restore()  # takes over (and so drops) a SIGTERM still held
    for s, handler in before.items():
      signal.signal(s, handler)
