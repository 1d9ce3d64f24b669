"""The training loop end to end on the embedded corpus, at a very small size."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.config import base_config
from ao_mdm.train import loop
from ao_mdm.train import state as train_state


def small_config(tfds_dir, steps=30):
  c = base_config()
  c.model.update(vocab_size=512, block_size=32, n_layer=2, n_embd=32, n_head=2)
  c.train.update(
    batch_size=8,
    num_steps=steps,
    warmup_steps=5,
    log_every=10,
    checkpoint_every=10,
    eval_batches=2,
    learning_rate=1e-2,
    min_lr=1e-3,
  )
  c.data.tfds_dir = tfds_dir
  return c


def test_train_reduces_loss_and_resumes(data_dir, tmp_path, capsys, monkeypatch):
  cfg = small_config(data_dir, steps=20)
  workdir = str(tmp_path / "run")
  logged_at_save = []  # a saved step's record is written before its checkpoint, not after
  real_save = checkpoints.save

  def save(mgr, step, *args, **kwargs):
    with open(f"{workdir}/metrics.jsonl") as f:
      logged_at_save.append((step, [json.loads(line)["step"] for line in f if '"loss"' in line]))
    return real_save(mgr, step, *args, **kwargs)

  monkeypatch.setattr(checkpoints, "save", save)
  first = loop.train_and_evaluate(specs.parse(cfg), workdir)
  assert logged_at_save == [(10, [10]), (20, [10, 20])]
  for split in ("train", "validation"):
    for kind in ("l2r", "random"):
      assert first["final_ema"][split][kind] < first["initial"][split][kind] - 0.5
  out = capsys.readouterr().out
  assert "step 10:" in out and "tokens_per_s=" in out and "final eval" in out
  assert "measured matmul peak" in out and " mfu=" in out  # MFU on CPU too

  def no_nan(name):
    raise ValueError(f"metrics.jsonl holds {name}, which is not JSON")

  with open(f"{workdir}/metrics.jsonl") as f:
    rows = [json.loads(line, parse_constant=no_nan) for line in f]
  assert [r["step"] for r in rows if "loss" in r] == [10, 20]
  # A longer run in the same work dir continues from the saved step.
  cfg.train.num_steps = 30
  second = loop.train_and_evaluate(specs.parse(cfg), workdir)
  assert "initial" not in second
  assert "resumed from step 20" in capsys.readouterr().out
  config, ema = checkpoints.load_params(workdir)
  assert config.train.num_steps == 30
  assert jax.tree.structure(ema) == jax.tree.structure(
    checkpoints.abstract_params(specs.parse(cfg).model)
  )


def test_export_roundtrip(data_dir, tmp_path):
  cfg = small_config(data_dir, steps=2)
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(specs.parse(cfg), workdir)
  _, ema = checkpoints.load_params(workdir, "ema")
  out = checkpoints.export(workdir, str(tmp_path / "export"))
  config, exported = checkpoints.load_params(out)
  assert (config.model.n_embd, config.model.vocab_size) == (32, 512)
  jax.tree.map(np.testing.assert_array_equal, ema, exported)
  with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
    checkpoints.export(workdir, out)


@pytest.mark.slow  # a training run of its own (10-25 s)
def test_checkpoints_keep_the_ema_apart_and_older_ones_still_load(data_dir, tmp_path):
  """A step holds `ema` beside `state` (the rest of the train state); `load_params` reads only
  the set it is asked for, and a checkpoint with the EMA inside `state` (before the split) loads
  for sampling and for resuming alike."""
  cfg = small_config(data_dir, steps=2)
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(specs.parse(cfg), workdir)
  step_dir = os.path.join(workdir, "checkpoints", "2")
  assert {"state", "ema", "data", "config"} <= set(os.listdir(step_dir))
  state = checkpoints.restore(
    checkpoints.train_manager(workdir), 2, train_state.abstract_state(specs.parse(cfg))
  )
  equal = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
  equal(checkpoints.load_params(workdir, "ema")[1], state.ema_params)
  equal(checkpoints.load_params(workdir, "params")[1], state.params)
  assert not np.array_equal(state.params["token_embed"], state.ema_params["token_embed"])
  shutil.move(os.path.join(step_dir, "state"), str(tmp_path / "state"))  # the EMA alone is read
  equal(checkpoints.load_params(workdir, "ema", log=print)[1], state.ema_params)
  old = str(tmp_path / "old")  # the layout before the split: the EMA inside `state`
  mgr = ocp.CheckpointManager(os.path.join(old, "checkpoints"), item_names=("state", "config"))
  mgr.save(
    2,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(json.loads(cfg.to_json()))
    ),
  )
  mgr.wait_until_finished()
  equal(checkpoints.load_params(old, "ema")[1], state.ema_params)
  equal(checkpoints.load_params(old, "params")[1], state.params)
  equal(
    checkpoints.restore(
      checkpoints.train_manager(old), 2, train_state.abstract_state(specs.parse(cfg))
    ),
    state,
  )


def test_bad_train_configs(data_dir, tmp_path):
  cfg = small_config(data_dir)
  cfg.train.microbatches = 3
  with pytest.raises(
    ValueError, match="train.batch_size=8 is not divisible by train.microbatches=3"
  ):
    loop.train_and_evaluate(specs.parse(cfg), str(tmp_path))
  cfg = small_config(data_dir)
  cfg.order.kind = "spiral"
  with pytest.raises(ValueError, match="order.kind='spiral'"):
    loop.train_and_evaluate(specs.parse(cfg), str(tmp_path))


# The authors decay exactly their >= 2-D tensors (configure_optimizers: p.dim() >= 2). Written out
# by hand from their parameter list (docs/checkpoints.md), not recomputed by our rule.
DECAYED = {
  "ao": {
    "token_embed",
    "pos_embed",
    "none_embed",
    "target_embed",
    "blocks/adaln/kernel",
    "blocks/qkv/kernel",
    "blocks/attn_out/kernel",
    "blocks/mlp_in/kernel",
    "blocks/mlp_out/kernel",
    "final_adaln/kernel",
    "head/kernel",
  },
  "sigma": {
    "token_embed",
    "pos_embed",
    "none_embed",
    "target_embed",
    "blocks/qkv/kernel",
    "blocks/attn_out/kernel",
    "blocks/mlp_in/kernel",
    "blocks/mlp_out/kernel",
  },
}


@pytest.mark.parametrize("variant", ["ao", "sigma"])
def test_weight_decay_hits_exactly_the_authors_tensors(variant):
  """A step with zero gradients and lr > 0 shrinks the decayed leaves and leaves the rest."""
  from flax import traverse_util
  import flax.linen as nn

  from ao_mdm import model

  c = base_config()
  c.model.update(variant=variant, vocab_size=256, block_size=16, n_layer=2, n_embd=32, n_head=2)
  c.train.update(warmup_steps=0, learning_rate=0.1, min_lr=0.1, weight_decay=0.5)
  c = specs.parse(c)
  params = nn.unbox(model.init_params(c.model, jax.random.key(0)))
  # Norm scales start at one and biases at zero; make every leaf non-zero so decay shows.
  params = jax.tree.map(lambda x: x + 0.5, params)
  flat = traverse_util.flatten_dict(params, sep="/")
  mask = traverse_util.flatten_dict(train_state.weight_decay_mask(params), sep="/")
  assert {k for k, v in mask.items() if v} == DECAYED[variant]
  tx = train_state.make_optimizer(c.train)
  updates, _ = tx.update(jax.tree.map(np.zeros_like, params), tx.init(params), params)
  new = traverse_util.flatten_dict(jax.tree.map(lambda p, u: p + u, params, updates), sep="/")
  shrunk = {k for k in flat if np.all(np.abs(new[k]) < np.abs(flat[k]))}
  unchanged = {k for k in flat if np.array_equal(new[k], flat[k])}
  assert shrunk == DECAYED[variant] and unchanged == set(flat) - DECAYED[variant]
  k = "token_embed"  # AdamW: p <- p - lr * wd * p
  np.testing.assert_allclose(new[k], flat[k] * (1 - 0.1 * 0.5), rtol=1e-6)


def test_cosine_horizon_past_num_steps():
  """lr_decay_steps sets the cosine's end, independent of num_steps (the order study's 20k/500k)."""
  c = dataclasses.replace(
    specs.default().train,
    num_steps=100,
    warmup_steps=10,
    learning_rate=1.0,
    min_lr=0.0,
    lr_decay_steps=1010,
  )
  lr = train_state.learning_rate_schedule(c)
  # By hand: warmup is linear to 1.0 at step 10; halfway through the cosine (step 510) it is 0.5.
  assert float(lr(5)) == pytest.approx(0.5) and float(lr(10)) == pytest.approx(1.0)
  assert float(lr(510)) == pytest.approx(0.5, abs=1e-6)
  assert float(lr(100)) == pytest.approx(0.980147, rel=1e-5)  # 0.5 (1 + cos(0.09 pi))
  c = dataclasses.replace(c, lr_decay_steps=0)
  assert float(train_state.learning_rate_schedule(c)(100)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow  # a training run of its own (10-25 s)
def test_a_profile_window_writes_a_trace_that_names_the_train_steps(data_dir, tmp_path):
  import glob
  import gzip

  cfg = small_config(data_dir, steps=3)
  cfg.train.update(profile_start_step=1, profile_steps=2)
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(specs.parse(cfg), workdir)
  runs = glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*"))
  assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "*_0.xplane.pb"))
  trace = json.load(gzip.open(glob.glob(os.path.join(runs[0], "*_0.trace.json.gz"))[0]))
  steps = [e["args"]["step_num"] for e in trace["traceEvents"] if e.get("name") == "train"]
  assert steps == ["1", "2"]  # steps 0-based: the window's two, each annotated


@pytest.mark.slow  # a training run of its own (10-25 s)
def test_logged_metrics_are_the_means_of_their_window(data_dir, tmp_path, capsys):
  """A step logged every 4 shows the mean of its 4 steps' metrics (clu.metrics; loss_l2r over
  the steps whose batch held L2R sequences), checked against the same run logged every step;
  the parameter table is printed and written to TensorBoard."""

  def run(name, log_every):
    cfg = small_config(data_dir, steps=8)
    cfg.order.update(kind="mixed", random_ratio=0.5)
    cfg.train.update(log_every=log_every, eval_every=0, checkpoint_every=100, eval_batches=1)
    loop.train_and_evaluate(specs.parse(cfg), str(tmp_path / name))
    with open(tmp_path / name / "metrics.jsonl") as f:
      return {r["step"]: r for r in map(json.loads, f) if "loss" in r}

  every, fours = run("every", 1), run("fours", 4)
  assert sorted(fours) == [4, 8] and sorted(every) == list(range(1, 9))
  for end in (4, 8):
    steps = [every[s] for s in range(end - 3, end + 1)]
    for key in ("loss", "loss_any_order", "l2r_fraction", "grad_norm"):
      np.testing.assert_allclose(fours[end][key], np.mean([r[key] for r in steps]), rtol=1e-5)
    with_l2r = [r["loss_l2r"] for r in steps if "loss_l2r" in r]
    if with_l2r:
      np.testing.assert_allclose(fours[end]["loss_l2r"], np.mean(with_l2r), rtol=1e-5)
    assert fours[end]["learning_rate"] == every[end]["learning_rate"]  # the last, not a mean
  assert not np.isclose(fours[4]["loss"], every[4]["loss"])  # a mean, not the step's own
  out = capsys.readouterr().out
  assert "| blocks/qkv/kernel" in out and "| Sharding" in out
  events = os.listdir(tmp_path / "fours" / "tensorboard")
  assert events and any(
    b"blocks/qkv/kernel" in (tmp_path / "fours" / "tensorboard" / e).read_bytes() for e in events
  )


def _wandb_history(path: str) -> list:
  """The history rows of a wandb run file (LevelDB log records of protobuf Records, after the
  7-byte ':W&B' header): what wandb would upload."""
  import struct

  from wandb.proto import wandb_internal_pb2

  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  pos, block, part, rows = 7, 32768, b"", []
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
    if kind in (1, 4):  # a full record, or the last piece of one
      record = wandb_internal_pb2.Record.FromString(part)
      part = b""
      if record.WhichOneof("record_type") == "history":
        rows.append(
          {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        )
  return rows


@pytest.mark.slow  # a training run of its own (10-25 s)
def test_wandb_gets_the_logged_metrics(data_dir, tmp_path, monkeypatch):
  """train.wandb_project with WANDB_MODE=offline: the run file under WORKDIR/wandb holds every
  logged step's metrics, equal to metrics.jsonl's."""
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  cfg = small_config(data_dir, steps=4)
  cfg.train.update(log_every=2, eval_every=0, eval_batches=1, wandb_project="ao-mdm-test")
  workdir = tmp_path / "run"
  loop.train_and_evaluate(specs.parse(cfg), str(workdir))
  files = list(workdir.glob("wandb/offline-run-*/run-*.wandb"))
  assert len(files) == 1
  logged = {r["_step"]: r for r in _wandb_history(str(files[0])) if "_step" in r}
  with open(workdir / "metrics.jsonl") as f:
    want = {r["step"]: r for r in map(json.loads, f) if "loss" in r}
  assert sorted(want) == [2, 4] and set(want) <= set(logged)
  for step, row in want.items():
    for key in ("loss", "grad_norm", "learning_rate"):
      assert logged[step][key] == pytest.approx(row[key], rel=1e-6)
