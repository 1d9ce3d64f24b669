"""Typed specs: a config parsed once, where it enters (the command line, a checkpoint's saved
config, a test), into frozen and hashable dataclasses, one per section, each checked where it
is built. The library takes these, never the ml_collections config; free of JAX.

Config files, `--config.x.y=...` overrides and the configs saved in checkpoints stay
ml_collections / JSON with the keys of config.base_config(); `Spec.to_dict()` gives them back.
"""

import dataclasses
import difflib
import functools
import json
import os
from typing import Any, ClassVar

import numpy as np

from ao_mdm import config as config_lib

VARIANTS = ("ao", "sigma")
REMAT = ("none", "full", "dots")
ATTENTION = ("auto", "xla", "cudnn", "splash")  # of training and scoring (model.py)
ORDER_KINDS = ("random", "l2r", "mixed", "fixed", "blockwise")
MESH_AXES = ("data", "fsdp", "tensor")
PAPER_ORDERS_FILE = os.path.join(os.path.dirname(__file__), "data", "paper_orders.json")


def _one_of(name: str, value: Any, accepted: tuple) -> None:
  if value not in accepted:
    raise ValueError(f"{name}={value!r}; accepted: {', '.join(accepted)}")


def _at_least(section: str, obj: Any, names: tuple, low: float, strict: bool = False) -> None:
  for name in names:
    value = getattr(obj, name)
    if (value <= low) if strict else not value >= low:
      raise ValueError(
        f"{section}.{name}={value} must be {'>' if strict else '>='} "
        f"{low:g}" + (" (0: num_steps)" if name == "lr_decay_steps" else "")
      )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The network: its shape (SHAPE, what params and checkpoints depend on) and how it computes."""

  variant: str
  vocab_size: int
  block_size: int
  n_layer: int
  n_head: int
  n_embd: int
  cond_dim: int
  dtype: str
  unroll_layers: bool
  remat: str
  attention: str
  SHAPE: ClassVar[tuple] = (
    "variant",
    "vocab_size",
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "cond_dim",
  )

  def __post_init__(self):
    _one_of("model.variant", self.variant, VARIANTS)
    _one_of("model.dtype", self.dtype, config_lib.DTYPES)
    _one_of("model.remat", self.remat, REMAT)
    _one_of("model.attention", self.attention, ATTENTION)
    _at_least(
      "model", self, ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "cond_dim"), 1
    )
    if self.n_embd % self.n_head:
      raise ValueError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}")
    if self.attention == "splash" and self.block_size % 128:
      raise ValueError(
        f"model.attention='splash' needs model.block_size a multiple of 128 (the "
        f"kernel's blocks); got {self.block_size}: use 'auto' or 'xla'"
      )

  def shape_differences(
    self, other: "ModelSpec", mine: str = "checkpoint", theirs: str = "config", keys: tuple = SHAPE
  ) -> list:
    """'model.KEY: <mine> A vs <theirs> B' for every shape key (or `keys`) that differs."""
    return [
      f"model.{k}: {mine} {getattr(self, k)} vs {theirs} {getattr(other, k)}"
      for k in keys
      if getattr(self, k) != getattr(other, k)
    ]

  def replace(self, **changes) -> "ModelSpec":
    return dataclasses.replace(self, **changes)


@functools.cache
def paper_orders() -> dict:
  """The authors' literal fixed permutations of the order study (Fig. 2a), by name."""
  with open(PAPER_ORDERS_FILE) as f:
    return {k: tuple(v) for k, v in json.load(f)["orders"].items()}


@dataclasses.dataclass(frozen=True)
class OrderSpec:
  """How training draws its generation orders (orders.py makes them)."""

  kind: str
  random_ratio: float
  ramp_steps: int
  fixed: str
  block: int
  pattern: tuple

  def __post_init__(self):
    _one_of("order.kind", self.kind, ORDER_KINDS)
    if self.kind == "mixed" and not 0.0 <= self.random_ratio <= 1.0:
      raise ValueError(f"order.random_ratio={self.random_ratio} must be in [0, 1]")
    if self.ramp_steps < 0 or (self.ramp_steps > 0 and self.kind != "mixed"):
      raise ValueError(
        f"order.ramp_steps={self.ramp_steps} must be 0, or >= 1 with "
        f"order.kind='mixed' (got kind={self.kind!r})"
      )
    if self.kind == "fixed" and not (self.fixed.startswith("seed:") and self.fixed[5:].isdigit()):
      if self.fixed not in paper_orders():
        raise ValueError(
          f"order.fixed={self.fixed!r}; accepted: seed:N or one of {', '.join(paper_orders())}"
        )
    if self.kind == "blockwise":
      if self.block < 1:
        raise ValueError(f"order.block={self.block} must be >= 1 and divide block_size")
      if sorted(self.pattern) != list(range(self.block)):
        raise ValueError(
          f"order.pattern={tuple(self.pattern)} must be a permutation of 0..{self.block - 1}"
        )

  def permutation(self, t: int) -> np.ndarray:
    """The one permutation of a `fixed` or `blockwise` order over t positions."""
    if self.kind == "blockwise":
      if t % self.block:
        raise ValueError(f"order.block={self.block} must be >= 1 and divide block_size={t}")
      starts = np.arange(0, t, self.block)[:, None]
      return (starts + np.asarray(self.pattern)[None, :]).reshape(-1).astype(np.int32)
    if self.fixed.startswith("seed:"):
      return np.random.default_rng(int(self.fixed[5:])).permutation(t).astype(np.int32)
    perm = np.asarray(paper_orders()[self.fixed], np.int32)
    if len(perm) != t:
      raise ValueError(
        f"order.fixed={self.fixed!r} is a permutation of {len(perm)} positions; "
        f"model.block_size={t}"
      )
    return perm


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """Where the text comes from and how it is tokenized and prepared ("" dirs: the defaults)."""

  dataset: str
  text_file: str
  tokenizer: str
  tfds_dir: str
  prepared_dir: str

  def replace(self, **changes) -> "DataSpec":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  """The optimisation and the loop's schedule of logs, validations and checkpoints."""

  batch_size: int
  num_steps: int
  learning_rate: float
  min_lr: float
  warmup_steps: int
  lr_decay_steps: int
  weight_decay: float
  b1: float
  b2: float
  grad_clip: float
  ema_decay: float
  microbatches: int
  log_every: int
  checkpoint_every: int
  keep_checkpoints: int
  eval_every: int
  eval_batches: int
  peak_flops_per_device: float
  profile_start_step: int
  profile_steps: int
  wandb_project: str

  def __post_init__(self):
    _at_least("train", self, ("batch_size", "num_steps", "microbatches", "log_every"), 1)
    _at_least("train", self, ("lr_decay_steps",), 0)
    if self.batch_size % self.microbatches:
      raise ValueError(
        f"train.batch_size={self.batch_size} is not divisible by "
        f"train.microbatches={self.microbatches}"
      )
    if not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"train.ema_decay={self.ema_decay} must be in [0, 1)")
    _at_least("train", self, ("learning_rate", "grad_clip"), 0, strict=True)
    _at_least(
      "train",
      self,
      (
        "min_lr",
        "weight_decay",
        "warmup_steps",
        "eval_every",
        "peak_flops_per_device",
        "profile_start_step",
        "profile_steps",
      ),
      0,
    )
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"train.{name}={getattr(self, name)} must be in [0, 1)")
    _at_least("train", self, ("checkpoint_every", "keep_checkpoints", "eval_batches"), 1)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """The ('data', 'fsdp', 'tensor') mesh: ICI sizes within a slice, DCN sizes across slices (one
  -1 fills the rest), and the logical axis rules."""

  ici: tuple
  dcn: tuple
  rules: tuple

  def __post_init__(self):
    for name in ("ici", "dcn"):
      sizes = getattr(self, name)
      if (
        len(sizes) != len(MESH_AXES) or sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes)
      ):
        raise ValueError(
          f"mesh.{name}={tuple(sizes)}: give {len(MESH_AXES)} sizes for "
          f"{MESH_AXES}, each >= 1, with at most one -1"
        )


@dataclasses.dataclass(frozen=True)
class Spec:
  """A whole run: its seed and every section."""

  seed: int
  model: ModelSpec
  order: OrderSpec
  data: DataSpec
  train: TrainSpec
  mesh: MeshSpec

  def __post_init__(self):
    if self.order.kind in ("fixed", "blockwise"):
      self.order.permutation(self.model.block_size)

  def to_dict(self) -> dict:
    """The config's keys and values, as JSON holds them (what checkpoints save)."""
    return json.loads(json.dumps(dataclasses.asdict(self)))

  def replace(self, **sections) -> "Spec":
    return dataclasses.replace(self, **sections)


SECTIONS = {
  "model": ModelSpec,
  "order": OrderSpec,
  "data": DataSpec,
  "train": TrainSpec,
  "mesh": MeshSpec,
}
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _frozen(value: Any) -> Any:
  """Lists (as JSON gives them) and tuples, nested, as tuples: hashable."""
  return tuple(map(_frozen, value)) if isinstance(value, (list, tuple)) else value


def _value(kind: str, value: Any, name: str) -> Any:
  """A config value as its field's type; tuples (of tuples) stay hashable."""
  if kind == "tuple":
    return _frozen(value)
  if kind == "bool" and not isinstance(value, bool):
    raise ValueError(f"{name}={value!r} must be True or False")
  if kind in ("int", "float") and (isinstance(value, bool) or not isinstance(value, (int, float))):
    raise ValueError(f"{name}={value!r} must be a number")
  if kind == "int" and int(value) != value:
    raise ValueError(f"{name}={value!r} must be a whole number")
  return _TYPES[kind](value)


def _section(cls: type, node: Any, name: str) -> Any:
  values = {}
  for field in dataclasses.fields(cls):
    values[field.name] = _value(
      field.type if isinstance(field.type, str) else field.type.__name__,
      node[field.name],
      f"{name}.{field.name}",
    )
  return cls(**values)


def check_keys(config: Any, base: Any = None, prefix: str = "") -> None:
  """Refuses a key that base_config() does not have (a misspelt field would be ignored and its
  default used), naming the closest one; a benchmark's own `bench` section aside."""
  base = config_lib.base_config() if base is None else base
  for key in config.keys():
    if not prefix and key == "bench":
      continue
    name = f"{prefix}{key}"
    if key not in base:
      close = difflib.get_close_matches(key, list(base.keys()), n=1)
      hint = (
        f"; did you mean {prefix}{close[0]}?"
        if close
        else (f"; {prefix.rstrip('.') or 'the config'} has {', '.join(sorted(base.keys()))}")
      )
      raise ValueError(f"the --config file sets {name}, which is no config key{hint}")
    if hasattr(base[key], "keys"):
      check_keys(config[key], base[key], f"{name}.")


def parse(config: Any) -> Spec:
  """The Spec of an ml_collections config (or a dict of the same keys): every key is one of
  base_config()'s, every section is checked as it is built."""
  check_keys(config)
  sections = {name: _section(cls, config[name], name) for name, cls in SECTIONS.items()}
  return Spec(seed=_value("int", config["seed"], "seed"), **sections)


def with_defaults(saved: dict) -> Spec:
  """A saved config (a checkpoint's) on top of base_config(): keys added since it was written
  get their defaults; keys that are gone are dropped."""
  config = config_lib.base_config()

  def merge(base, values):
    for key, value in values.items():
      if key not in base:
        continue
      if isinstance(value, dict) and hasattr(base[key], "keys"):
        merge(base[key], value)
      else:
        base[key] = value

  merge(config, saved)
  return parse(config)


def default() -> Spec:
  """base_config() as a Spec: the tiny CPU demo model."""
  return parse(config_lib.base_config())


def single_device_mesh() -> MeshSpec:
  """The mesh of base_config(): one process's devices along the data axis."""
  return default().mesh
