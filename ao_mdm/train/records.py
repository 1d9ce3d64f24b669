"""A run's records in its work dir: `metrics.jsonl` (one JSON object per line) and TensorBoard
event files under `tensorboard/`, written by process 0 through storage/fs.py, so both work on a
gs:// work dir; and the means of the step metrics over each logging window (clu.metrics).

Records are buffered and appended at each `flush()` (the training loop flushes at every logged
step and evaluation): one local append, or on gs:// one small object composed onto the file. So
a killed process loses at most the records of one logging interval, and the bytes written grow
with the records, not with their square. The event files are written without TensorFlow: each
record is a serialized `Event` proto framed as TFRecord (length, masked CRC32C, data, masked
CRC32C), which TensorBoard reads from a local directory or a bucket.
"""

from collections.abc import Callable
import hashlib
import json
import math
import os
import socket
import struct
import time
from typing import Any

from clu import metrics as clu_metrics
import flax
import google_crc32c
import jax
import jax.numpy as jnp
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2

from ao_mdm.checkpoint import layout
from ao_mdm.storage import fs


def _masked_crc(data: bytes) -> bytes:
  crc = google_crc32c.value(data)
  return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def tfrecord(data: bytes) -> bytes:
  """One TFRecord: the framing of every record of a TensorBoard event file."""
  length = struct.pack("<Q", len(data))
  return length + _masked_crc(length) + data + _masked_crc(data)


def read_tfrecords(data: bytes) -> list[bytes]:
  """The records of a TFRecord stream, each checked against its CRCs (for tests and tools)."""
  records, pos = [], 0
  while pos < len(data):
    length = data[pos : pos + 8]
    (n,) = struct.unpack("<Q", length)
    if data[pos + 8 : pos + 12] != _masked_crc(length):
      raise ValueError(f"corrupt record length at byte {pos}")
    record = data[pos + 12 : pos + 12 + n]
    if data[pos + 12 + n : pos + 16 + n] != _masked_crc(record):
      raise ValueError(f"corrupt record at byte {pos}")
    records.append(record)
    pos += 16 + n
  return records


class RunLog:
  """Scalars and texts of a run, for `metrics.jsonl` and TensorBoard; inactive (writes nothing)
  on every process but the first."""

  def __init__(
    self, workdir: str, active: bool = True, wandb_project: str = "", config: dict | None = None
  ):
    self.active = active
    self._wandb = _wandb_run(workdir, wandb_project, config) if active and wandb_project else None
    self.metrics = fs.join(workdir, layout.METRICS)
    self.events = fs.join(
      workdir,
      layout.TENSORBOARD,
      f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.ao_mdm",
    )
    self._lines: list[str] = []
    self._records: list[bytes] = []
    event = event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
    self._records.append(tfrecord(event.SerializeToString()))

  def scalars(self, step: int, values: dict) -> None:
    """One line of metrics.jsonl (non-finite values as null) and one TensorBoard scalar each."""
    values = {k: float(v) for k, v in values.items()}
    self._lines.append(
      json.dumps({"step": step, **{k: v if math.isfinite(v) else None for k, v in values.items()}})
      + "\n"
    )
    summary = summary_pb2.Summary(
      value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
    )
    self._event(step, summary)
    if self._wandb is not None:
      self._wandb.log(values, step=step)

  def text(self, step: int, tag: str, text: str) -> None:
    """A text for TensorBoard's text tab (e.g. the run's config)."""
    metadata = summary_pb2.SummaryMetadata(
      plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
    )
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()])
    self._event(
      step,
      summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)]
      ),
    )

  def _event(self, step: int, summary) -> None:
    event = event_pb2.Event(wall_time=time.time(), step=step, summary=summary)
    self._records.append(tfrecord(event.SerializeToString()))

  def flush(self) -> None:
    """Appends what was recorded since the last flush to both files."""
    lines, records, self._lines, self._records = self._lines, self._records, [], []
    if not self.active:
      return
    if lines:
      fs.append(self.metrics, "".join(lines).encode())
    if records:
      fs.append(self.events, b"".join(records))

  def close(self) -> None:
    """Ends the Weights & Biases run, if any (its files are then complete)."""
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


def _wandb_run(workdir: str, project: str, config: dict | None):
  """A Weights & Biases run of the work dir: one id per work dir, so that a resumed run goes on
  in the same wandb run; its local files under WORKDIR/wandb (a local work dir) or wandb's own
  directory (a bucket); quiet. A resumed run's steps up to the last one wandb has are dropped
  by wandb (its steps only grow)."""
  try:
    import wandb
  except ImportError:
    raise ImportError("train.wandb_project needs wandb: pip install -e '.[wandb]'") from None
  workdir = fs.absolute(workdir)
  local = None if fs.is_gcs(workdir) else workdir  # wandb writes into DIR/wandb
  run_id = hashlib.sha256(workdir.encode()).hexdigest()[:16]
  return wandb.init(
    project=project,
    id=run_id,
    resume="allow",
    name=os.path.basename(workdir),
    dir=local,
    config=config,
    settings=wandb.Settings(silent=True, console="off"),
  )


def drop_after(workdir: str, step: int) -> None:
  """Keeps the metrics.jsonl records of steps <= step: a resumed run writes the rest again.
  (TensorBoard drops the later points itself when a step goes back.)"""
  path = fs.join(workdir, layout.METRICS)
  if not fs.isfile(path):
    return
  lines = fs.read_text(path).splitlines(keepends=True)
  kept = [line for line in lines if _record_step(line) <= step]
  if len(kept) < len(lines):
    fs.write_text(path, "".join(kept))


def _record_step(line: str) -> float:
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):  # a line cut by a kill
    return math.inf


@flax.struct.dataclass
class _DefinedAverage(clu_metrics.Average):
  """The mean over the steps where the value is defined: a NaN (a batch without sequences of
  that kind, as loss_l2r) counts for nothing; no defined step gives NaN."""

  @classmethod
  def from_model_output(cls, values: jax.Array, **_) -> clu_metrics.Metric:
    defined = ~jnp.isnan(values)
    return cls(
      total=jnp.where(defined, values, 0.0).astype(jnp.float32), count=defined.astype(jnp.int32)
    )


_STEP = {
  "loss": clu_metrics.Average.from_output("loss"),
  "loss_l2r": _DefinedAverage.from_output("loss_l2r"),
  "loss_any_order": _DefinedAverage.from_output("loss_any_order"),
  "l2r_fraction": clu_metrics.Average.from_output("l2r_fraction"),
  "grad_norm": clu_metrics.Average.from_output("grad_norm"),
  "learning_rate": clu_metrics.LastValue.from_output("learning_rate"),
}
# A GRPO step's (train/grpo.py) also: the loss's KL and clipped share, and its answers'.
GRPO_KEYS = (
  "kl",
  "clip_fraction",
  "reward",
  "answer_tokens",
  "rollout_s",
  "scoring_s",
  "reward_s",
  "signal_fraction",
  "rollout_tokens_per_s",
)
_StepMetrics = clu_metrics.Collection.create(**_STEP)
_GrpoStepMetrics = clu_metrics.Collection.create(
  **_STEP, **{k: clu_metrics.Average.from_output(k) for k in GRPO_KEYS}
)


def _collection(m: dict) -> type[clu_metrics.Collection]:
  return _GrpoStepMetrics if "reward" in m else _StepMetrics


_first = jax.jit(lambda m: _collection(m).single_from_model_output(**m))
_merged = jax.jit(lambda acc, m: acc.merge(_collection(m).single_from_model_output(**m)))


class WindowMeans:
  """The train step's metrics averaged over the steps since the last read (learning_rate: its
  last value), merged on device at each step (no host sync), read when a step is logged."""

  def __init__(self):
    self._acc = None

  def add(self, metrics: dict) -> None:
    self._acc = _first(metrics) if self._acc is None else _merged(self._acc, metrics)

  def read(self) -> dict:
    """The means of the window, which starts again."""
    values = jax.device_get(self._acc.compute())
    self._acc = None
    return {k: float(v) for k, v in values.items()}


@jax.jit
def _first_bad(first: jax.Array, step: int, loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
  now = jnp.stack([jnp.float32(step), loss, grad_norm]).astype(jnp.float32)
  bad = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
  return jnp.where((first[0] < 0) & bad, now, first)


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


class FirstNonFinite:
  """The first step whose loss or gradient norm is not finite, kept on device (no host sync per
  step); `check` raises once there is one (or, given params about to be saved, when any of them
  is not finite), before anything trained from it is saved."""

  def __init__(self) -> None:
    self._first = jnp.asarray([-1.0, 0.0, 0.0], jnp.float32)

  def add(self, step: int, metrics: dict) -> None:
    self._first = _first_bad(self._first, step, metrics["loss"], metrics["grad_norm"])

  def check(self, saved: int | None, step: int = 0, params: Any = None) -> None:
    first, loss, norm = jax.device_get(self._first).tolist()
    what = f"the loss is {loss:g} and the gradient norm {norm:g}"
    if first < 0 and params is not None and not bool(_all_finite(params)):
      first, what = step, "the params are not all finite"
    if first >= 0:
      raise ValueError(
        f"step {int(first)}: {what}; training stops without saving it or anything after it "
        f"(the last checkpoint is {f'step {saved}' if saved is not None else 'none of this run'}"
        "): lower train.learning_rate, or check the data and, for GRPO, the reward"
      )


class StepWork:
  """Tokens and training FLOPs per step since the last read, from the width of the rows each
  step ran (fine-tuning and GRPO narrow them to their longest pair), for tokens/s and MFU."""

  def __init__(self, flops_per_token: Callable[[int], float], batch_size: int, extra: int):
    """flops_per_token(width); `extra`: columns after a row's tokens (pairs' lengths)."""
    self.flops_per_token, self.batch_size, self.extra = flops_per_token, batch_size, extra
    self._widths: dict[int, int] = {}

  def add(self, step: int, batch: Any) -> None:
    """Step `step`'s batch: [B, width + extra] rows, or GRPO's dict of [B, width] arrays."""
    rows = batch["tokens"] if isinstance(batch, dict) else batch
    self._widths[step] = rows.shape[1] - (0 if isinstance(batch, dict) else self.extra)

  def read(self, step: int) -> tuple[float, float]:
    """(tokens, FLOPs) per step, the mean over the steps up to `step` since the last read (the
    loop logs a step while the next one runs: its batch is not this window's)."""
    widths = [w for s, w in self._widths.items() if s <= step]
    self._widths = {s: w for s, w in self._widths.items() if s > step}
    tokens = [self.batch_size * w for w in widths]
    flops = [n * self.flops_per_token(w) for n, w in zip(tokens, widths)]
    return sum(tokens) / max(len(widths), 1), sum(flops) / max(len(widths), 1)
