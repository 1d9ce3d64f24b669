"""gs:// paths against a real GCS server on 127.0.0.1 (fake-gcs-server): the storage layer, the
work-dir lock, the run's records, prepared data, and a run trained, resumed, exported, sampled
and evaluated in a bucket. Slower multi-process cases are in the slow stage."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.config import base_config
from ao_mdm.data import prepare, prepared
from ao_mdm.storage import fs, paths
from ao_mdm.storage import lease as lease_lib
from ao_mdm.train import loop, records
from helpers import ROOT, SMALL_MODEL_FLAGS, SMALL_TRAIN_FLAGS, ao_mdm, error_lines

# Those marked `alone` time bounded detections or signal processes after delays: the slow
# stage runs them one at a time, never beside another test.

TINY = f"--config={ROOT}/configs/tiny.py"


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path):
  """The same directory tests, once on the file system and once in a bucket."""
  if request.param == "local":
    return str(tmp_path / "root")
  request.getfixturevalue("gcs_server")
  return f"gs://bucket/{request.node.name.replace('[', '-').rstrip(']')}-{time.time_ns()}"


def test_files_behave_alike_locally_and_in_a_bucket(root):
  a, b = fs.join(root, "a.txt"), fs.join(root, "d", "e", "b.bin")
  assert not fs.exists(root) or not fs.listdir(root)
  fs.write_text(a, "hi")
  v1 = fs.stat(a).version
  time.sleep(0.01)  # a local mtime of another write differs
  fs.write_text(a, "hello")
  assert fs.stat(a).version != v1  # (fake-gcs-server keeps the generation on a compose)
  fs.append(a, b" world")
  fs.append(fs.join(root, "new.jsonl"), b"1\n")  # an append creates the file
  assert fs.read_text(a) == "hello world" and fs.read_text(fs.join(root, "new.jsonl")) == "1\n"
  assert fs.stat(a).size == 11
  with fs.open_write(b) as f:
    f.write(bytes(range(256)) * 100)
  assert fs.isfile(b) and not fs.isfile(fs.join(root, "d")) and fs.isdir(fs.join(root, "d"))
  assert fs.listdir(root) == ["a.txt", "d", "new.jsonl"] and fs.files(fs.join(root, "d")) == [
    "e/b.bin"
  ]
  got = [bytearray(3), bytearray(2)]
  fs.RangeReader().read([(b, 255, 258), (a, 6, 8)], [memoryview(x) for x in got])
  assert bytes(got[0]) == bytes([255, 0, 1]) and bytes(got[1]) == b"wo"
  with pytest.raises(EOFError):
    fs.RangeReader().read([(a, 5, 20)], [memoryview(bytearray(15))])
  with pytest.raises(fs.VersionMismatch):  # create-only when there is one already
    fs.write_bytes(a, b"x", if_version=0)
  fs.move(fs.join(root, "d"), fs.join(root, "moved"))
  assert not fs.exists(fs.join(root, "d")) and fs.read_bytes(fs.join(root, "moved", "e", "b.bin"))
  with pytest.raises(RuntimeError):  # an error inside leaves nothing under the name
    with fs.open_write(fs.join(root, "broken.bin")) as f:
      f.write(b"half")
      raise RuntimeError("killed")
  assert not fs.exists(fs.join(root, "broken.bin"))
  fs.rmtree(root)
  assert not fs.exists(a)


def test_misspelt_urls_are_refused_and_no_local_gs_directory_is_made(tmp_path):
  for bad in (
    "gs:/bucket/run",
    "gs:bucket",
    "gcs://bucket/run",
    "GS://bucket/run",
    "s3://b/x",
    "gs://B/x",
  ):
    with pytest.raises(ValueError, match="gs://BUCKET/PATH"):
      paths.check(bad, "--workdir")
  assert paths.check("~/x.jsonl") == os.path.expanduser("~/x.jsonl")
  out = ao_mdm("train", TINY, "--workdir=gs:/bucket/run", cwd=tmp_path)
  assert out.returncode == 2 and len(error_lines(out)) == 1 and "Traceback" not in out.stderr
  assert "did you mean gs://BUCKET/PATH" in out.stderr and os.listdir(tmp_path) == []


@pytest.mark.alone
@pytest.mark.slow  # a timed wait: beside another test (make test's 2 processes) it took 11.5 s
def test_a_missing_bucket_or_no_server_is_one_error_line_in_bounded_time(gcs_server, tmp_path):
  out = ao_mdm("train", TINY, "--workdir=gs://no-such-bucket/run")
  assert out.returncode == 2 and error_lines(out) == [
    "error: bucket gs://no-such-bucket does not exist (gs://no-such-bucket/run); create it "
    "with `gcloud storage buckets create gs://no-such-bucket`"
  ], out.stderr
  with socket.socket() as s:  # a port nothing listens on
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
  start = time.time()  # the same command answered at once: its imports and checks, no waiting
  quick = ao_mdm("sample", f"--checkpoint=gs://bucket/none/{time.time_ns()}")
  start_up = time.time() - start
  assert quick.returncode == 2 and "Traceback" not in quick.stderr, quick.stderr
  start = time.time()
  out = ao_mdm(
    "sample",
    "--checkpoint=gs://bucket/run",
    "--storage_timeout=8",
    env={"STORAGE_EMULATOR_HOST": dead, "TENSORSTORE_GCS_HTTP_URL": dead},
  )
  waited = time.time() - start - start_up
  # The bound holds for the whole command (a check, then a listing, ...), not per call.
  assert out.returncode == 2 and 7 < waited < 8 * 1.4, (waited, out.stderr)
  assert len(error_lines(out)) == 1 and "no answer from Cloud Storage" in out.stderr
  assert "within 8 s" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow  # about 15 s
@pytest.mark.alone
def test_the_lock_refuses_a_second_holder_and_takes_over_a_stale_one(gcs_server):
  path = f"gs://bucket/locks/{time.time_ns()}/train.lock"
  first = lease_lib.Lease(path, "test", lease_s=60)
  with pytest.raises(lease_lib.LeaseHeld, match=f"pid {os.getpid()},"):
    lease_lib.Lease(path, "test", lease_s=60)
  first.release()
  assert not fs.exists(path)
  run = fs.parent(path)  # the work-dir lock of `ao-mdm train` on it
  lock = checkpoints.WorkdirLock(run)
  with pytest.raises(ValueError, match=r"is in use by another `ao-mdm train` \(host "):
    checkpoints.WorkdirLock(run)
  lock.release()
  # A holder that stopped renewing 200 s ago on another host: taken over, with a line.
  fs.write_text(
    path,
    json.dumps(
      {
        "host": "elsewhere",
        "pid": 1,
        "since": time.time() - 500,
        "renewed": time.time() - 200,
        "lease_s": 120,
      }
    ),
  )
  said = []
  second = lease_lib.Lease(path, "test", lease_s=60, log=said.append)
  assert len(said) == 1 and "took over the lock" in said[0] and "not renewed for 200 s" in said[0]
  assert json.loads(fs.read_text(path))["pid"] == os.getpid()
  # The holder renews; another process taking over the lease makes it `lost`.
  fs.write_text(path, json.dumps({"host": "elsewhere", "pid": 1, "renewed": time.time()}))
  second.lease_s = 0.2
  deadline = time.time() + 20
  while not second.lost and time.time() < deadline:
    time.sleep(0.05)
  assert second.lost
  second.release()
  # A dead process of this host is no holder: taken over at once.
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  fs.write_text(
    path,
    json.dumps(
      {"host": socket.gethostname(), "pid": proc.pid, "renewed": time.time(), "lease_s": 120}
    ),
  )
  said = []
  lease_lib.Lease(path, "test", log=said.append).release()
  assert "its process is gone" in said[0]


def test_records_are_appended_and_read_back_by_tensorboard_framing(root):
  log = records.RunLog(root)
  log.scalars(1, {"loss": 2.5, "nan": float("nan")})
  log.text(1, "config", "c = 1")
  log.flush()
  log.scalars(2, {"loss": 2.0})
  log.flush()
  lines = [json.loads(x) for x in fs.read_text(fs.join(root, "metrics.jsonl")).splitlines()]
  assert lines == [{"step": 1, "loss": 2.5, "nan": None}, {"step": 2, "loss": 2.0}]
  from tensorboard.compat.proto import event_pb2

  events = [
    event_pb2.Event.FromString(r) for r in records.read_tfrecords(fs.read_bytes(log.events))
  ]
  scalars = [
    (e.step, v.tag, v.simple_value)
    for e in events
    for v in e.summary.value
    if v.HasField("simple_value")
  ]
  assert events[0].file_version == "brain.Event:2"
  assert (1, "loss", 2.5) in scalars and (2, "loss", 2.0) in scalars
  # TensorBoard's own reader (without TensorFlow: fsspec, so gcsfs for gs://) sees the points.
  from tensorboard.backend.event_processing import event_accumulator

  seen = event_accumulator.EventAccumulator(fs.parent(log.events)).Reload()
  assert [(e.step, e.value) for e in seen.Scalars("loss")] == [(1, 2.5), (2, 2.0)]
  records.drop_after(root, 1)
  assert fs.read_text(fs.join(root, "metrics.jsonl")).count("\n") == 1


def _text_config(corpus, tfds_dir, prepared_dir):
  return specs.default().data.replace(
    dataset="text_file", text_file=str(corpus), tfds_dir=str(tfds_dir), prepared_dir=prepared_dir
  )


def test_prepare_into_a_bucket_is_byte_identical_to_local(gcs_server, sp_tokenizer, tmp_path):
  from ao_mdm.data import corpus

  text = tmp_path / "docs.txt"
  docs = corpus.sotu_documents("train")[:40]
  text.write_text("\n".join(d.replace("\n", " ") for d in docs) + "\n")
  local = prepare.prepare(
    _text_config(text, tmp_path / "tfds", str(tmp_path / "p")),
    sp_tokenizer,
    "train",
    workers=1,
    shard_docs=8,
  )
  bucket = f"gs://bucket/prepared-{time.time_ns()}"
  remote = prepare.prepare(
    _text_config(text, tmp_path / "tfds", bucket), sp_tokenizer, "train", workers=2, shard_docs=8
  )
  names = [n for n in fs.files(local.directory) if n != prepared.VERIFIED]
  assert len(names) > 10 and names == [
    n for n in fs.files(remote.directory) if n != prepared.VERIFIED
  ]
  for name in names:
    want = fs.read_bytes(fs.join(local.directory, name))
    assert fs.read_bytes(fs.join(remote.directory, name)) == want, name
  blocks_l, blocks_r = local.blocks(32), remote.blocks(32)
  rows = [5, 0, len(blocks_l) - 1, 17]
  np.testing.assert_array_equal(blocks_r.rows(rows), blocks_l.rows(rows))
  # The verification cache follows the manifest: a changed sha256 there forces a re-hash.
  manifest = fs.read_json(fs.join(remote.directory, prepared.MANIFEST))
  manifest["shards"][1]["sha256"] = "0" * 64
  fs.write_json(fs.join(remote.directory, prepared.MANIFEST), manifest)
  with pytest.raises(prepared.CorruptShard, match="shard-00001.bin has sha256"):
    prepared.verify(remote.directory, manifest)


def _config(tfds_dir, steps):
  c = base_config()
  c.model.update(vocab_size=512, block_size=32, n_layer=2, n_embd=32, n_head=2, cond_dim=32)
  c.train.update(
    batch_size=8,
    num_steps=steps,
    warmup_steps=2,
    log_every=1,
    eval_batches=1,
    eval_every=0,
    checkpoint_every=2,
    keep_checkpoints=2,
    lr_decay_steps=6,
  )
  c.data.tfds_dir = tfds_dir
  return c


@pytest.mark.slow  # a run, its resume, export, sample and eval in the bucket (about a minute)
def test_a_run_in_a_bucket_resumes_exactly_and_serves_export_sample_eval(
  gcs_server, data_dir, tmp_path
):
  run = f"gs://bucket/runs/{time.time_ns()}"
  straight = str(tmp_path / "straight")
  loop.train_and_evaluate(specs.parse(_config(data_dir, 6)), straight)
  loop.train_and_evaluate(specs.parse(_config(data_dir, 4)), run)
  assert sorted(n for n in fs.listdir(fs.join(run, "checkpoints")) if n.isdigit()) == ["2", "4"]
  resumed = loop.train_and_evaluate(specs.parse(_config(data_dir, 6)), run)
  assert "initial" not in resumed
  assert sorted(n for n in fs.listdir(fs.join(run, "checkpoints"))) == ["4", "6"]  # keep-N
  for weights in ("params", "ema"):
    _, want = checkpoints.load_params(straight, weights)
    _, got = checkpoints.load_params(run, weights)
    jax.tree.map(np.testing.assert_array_equal, got, want)
  losses = lambda d: {
    r["step"]: r["loss"]
    for r in map(json.loads, fs.read_text(fs.join(d, "metrics.jsonl")).splitlines())
    if "loss" in r
  }
  assert losses(run) == losses(straight) and sorted(losses(run)) == [1, 2, 3, 4, 5, 6]
  assert fs.listdir(fs.join(run, "tensorboard")) and not fs.exists(fs.join(run, "train.lock"))

  export = f"{run}-export"
  out = ao_mdm("export", f"--checkpoint={run}", f"--out={export}")
  assert out.returncode == 0 and fs.isfile(fs.join(export, "0", "commit_success.txt")), out.stderr
  samples = f"{run}-samples/s.jsonl"
  out = ao_mdm(
    "sample", f"--checkpoint={export}", "--num_samples=2", "--steps=4", f"--out={samples}"
  )
  assert out.returncode == 0 and len(fs.read_text(samples).splitlines()) == 2, out.stderr
  out = ao_mdm("eval", f"--checkpoint={run}", "--protocol=custom", "--max_blocks=4", "--orders=1")
  assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1])["sotu"]["tokens"] > 0, (
    out.stderr
  )


SMALL = [*SMALL_TRAIN_FLAGS, "--config.train.eval_every=0", "--config.train.lr_decay_steps=6"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two(command: str, *args) -> list:
  """The same command as two local processes of 2 CPU devices each, started at once."""
  port = _free_port()
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
  }
  flags = [f"--coordinator=127.0.0.1:{port}"] if command == "train" else []
  return [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "ao_mdm.cli.main",
        command,
        *args,
        *flags,
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


def _wait(procs, timeout=400) -> list:
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, f"{p.args}\n{out[-2000:]}\n{err[-3000:]}"
  return [out for out, _ in outs]


def _steps(run) -> list:
  d = fs.join(run, "checkpoints")
  return (
    sorted(
      int(n)
      for n in fs.listdir(d)
      if n.isdigit() and fs.isfile(fs.join(d, n, "commit_success.txt"))
    )
    if fs.isdir(d)
    else []
  )


@pytest.mark.alone
@pytest.mark.slow  # seven two-process runs, about four minutes
def test_two_processes_prepare_and_train_in_a_bucket_and_resume_exactly_after_sigkill(
  gcs_server, data_dir, tmp_path
):
  base = f"gs://bucket/mp-{time.time_ns()}"
  data = [
    f"--config={ROOT}/configs/tiny.py",
    f"--config.data.tfds_dir={data_dir}",
    f"--config.data.prepared_dir={base}/prepared",
    SMALL[0],
  ]
  # Two hosts prepare disjoint shard ranges into the bucket; the result is the local one's.
  _wait(_two("prepare", *data, f"--workdir={base}/tokenizer_run", "--splits=train"))
  _wait(_two("prepare", *data, f"--workdir={base}/tokenizer_run", "--splits=train"))
  local = ao_mdm(
    "prepare",
    *data[:2],
    f"--config.data.prepared_dir={tmp_path / 'p'}",
    SMALL[0],
    f"--workdir={tmp_path / 'tok'}",
    "--splits=train",
  )
  assert local.returncode == 0, local.stderr
  remote_dir = fs.join(base, "prepared", "sotu")
  local_dir = str(tmp_path / "p" / "sotu")
  names = [n for n in fs.files(local_dir) if not n.endswith(prepared.VERIFIED)]
  assert names and names == [n for n in fs.files(remote_dir) if not n.endswith(prepared.VERIFIED)]
  for name in names:
    assert fs.read_bytes(fs.join(remote_dir, name)) == fs.read_bytes(fs.join(local_dir, name))

  run = lambda workdir, steps: [
    *data,
    f"--workdir={workdir}",
    *SMALL,
    f"--config.train.num_steps={steps}",
    "--config.train.checkpoint_every=3",
  ]
  straight, killed = f"{base}/straight", f"{base}/killed"
  _wait(_two("train", *run(straight, 6)))
  procs = _two("train", *run(killed, 6))
  deadline = time.time() + 400
  while 3 not in _steps(killed) and time.time() < deadline and all(p.poll() is None for p in procs):
    time.sleep(0.2)
  for p in procs:
    p.kill()
    p.wait()
  assert 3 in _steps(killed)
  for step in _steps(killed):  # a kill after step 3 is the same as a kill before it
    if step > 3:
      fs.rmtree(fs.join(killed, "checkpoints", str(step)))
  outs = _wait(_two("train", *run(killed, 6)))
  assert "resumed from step 3" in outs[0]
  losses = lambda d: (
    {
      r["step"]: r["loss"]
      for r in map(json.loads, fs.read_text(fs.join(d, "metrics.jsonl")).splitlines())
      if "loss" in r
    }
    if fs.isfile(fs.join(d, "metrics.jsonl"))
    else {}
  )

  def same_as_straight(workdir):
    assert losses(straight) == losses(workdir) and sorted(losses(workdir)) == [1, 2, 3, 4, 5, 6]
    for weights in ("params", "ema"):
      _, want = checkpoints.load_params(straight, weights)
      _, got = checkpoints.load_params(workdir, weights)
      jax.tree.map(np.testing.assert_array_equal, got, want)

  same_as_straight(killed)
  # SIGTERM to one of the two processes: both save the same step in the bucket and exit 0.
  stopped = f"{base}/stopped"
  procs = _two("train", *run(stopped, 6), "--config.train.checkpoint_every=100")
  deadline = time.time() + 400
  while not losses(stopped) and time.time() < deadline and all(p.poll() is None for p in procs):
    time.sleep(0.2)
  procs[1].send_signal(signal.SIGTERM)
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[1][1][-3000:]
  step = int(outs[0][0].split("preempted: saved a checkpoint at step ")[1].split()[0])
  assert _steps(stopped) == [step] and step < 6
  _wait(_two("train", *run(stopped, 6), "--config.train.checkpoint_every=100"))
  same_as_straight(stopped)


@pytest.mark.alone
@pytest.mark.slow  # three CLI runs and an export, about a minute
def test_in_a_bucket_an_unreadable_step_is_set_aside_and_ctrl_c_leaves_no_export(
  gcs_server, data_dir
):
  run = f"gs://bucket/aside-{time.time_ns()}"
  args = [
    TINY,
    f"--workdir={run}",
    f"--config.data.tfds_dir={data_dir}",
    *SMALL,
    "--config.train.checkpoint_every=2",
    "--config.train.keep_checkpoints=2",
  ]
  assert ao_mdm("train", *args, "--config.train.num_steps=4").returncode == 0
  state = fs.join(run, "checkpoints", "4", "state")
  for name in fs.files(state):  # the newest step loses its array data
    if "/d/" in f"/{name}":
      fs.remove(fs.join(state, name))
  out = ao_mdm("train", *args, "--config.train.num_steps=6")
  assert out.returncode == 0, out.stderr
  assert (
    "resumed from step 2" in out.stdout and "moved checkpoints/4 (unreadable) aside" in out.stdout
  )
  assert _steps(run) == [4, 6] and len(fs.listdir(fs.join(run, "checkpoints_set_aside"))) == 1
  # Ctrl-C during an export to the bucket: nothing is left that reads as an export.
  out_dir = f"{run}-export"
  proc = subprocess.Popen(
    [sys.executable, "-m", "ao_mdm.cli.main", "export", f"--checkpoint={run}", f"--out={out_dir}"],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  deadline = time.time() + 120
  while not fs.exists(out_dir) and time.time() < deadline and proc.poll() is None:
    time.sleep(0.02)
  proc.send_signal(2)
  _, err = proc.communicate(timeout=120)
  assert "Traceback" not in err, err
  if proc.returncode == 130:
    assert not fs.exists(out_dir), fs.files(out_dir)
  else:  # the export finished before the signal: then it is complete
    assert proc.returncode == 0 and fs.isfile(fs.join(out_dir, "0", "commit_success.txt"))


def test_gs_paths_without_credentials_are_one_error_line(tmp_path):
  env = {
    k: ""
    for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")
  }
  env.update(
    GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "none.json"),
    HOME=str(tmp_path),
    CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
    GCE_METADATA_HOST="127.0.0.1:9",
  )
  start = time.time()
  out = ao_mdm("sample", "--checkpoint=gs://bucket/run", "--storage_timeout=5", env=env)
  assert out.returncode == 2 and len(error_lines(out)) == 1 and "Traceback" not in out.stderr
  assert time.time() - start < 60 and "credentials" in out.stderr, out.stderr


@pytest.mark.alone
@pytest.mark.slow  # a training run against its own server, stopped mid-run (about 40 s)
def test_a_server_that_stops_answering_ends_training_with_one_line_in_bounded_time(data_dir):
  """The server SIGSTOPped at step 12 (connections open, nothing answered), then SIGTERM to
  the run: it ends with one error line naming the newest complete step, within the bound
  (--storage_timeout plus the probe interval and a step), not hung in Orbax's writers."""
  from ao_mdm.storage import emulator

  server = emulator.LocalServer(("bucket",))
  env = {**os.environ, **server.env(), "JAX_PLATFORMS": "cpu"}
  small = [
    *SMALL_MODEL_FLAGS,
    "--config.train.batch_size=8",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
    "--config.train.checkpoint_every=5",
    "--config.train.num_steps=1000",
    f"--config.data.tfds_dir={data_dir}",
  ]
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "ao_mdm.cli.main",
      "train",
      TINY,
      "--workdir=gs://bucket/run",
      "--storage_timeout=10",
      *small,
    ],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    for line in proc.stdout:  # the run's own progress lines
      if line.startswith("step 12:"):
        break
    server._proc.send_signal(signal.SIGSTOP)
    stopped = time.time()
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    waited = time.time() - stopped
  finally:
    server._proc.send_signal(signal.SIGCONT)
    if proc.poll() is None:
      proc.kill()
    server.stop()
  lines = err.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, err[-3000:]
  assert "no answer from Cloud Storage" in lines[0] and "within 10 s" in lines[0]
  assert "training stopped: the newest complete checkpoint is step " in lines[0]
  assert waited < 10 + checkpoints.PROBE_S + 10, waited


def test_the_newest_complete_step_is_the_one_orbax_lists(root):
  """layout.newest_complete_step (what a lost run's line names) follows Orbax's rule, locally
  and in a bucket: an unfinished write (a temporary name; on gs://, no commit mark) is not one."""
  import orbax.checkpoint as ocp

  from ao_mdm.checkpoint import layout

  directory = fs.join(root, layout.CHECKPOINTS)
  assert layout.newest_complete_step(root) is None
  mgr = checkpoints.manager(directory, max_to_keep=None, async_save=False, item_names=("config",))
  for step in (3, 6):
    mgr.save(step, args=ocp.args.Composite(config=ocp.args.JsonSave({"step": step})))
  mgr.close()
  unfinished = "9" if fs.is_gcs(root) else "9.orbax-checkpoint-tmp-1234567890"
  fs.write_text(fs.join(directory, unfinished, "config", "metadata"), "{}")
  assert checkpoints.manager(directory, item_names=("config",)).all_steps() == [3, 6]
  assert layout.newest_complete_step(root) == 6
