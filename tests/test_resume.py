"""Exact resume after SIGKILL, clean exit on SIGTERM, and skipping a corrupted checkpoint."""
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

from ao_mdm import checkpoints, train
from ao_mdm.config import base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.model.vocab_size=512", "--config.model.block_size=32",
         "--config.model.n_layer=2", "--config.model.n_embd=32", "--config.model.n_head=2",
         "--config.train.batch_size=8", "--config.train.warmup_steps=2",
         "--config.train.log_every=1", "--config.train.eval_batches=1",
         "--config.train.eval_every=0"]


def _command(workdir, tfds_dir, steps, every):
  return [sys.executable, "-m", "ao_mdm.main", "train", f"--config={ROOT}/configs/tiny.py",
          f"--workdir={workdir}", f"--config.data.tfds_dir={tfds_dir}",
          f"--config.train.num_steps={steps}", f"--config.train.checkpoint_every={every}", *SMALL]


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


@pytest.mark.slow  # three training processes; test_train covers resume in-process by default
def test_exact_resume_after_sigkill(data_dir, tmp_path):
  """`ao-mdm prepare`, then a straight run and a run killed and resumed read the same blocks."""
  straight = str(tmp_path / "straight")
  prepared_dir = f"--config.data.prepared_dir={tmp_path / 'prepared'}"
  cmd = _command(straight, data_dir, 6, 3)  # [python, -m, ao_mdm.main, train, config, workdir, tfds]
  prepare = subprocess.run(cmd[:3] + ["prepare"] + cmd[4:7] + [prepared_dir, SMALL[0]],
                           capture_output=True, text=True, timeout=300)
  assert prepare.returncode == 0 and "train: " in prepare.stdout, prepare.stderr
  subprocess.run(_command(straight, data_dir, 6, 3) + [prepared_dir], check=True,
                 capture_output=True, timeout=300)
  killed = str(tmp_path / "killed")
  proc = subprocess.Popen(_command(killed, data_dir, 6, 3) + [prepared_dir],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  deadline = time.time() + 300
  while 3 not in _complete_steps(killed) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert 3 in _complete_steps(killed)
  for step in _complete_steps(killed):  # a kill after step 3 is the same as a kill before it
    if step > 3:
      shutil.rmtree(os.path.join(killed, "checkpoints", str(step)))
  resumed = subprocess.run(_command(killed, data_dir, 6, 3) + [prepared_dir], check=True,
                           capture_output=True, text=True, timeout=300)
  assert "resumed from step 3" in resumed.stdout and "prepared" not in resumed.stdout
  a, b = _losses(straight), _losses(killed)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
  assert a == b  # bitwise: the same floats, including the data order after the restart
  for weights in ("params", "ema"):
    _, pa = checkpoints.load_params(straight, weights)
    _, pb = checkpoints.load_params(killed, weights)
    jax.tree.map(np.testing.assert_array_equal, pa, pb)


def test_sigterm_saves_at_step_boundary_and_exits_zero(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(_command(workdir, data_dir, 100000, 100000), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 300
  while not os.path.exists(os.path.join(workdir, "metrics.jsonl")) and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out
  steps = _complete_steps(workdir)
  assert len(steps) == 1 and "preempted: saved a checkpoint at step" in out
  config, params = checkpoints.load_params(workdir, "params")
  assert config.train.num_steps == 100000


def _small_config(tfds_dir, steps):
  c = base_config()
  c.model.update(vocab_size=512, block_size=32, n_layer=2, n_embd=32, n_head=2)
  c.train.update(batch_size=8, num_steps=steps, warmup_steps=2, log_every=1, eval_batches=1,
                 eval_every=0, checkpoint_every=2)
  c.data.tfds_dir = tfds_dir
  return c


def test_corrupted_latest_checkpoint_is_skipped(data_dir, tmp_path, capsys):
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(_small_config(data_dir, 4), workdir)
  assert _complete_steps(workdir) == [2, 4]
  state_dir = os.path.join(workdir, "checkpoints", "4", "state")
  for root, _, files in os.walk(state_dir):  # truncate every file of the latest state
    for name in files:
      with open(os.path.join(root, name), "r+b") as f:
        f.truncate(3)
  capsys.readouterr()
  train.train_and_evaluate(_small_config(data_dir, 5), workdir)
  out = capsys.readouterr().out
  assert "skipped checkpoint step 4" in out and "cannot be restored" in out
  assert "resumed from step 2" in out


def test_workdir_with_other_model_shape_is_refused(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(_small_config(data_dir, 2), workdir)
  other = _small_config(data_dir, 4)
  other.model.n_embd = 64
  with pytest.raises(ValueError, match="different model: model.n_embd: checkpoint 32 vs config 64"):
    train.train_and_evaluate(other, workdir)


def test_unknown_config_override_is_refused(tmp_path):
  out = subprocess.run([sys.executable, "-m", "ao_mdm.main", "train",
                        f"--config={ROOT}/configs/tiny.py", f"--workdir={tmp_path}",
                        "--config.train.num_stepz=3"], capture_output=True, text=True, timeout=120)
  assert out.returncode != 0 and "num_stepz" in out.stderr


def _steps_in(directory):
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def test_unreadable_and_foreign_steps_are_set_aside_and_saving_goes_on(data_dir, tmp_path,
                                                                       capsys):
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(_small_config(data_dir, 4), workdir)
  ckpts = os.path.join(workdir, "checkpoints")
  for root, _, files in os.walk(os.path.join(ckpts, "4", "state")):
    for name in files:
      with open(os.path.join(root, name), "r+b") as f:
        f.truncate(3)
  os.makedirs(os.path.join(ckpts, "9", "params"))  # e.g. `export --out=WORKDIR/checkpoints/9`
  os.makedirs(os.path.join(ckpts, "5.orbax-checkpoint-tmp-1234", "state"))  # a killed write
  capsys.readouterr()
  train.train_and_evaluate(_small_config(data_dir, 6), workdir)
  out = capsys.readouterr().out
  assert "removed checkpoints/5.orbax-checkpoint-tmp-1234" in out
  assert "moved checkpoints/9 (not-a-training-checkpoint) aside" in out
  assert "skipped checkpoint step 4" in out and "moved checkpoints/4 (unreadable) aside" in out
  assert "resumed from step 2" in out
  assert sorted(os.listdir(ckpts)) == ["2", "4", "6"]  # saved past them, nothing else left
  aside = sorted(os.listdir(os.path.join(workdir, "checkpoints_set_aside")))
  assert [n.split(".")[:2] for n in aside] == [["4", "unreadable"],
                                              ["9", "not-a-training-checkpoint"]]
  steps = [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl"))
           if "loss" in line]
  assert steps == [1, 2, 3, 4, 5, 6]  # the first run's steps 3-4 were dropped on resume


def test_every_checkpoint_unreadable_stops_unless_start_over(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(_small_config(data_dir, 2), workdir)
  for root, _, files in os.walk(os.path.join(workdir, "checkpoints", "2", "config")):
    for name in files:
      open(os.path.join(root, name), "w").close()
  with pytest.raises(ValueError, match=r"no checkpoint in .* can be read \(steps 2, each listed "
                                       r"above\); they are left as they are.*--start_over"):
    train.train_and_evaluate(_small_config(data_dir, 2), workdir)
  assert _steps_in(os.path.join(workdir, "checkpoints")) == [2]
  result = train.train_and_evaluate(_small_config(data_dir, 2), workdir, start_over=True)
  assert "initial" in result  # trained from step 0
  assert _steps_in(os.path.join(workdir, "checkpoints")) == [2]
  assert os.listdir(os.path.join(workdir, "checkpoints_set_aside"))[0].startswith("2.unreadable")


def test_a_second_run_in_the_same_workdir_is_refused(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  lock = checkpoints.WorkdirLock(workdir)
  try:
    with pytest.raises(ValueError, match=rf"--workdir {workdir} is in use by another `ao-mdm "
                                         rf"train` \(host .*, pid {os.getpid()}, since"):
      train.train_and_evaluate(_small_config(data_dir, 2), workdir)
  finally:
    lock.release()
  assert not os.path.exists(workdir)  # nothing else was written: the lock's dir goes too
  checkpoints.WorkdirLock(workdir).release()  # free again once released


def test_ctrl_c_saves_at_a_step_boundary_and_exits_130(data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(_command(workdir, data_dir, 100000, 100000), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while not os.path.exists(os.path.join(workdir, "metrics.jsonl")) and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err
  assert "interrupted: saved a checkpoint at step" in out and "Traceback" not in err
  steps = _complete_steps(workdir)
  assert len(steps) == 1 and not [n for n in os.listdir(os.path.join(workdir, "checkpoints"))
                                  if "tmp" in n]
