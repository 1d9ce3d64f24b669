"""The config, defined once: every field of a run with its type, default, accepted values and
help line, in frozen and hashable dataclasses, one per section, each checked where it is built.
A config is parsed once where it enters (the command line, a checkpoint's saved config, a test);
the library takes these specs, never the ml_collections config; free of JAX.

Config files, `--config.x.y=...` overrides and the configs saved in checkpoints stay
ml_collections / JSON with the keys of `defaults()` (config.base_config() is them as a
ConfigDict); `Spec.to_dict()` gives them back.
"""

from collections.abc import Collection, Iterable, Mapping
import dataclasses
import difflib
import functools
import json
import os
from typing import Any, ClassVar, Self

import numpy as np

DTYPES = ("float32", "bfloat16")  # model.dtype (compute) and the decoding dtypes
MESH_AXES = ("data", "fsdp", "tensor")
PAPER_ORDERS_FILE = os.path.join(os.path.dirname(__file__), "data", "paper_orders.json")


@dataclasses.dataclass(frozen=True)
class Variant:
  """What a model variant is built of: model.py reads these, never the variant's name."""

  rms_norm: bool  # RMSNorm, else LayerNorm with a bias
  truncated_init: bool  # normal init cut at +-3 std, else plain normal
  adaln: bool  # the target position modulates the norms (AdaLN), else is added to the input
  qk_norm: bool  # queries and keys normed per head
  tied_head: bool  # the output head is the token embedding, else its own layer


VARIANTS = {
  "ao": Variant(rms_norm=True, truncated_init=True, adaln=True, qk_norm=True, tied_head=False),
  "sigma": Variant(
    rms_norm=False, truncated_init=False, adaln=False, qk_norm=False, tied_head=True
  ),
}
# The names of registries that hold JAX code (tests/unit/test_model.py and test_orders.py check
# that the keys are these).
ATTENTION = ("auto", "xla", "cudnn", "splash")  # model.ATTENTION's, and auto
REMAT = ("none", "full", "dots")  # model.REMAT's
ORDER_KINDS = ("random", "l2r", "mixed", "fixed", "blockwise")  # orders.ORDERS'
PROMPT_ORDERS = ("l2r", "random")  # order.prompt: the prompt's part of a prompt-first order
RESPONSE_ORDERS = ("l2r", "random", "mixed")  # order.kind with data.pairs (orders.prompt_first)
GRPO_POLICIES = ("parallel", "confidence", "margin", "speculative")  # decode/policies.py's


def field(default: Any, help: str, choices: Collection[str] = (), bounds: str = "") -> Any:
  """A config field: its default, its help line and what it accepts (`choices`: names or a
  registry's keys; or `bounds`: '>= 1', '> 0' or an interval such as '[0, 1)'), checked as its
  section is built."""
  return dataclasses.field(
    default=default, metadata={"help": help, "choices": choices, "bounds": bounds}
  )


def _within(value: float, bounds: str) -> bool:
  """Whether `value` lies in `bounds` (see `field`)."""
  if bounds.startswith(">"):
    low = float(bounds.lstrip(">= "))
    return value >= low if bounds.startswith(">=") else value > low
  low, high = (float(x) for x in bounds[1:-1].split(","))
  above = value >= low if bounds[0] == "[" else value > low
  return above and (value <= high if bounds[-1] == "]" else value < high)


def _check(name: str, value: Any, meta: Mapping) -> None:
  if meta.get("choices") and value not in meta["choices"]:
    raise ValueError(f"{name}={value!r}; accepted: {', '.join(meta['choices'])}")
  bounds = meta.get("bounds")
  if bounds and not _within(value, bounds):
    raise ValueError(f"{name}={value} must be {'' if bounds[0] == '>' else 'in '}{bounds}")


@dataclasses.dataclass(frozen=True)
class Section:
  """A config section: each field checked against its declaration, then `check`'s rules."""

  NAME: ClassVar[str]

  def __post_init__(self) -> None:
    for f in dataclasses.fields(self):
      _check(f"{self.NAME}.{f.name}", getattr(self, f.name), f.metadata)
    self.check()

  def check(self) -> None:
    """The rules across fields (none here)."""

  def replace(self, **changes: Any) -> Self:
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ModelSpec(Section):
  """The network: its shape (SHAPE, what params and checkpoints depend on) and how it computes."""

  NAME: ClassVar[str] = "model"
  variant: str = field(
    "ao", "ao (AO-GPT, AdaLN target conditioning) or sigma (the sigma-GPT baseline)", VARIANTS
  )
  vocab_size: int = field(
    2048, "V, a multiple of 128; the SentencePiece tokenizer is trained to this size", bounds=">= 1"
  )
  block_size: int = field(128, "T, positions of a sequence", bounds=">= 1")
  n_layer: int = field(4, "L, blocks", bounds=">= 1")
  n_head: int = field(4, "H, attention heads", bounds=">= 1")
  n_embd: int = field(128, "D, the width", bounds=">= 1")
  cond_dim: int = field(128, "C, target-conditioning width (AO-GPT only)", bounds=">= 1")
  position_std: float = field(0.02, "init std of the position and target tables", bounds="> 0")
  dtype: str = field("float32", "compute dtype; params are always float32", DTYPES)
  unroll_layers: bool = field(
    False,
    "training/scoring: unroll the layer scan, ~15% faster steps on CPU (no stacked residuals) "
    "but longer compiles; the cached decoders always loop (faster there)",
  )
  remat: str = field("none", "rematerialise each block in the backward pass", REMAT)
  attention: str = field(
    "auto",
    "attention of training and scoring (the cached decoders keep their own): auto is splash on "
    "TPU (T a multiple of 128), cudnn on GPU (bfloat16), else xla; splash is the Pallas TPU "
    "kernel, interpreted (slowly) elsewhere",
    ATTENTION,
  )
  SHAPE: ClassVar[tuple] = (
    "variant",
    "vocab_size",
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "cond_dim",
  )

  def check(self) -> None:
    if self.n_embd % self.n_head:
      raise ValueError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}")
    if self.attention == "splash" and self.block_size % 128:
      raise ValueError(
        f"model.attention='splash' needs model.block_size a multiple of 128 (the "
        f"kernel's blocks); got {self.block_size}: use 'auto' or 'xla'"
      )

  @property
  def arch(self) -> Variant:
    """What the variant is built of."""
    return VARIANTS[self.variant]

  def shape_differences(
    self, other: "ModelSpec", mine: str = "checkpoint", theirs: str = "config", keys: tuple = SHAPE
  ) -> list:
    """'model.KEY: <mine> A vs <theirs> B' for every shape key (or `keys`) that differs."""
    return [
      f"model.{k}: {mine} {getattr(self, k)} vs {theirs} {getattr(other, k)}"
      for k in keys
      if getattr(self, k) != getattr(other, k)
    ]


@functools.cache
def paper_orders() -> dict:
  """The authors' literal fixed permutations of the order study (Fig. 2a), by name."""
  with open(PAPER_ORDERS_FILE) as f:
    return {k: tuple(v) for k, v in json.load(f)["orders"].items()}


@dataclasses.dataclass(frozen=True)
class OrderSpec(Section):
  """How training draws its generation orders (orders.py makes them)."""

  NAME: ClassVar[str] = "order"
  kind: str = field("mixed", "the orders of training (orders.ORDERS)", ORDER_KINDS)
  random_ratio: float = field(
    0.9, "mixed: probability of a random order per sequence", bounds="[0, 1]"
  )
  ramp_steps: int = field(
    0, "mixed: the probability grows linearly from 0 over these steps", bounds=">= 0"
  )
  fixed: str = field(
    "seed:0",
    "fixed: seed:N draws the permutation from seed N; order1..order3 are the authors' literal "
    "permutations of the order study (ao_mdm/data/paper_orders.json, T=1024)",
  )
  block: int = field(4, "blockwise: block length b", bounds=">= 1")
  pattern: tuple = field((0, 2, 3, 1), "blockwise: order within each block")
  prompt: str = field(
    "l2r", "with data.pairs: the order inside the prompt, which comes first", PROMPT_ORDERS
  )

  def check(self) -> None:
    if self.ramp_steps > 0 and self.kind != "mixed":
      raise ValueError(
        f"order.ramp_steps={self.ramp_steps} must be 0, or >= 1 with "
        f"order.kind='mixed' (got kind={self.kind!r})"
      )
    if self.kind == "fixed" and not (self.fixed.startswith("seed:") and self.fixed[5:].isdigit()):
      if self.fixed not in paper_orders():
        raise ValueError(
          f"order.fixed={self.fixed!r}; accepted: seed:N or one of {', '.join(paper_orders())}"
        )
    if self.kind == "blockwise" and sorted(self.pattern) != list(range(self.block)):
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
class DataSpec(Section):
  """Where the text comes from and how it is tokenized and prepared."""

  NAME: ClassVar[str] = "data"
  dataset: str = field("sotu", "a registry name (ao_mdm.data.datasets), text_file or sudoku")
  text_file: str = field("", "with dataset=text_file: a local UTF-8 file, one document per line")
  pairs: str = field(
    "",
    "fine-tune on prompt/response pairs instead of data.dataset (docs/posttraining.md): a "
    "JSON-lines file or arithmetic:N (N generated sums)",
  )
  tokenizer: str = field("sentencepiece", "sentencepiece (trained for each run), gpt2 or sudoku")
  tfds_dir: str = field("", "TFDS data; empty: $TFDS_DATA_DIR or ~/tensorflow_datasets")
  prepared_dir: str = field(
    "",
    "where `ao-mdm prepare` (or train/eval, when missing) writes token shards; empty: "
    "<tfds_dir>/ao_mdm_prepared",
  )


@dataclasses.dataclass(frozen=True)
class TrainSpec(Section):
  """The optimisation and the loop's schedule of logs, validations and checkpoints."""

  NAME: ClassVar[str] = "train"
  batch_size: int = field(16, "global batch, sequences per step", bounds=">= 1")
  num_steps: int = field(400, "train steps", bounds=">= 1")
  learning_rate: float = field(3e-3, "peak learning rate, after the warm-up", bounds="> 0")
  min_lr: float = field(3e-4, "learning rate at the end of the cosine", bounds=">= 0")
  warmup_steps: int = field(40, "linear warm-up from 0", bounds=">= 0")
  lr_decay_steps: int = field(0, "end of the cosine (reaches min_lr); 0: num_steps", bounds=">= 0")
  weight_decay: float = field(0.05, "AdamW's, of kernels and embeddings", bounds=">= 0")
  b1: float = field(0.9, "Adam's beta1", bounds="[0, 1)")
  b2: float = field(0.95, "Adam's beta2", bounds="[0, 1)")
  grad_clip: float = field(1.0, "clip of the global gradient norm", bounds="> 0")
  ema_decay: float = field(0.999, "decay of the EMA params", bounds="[0, 1)")
  microbatches: int = field(1, "gradient accumulation: micro-batches per step", bounds=">= 1")
  log_every: int = field(50, "steps between metrics lines", bounds=">= 1")
  checkpoint_every: int = field(200, "steps between checkpoints", bounds=">= 1")
  keep_checkpoints: int = field(3, "checkpoints kept", bounds=">= 1")
  eval_every: int = field(
    200, "validation loss with the EMA params every N steps (0: at the end only)", bounds=">= 0"
  )
  eval_batches: int = field(8, "validation batches for the L2R / random-order loss", bounds=">= 1")
  peak_flops_per_device: float = field(
    0.0,
    "FLOP/s of one device, for MFU (0: measured on CPU, hardware.PEAK_FLOPS on TPUs and GPUs)",
    bounds=">= 0",
  )
  profile_start_step: int = field(
    10,
    "first step of a jax.profiler trace into WORKDIR/profile (after the first steps' compiles)",
    bounds=">= 0",
  )
  profile_steps: int = field(0, "steps traced (0: no trace)", bounds=">= 0")
  wandb_project: str = field(
    "",
    "Weights & Biases: the logged metrics also go to this project (the [wandb] extra; WANDB_MODE "
    "and the other WANDB_* variables as wandb reads them); empty: not at all",
  )

  def check(self) -> None:
    if self.batch_size % self.microbatches:
      raise ValueError(
        f"train.batch_size={self.batch_size} is not divisible by "
        f"train.microbatches={self.microbatches}"
      )


@dataclasses.dataclass(frozen=True)
class GrpoSpec(Section):
  """Reinforcement learning from rewards (GRPO) on data.pairs's prompts (docs/posttraining.md);
  off while `reward` is empty. train.batch_size counts answers: batch_size / group prompts."""

  NAME: ClassVar[str] = "grpo"
  reward: str = field("", "module:function(prompt, answer, reference) -> float; empty: no GRPO")
  group: int = field(8, "answers drawn per prompt (the group of the advantages)", bounds=">= 2")
  updates: int = field(1, "optimiser updates per batch of answers", bounds=">= 1")
  clip: float = field(0.2, "clip of the probability ratio, 1 +- clip", bounds="(0, 1)")
  kl: float = field(0.04, "weight of the KL penalty to the initial params", bounds=">= 0")
  temperature: float = field(1.0, "of the answers' draws", bounds="> 0")
  tokens_per_step: int = field(1, "answer tokens per forward (1: sequential)", bounds=">= 1")
  order: str = field("l2r", "order of an answer's positions after its prompt", ("l2r", "random"))
  policy: str = field(
    "parallel", "how answers are drawn (speculative: tokens_per_step drafts)", GRPO_POLICIES
  )
  block_len: int = field(0, "parallel: answers in blocks of this many, L2R (0: one)", bounds=">= 0")

  def check(self) -> None:
    if self.block_len and self.policy != "parallel":
      raise ValueError(f"grpo.block_len={self.block_len} needs policy=parallel, not {self.policy}")
    if self.order != "l2r" and self.policy not in ("parallel", "speculative"):
      raise ValueError(f"grpo.order={self.order}: policy={self.policy} chooses its own order")


@dataclasses.dataclass(frozen=True)
class MeshSpec(Section):
  """The ('data', 'fsdp', 'tensor') mesh and the logical axis rules."""

  NAME: ClassVar[str] = "mesh"
  ici: tuple = field(
    (-1, 1, 1), "axis sizes within a slice or host group; -1 fills the remaining devices"
  )
  dcn: tuple = field((1, 1, 1), "axis sizes across slices or host groups")
  rules: tuple = field(
    (
      ("batch", ("data", "fsdp")),
      ("length", None),
      ("embed", "fsdp"),
      ("heads", "tensor"),
      ("kv", None),
      ("mlp", "tensor"),
      ("vocab", "tensor"),
      ("cond", None),
      ("layers", None),
    ),
    "logical axis names to mesh axes (docs/design.md, Sharding)",
  )

  def check(self) -> None:
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

  seed: int = field(0, "seed of the initial params and of the data's and orders' draws")
  model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
  order: OrderSpec = dataclasses.field(default_factory=OrderSpec)
  data: DataSpec = dataclasses.field(default_factory=DataSpec)
  train: TrainSpec = dataclasses.field(default_factory=TrainSpec)
  grpo: GrpoSpec = dataclasses.field(default_factory=GrpoSpec)
  mesh: MeshSpec = dataclasses.field(default_factory=MeshSpec)

  def __post_init__(self):
    if self.data.pairs and self.order.kind not in RESPONSE_ORDERS:
      raise ValueError(
        f"order.kind={self.order.kind!r} with data.pairs: a response is ordered "
        f"{', '.join(RESPONSE_ORDERS)} after its prompt"
      )
    if self.grpo.reward and not self.data.pairs:
      raise ValueError(
        f"grpo.reward={self.grpo.reward!r} needs data.pairs: GRPO draws answers to its prompts"
      )
    if self.grpo.reward and self.train.batch_size % self.grpo.group:
      raise ValueError(
        f"train.batch_size={self.train.batch_size} (answers per step) must be divisible by "
        f"grpo.group={self.grpo.group}"
      )
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
  "grpo": GrpoSpec,
  "mesh": MeshSpec,
}
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def defaults() -> dict:
  """Every config key and its default, by section: what config.base_config() holds."""
  return dataclasses.asdict(Spec())


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
  for f in dataclasses.fields(cls):
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    values[f.name] = _value(kind, node[f.name], f"{name}.{f.name}")
  return cls(**values)


def closest(key: str, keys: Iterable[str]) -> str | None:
  """The known key nearest a misspelt one, if one is near."""
  close = difflib.get_close_matches(key, list(keys), n=1)
  return close[0] if close else None


def check_keys(config: Any, base: Mapping | None = None, prefix: str = "") -> None:
  """Refuses a key that the specs do not have (a misspelt field would be ignored and its
  default used), naming the closest one; a benchmark's own `bench` section aside."""
  base = defaults() if base is None else base
  for key in config.keys():
    if not prefix and key == "bench":
      continue
    name = f"{prefix}{key}"
    if key not in base:
      near = closest(key, base.keys())
      hint = (
        f"; did you mean {prefix}{near}?"
        if near
        else (f"; {prefix.rstrip('.') or 'the config'} has {', '.join(sorted(base.keys()))}")
      )
      raise ValueError(f"the --config file sets {name}, which is no config key{hint}")
    if isinstance(base[key], dict):
      check_keys(config[key], base[key], f"{name}.")


def parse(config: Any) -> Spec:
  """The Spec of an ml_collections config (or a dict of the same keys): every key is one of the
  specs', every section is checked as it is built."""
  check_keys(config)
  sections = {name: _section(cls, config[name], name) for name, cls in SECTIONS.items()}
  return Spec(seed=_value("int", config["seed"], "seed"), **sections)


def with_defaults(saved: dict) -> Spec:
  """A saved config (a checkpoint's) on top of the defaults: keys added since it was written
  get their defaults; keys that are gone are dropped."""
  config = defaults()

  def merge(base, values):
    for key, value in values.items():
      if key not in base:
        continue
      if isinstance(value, dict) and isinstance(base[key], dict):
        merge(base[key], value)
      else:
        base[key] = value

  merge(config, saved)
  return parse(config)


def default() -> Spec:
  """The defaults as a Spec: the tiny CPU demo model."""
  return Spec()


def single_device_mesh() -> MeshSpec:
  """The default mesh: one process's devices along the data axis."""
  return MeshSpec()
