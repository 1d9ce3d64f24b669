"""TFDS datasets: builders over the embedded corpus and local files, and a catalog registry.

Everything is read back as ArrayRecord through `as_data_source()` (random access, no TensorFlow).
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
import dataclasses
import functools
import hashlib
import io
import itertools
import math
import os
from typing import Any

from etils import epath
import tensorflow_datasets as tfds
from tensorflow_datasets.core import utils as tfds_utils

from ao_mdm import specs
from ao_mdm.data import corpus
from ao_mdm.data.detokenize import detokenize
from ao_mdm.storage import fs, paths

VALIDATION_FRACTION = 0.05
TEXT_KEY = "text"


# Builders defined by the project. skip_registration: they are built directly, never by name,
# so they cannot clash with the TFDS catalog and re-importing this module is harmless. (TFDS has
# no type information: mypy takes its base class as Any and checks the keyword against
# object.__init_subclass__, hence the ignores.)


class _LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):  # type: ignore[call-arg]  # TFDS is untyped
  """Base of the project's builders: one `text` feature, document order kept."""

  # TFDS 4.9.10 finds a builder's code via `importlib_resources`, a package it does not
  # require on Python >= 3.9; naming the file directly avoids that import.
  @tfds_utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(__file__)

  def _generate_examples(self, docs):
    for i, text in enumerate(docs):
      yield i, {TEXT_KEY: text}


def _validation_count(n: int, source: str) -> int:
  """Train/validation by position: the last 5% of documents (rounded up) are validation."""
  if n < 2:
    raise ValueError(
      f"{source} has {n} document(s); at least 2 are needed for train and validation"
    )
  return math.ceil(VALIDATION_FRACTION * n)


def _text_info(builder: tfds.core.DatasetBuilder, description: str) -> tfds.core.DatasetInfo:
  """DatasetInfo with one `text` feature, kept in document order (no shuffling on write)."""
  return tfds.core.DatasetInfo(
    builder=builder,
    description=description,
    features=tfds.features.FeaturesDict({TEXT_KEY: tfds.features.Text()}),
    disable_shuffling=True,
  )


class SotuCorpus(_LocalBuilder, skip_registration=True):  # type: ignore[call-arg]  # TFDS is untyped
  """The embedded State of the Union corpus; splits as in `corpus.sotu_documents`."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self) -> tfds.core.DatasetInfo:
    return _text_info(self, "State of the Union addresses 1790-2021 (ao_mdm/data/sotu.jsonl.xz).")

  def _split_generators(self, dl_manager):
    del dl_manager
    return {s: self._generate_examples(corpus.sotu_documents(s)) for s in corpus.SPLITS}


@dataclasses.dataclass(eq=False)
class TextFileConfig(tfds.core.BuilderConfig):
  """A local text source: `path` is a file (one document per line) or a directory of .txt files."""

  path: str = ""


def read_text_documents(path: str) -> list[str]:
  """Documents of a local text source: non-blank lines of a file, or whole .txt files of a dir."""
  docs = list(iter_text_documents(path))
  if not docs:
    raise ValueError(f"text source {path!r} is empty: no non-blank document found")
  return docs


def _text_files(path: str) -> list[str]:
  """The file itself, or the .txt files of a directory, sorted."""
  if fs.isfile(path):
    return [path]
  if fs.isdir(path):
    return [fs.join(path, name) for name in fs.listdir(path) if name.endswith(".txt")]
  raise FileNotFoundError(f"text file not found: {path!r}")


def iter_text_documents(path: str) -> Iterator[str]:
  """read_text_documents one at a time (a large file is never held in memory)."""
  for name in _text_files(path):
    try:
      with fs.open_text(name) as f:
        if name != path:  # a directory: each file is one document
          text = f.read().strip("\n")
          if text.strip():
            yield text
          continue
        for line in f:
          line = line.rstrip("\r\n")
          if line.strip():
            yield line
    except UnicodeDecodeError as e:
      raise ValueError(
        f"text source {name!r} is not UTF-8 text (byte {e.start}: {e.reason})"
      ) from None


def text_source_hash(path: str) -> str:
  """A short hash of the content (file bytes, or names+bytes of a directory's .txt files)."""
  if not path:
    raise ValueError("data.text_file is empty; set it to a local text file or directory")
  if fs.isfile(path):  # hashed once per process while the file stays as it is
    st = fs.stat(path)
    return _file_hash(fs.absolute(path), st.size, st.version)
  return _content_hash(path)


@functools.lru_cache(maxsize=64)
def _file_hash(path: str, size: int, version: int) -> str:
  del size, version  # the cache key
  return _content_hash(path)


def _content_hash(path: str) -> str:
  h = hashlib.sha256()
  names = _text_files(path)
  h.update(b"file\0" if names == [path] else b"dir\0")
  for name in names:
    inner = h if names == [path] else hashlib.sha256()
    with fs.open_read(name) as f:  # streamed: a large corpus is never held in memory
      for chunk in iter(lambda: f.read(1 << 20), b""):
        inner.update(chunk)
    if inner is not h:
      h.update(fs.basename(name).encode() + b"\0" + inner.digest())
  return h.hexdigest()[:16]


class TextFile(_LocalBuilder, skip_registration=True):  # type: ignore[call-arg]  # TFDS is untyped
  """A local text file or directory; its config name is its content hash: no two sources collide."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self) -> tfds.core.DatasetInfo:
    return _text_info(self, f"Local text from {self.builder_config.path}.")

  def _split_generators(self, dl_manager):
    del dl_manager
    path = self.builder_config.path
    n = sum(1 for _ in iter_text_documents(path))  # a first pass counts; both splits stream
    if n == 0:
      raise ValueError(f"text source {path!r} is empty: no non-blank document found")
    n_train = n - _validation_count(n, repr(path))
    return {
      "train": self._generate_examples(itertools.islice(iter_text_documents(path), n_train)),
      "validation": self._generate_examples(
        itertools.islice(iter_text_documents(path), n_train, None)
      ),
    }


def _file_config(path: str) -> TextFileConfig:
  """A builder config for a local source, named by the source's content hash."""
  return TextFileConfig(name=f"h{text_source_hash(path)}", path=fs.absolute(path))


def text_file_builder(path: str, tfds_dir: str) -> TextFile:
  return TextFile(config=_file_config(path), data_dir=tfds_dir)


class LambadaJsonl(_LocalBuilder, skip_registration=True):  # type: ignore[call-arg]  # TFDS is untyped
  """OpenAI's local LAMBADA test file (lambada_test.jsonl: a JSON object a line, field `text`)."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self) -> tfds.core.DatasetInfo:
    return _text_info(self, f"LAMBADA (OpenAI's jsonl) from {self.builder_config.path}.")

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"test": self._generate_examples(read_jsonl_texts(self.builder_config.path))}


def read_jsonl_texts(path: str, field: str = "text") -> list[str]:
  """The `field` of every record of a local JSONL file (LAMBADA: OpenAI's lambada_test.jsonl)."""
  records = paths.jsonl_records(path, "JSONL file (LAMBADA: lambada_test.jsonl)")
  for number, r in enumerate(records, 1):
    if not isinstance(r.get(field), str):
      raise ValueError(f"{path}: record {number} has no {field!r} string")
  return [r[field] for r in records]


# Registry.


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """How to read one dataset: a local builder or a prepared TFDS dataset, splits, text, detok."""

  name: str
  splits: Mapping[str, str]  # our split name -> TFDS split (slicing allowed, e.g. "train[-100:]")
  text_key: str = TEXT_KEY
  detokenizer: str = ""  # a table of ao_mdm.data.detokenize.RULES
  make_builder: Callable[[Any, str], tfds.core.DatasetBuilder] | None = None  # (config, dir)
  tfds_name: str = ""  # catalog datasets: the name for `tfds build`
  tfds_path: str = ""  # catalog datasets: where they lie under the TFDS data dir


_TRAIN_VAL = {"train": "train", "validation": "validation"}
_TRAIN_VAL_TEST = {"train": "train", "validation": "validation", "test": "test"}

DATASETS: dict[str, DatasetSpec] = {
  "sotu": DatasetSpec("sotu", _TRAIN_VAL, make_builder=lambda cfg, d: SotuCorpus(data_dir=d)),
  "text_file": DatasetSpec(
    "text_file", _TRAIN_VAL, make_builder=lambda cfg, d: text_file_builder(cfg.text_file, d)
  ),
  # Catalog datasets: prepared elsewhere (e.g. `tfds build`), read from the TFDS data dir.
  # As in SEDD/MDLM, every example (a WikiText line, a PTB sentence, ...) is one document.
  "wikitext2": DatasetSpec(
    "wikitext2",
    _TRAIN_VAL_TEST,
    detokenizer="wikitext",
    tfds_name="huggingface:wikitext/wikitext-2-raw-v1",
    tfds_path="wikitext/wikitext_2_raw_v1",
  ),
  "wikitext103": DatasetSpec(
    "wikitext103",
    _TRAIN_VAL_TEST,
    detokenizer="wikitext",
    tfds_name="huggingface:wikitext/wikitext-103-raw-v1",
    tfds_path="wikitext/wikitext_103_raw_v1",
  ),
  "ptb": DatasetSpec(
    "ptb",
    _TRAIN_VAL_TEST,
    text_key="sentence",
    detokenizer="ptb",
    tfds_name="huggingface:ptb_text_only",
    tfds_path="ptb_text_only",
  ),
  # The authors evaluate on OpenAI's lambada_test.jsonl (not TFDS's LAMBADA): data.text_file.
  "lambada": DatasetSpec(
    "lambada",
    {"test": "test"},
    detokenizer="lambada",
    make_builder=lambda cfg, d: LambadaJsonl(config=_file_config(cfg.text_file), data_dir=d),
  ),
  "lm1b": DatasetSpec(
    "lm1b",
    {"train": "train", "test": "test"},
    detokenizer="lm1b",
    tfds_name="lm1b",
    tfds_path="lm1b",
  ),
  # MDLM: the last 100k documents of OpenWebText's only split are the validation set.
  "openwebtext": DatasetSpec(
    "openwebtext",
    {"train": "train[:-100000]", "validation": "train[-100000:]"},
    tfds_name="huggingface:openwebtext",
    tfds_path="openwebtext",
  ),
}


def get_spec(name: str) -> DatasetSpec:
  """The registry entry for `name`, or an error listing the known names."""
  if name not in DATASETS:
    raise ValueError(f"unknown dataset {name!r}; known: {', '.join(sorted(DATASETS))}")
  return DATASETS[name]


def resolve_tfds_dir(tfds_dir: str) -> str:
  """The TFDS data dir: the given one, else $TFDS_DATA_DIR, else ~/tensorflow_datasets. It is
  local: `prepare` reads it on the hosts that prepare; what a multi-host run shares (and may
  keep in a bucket) is data.prepared_dir."""
  tfds_dir = paths.check(
    tfds_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets", "data.tfds_dir"
  )
  if fs.is_gcs(tfds_dir):
    raise ValueError(
      f"data.tfds_dir={tfds_dir!r}: the TFDS data dir is read by `ao-mdm prepare` "
      "on the hosts that prepare and must be local; put data.prepared_dir in the "
      "bucket instead (every host reads the prepared shards from there)"
    )
  if fs.isfile(tfds_dir):
    raise ValueError(f"data.tfds_dir={tfds_dir!r} (or TFDS_DATA_DIR) is a file; give a directory")
  return tfds_dir


def dataset_tag(data_config: specs.DataSpec) -> str:
  """A file-name-safe dataset name; a local text source is named by its content hash."""
  spec = get_spec(data_config.dataset)
  if spec.name in ("text_file", "lambada"):  # read from data.text_file
    return f"{spec.name}-{text_source_hash(data_config.text_file)}"
  return spec.name


def data_config_for(corpus_name_or_path: str) -> specs.DataSpec:
  """The data spec of a registry name or a local text path (the `tokenizer` command's input)."""
  if corpus_name_or_path in DATASETS and corpus_name_or_path != "text_file":
    dataset, text_file = corpus_name_or_path, ""
  elif fs.exists(corpus_name_or_path):
    dataset, text_file = "text_file", corpus_name_or_path
  else:
    known = ", ".join(sorted(n for n in DATASETS if n != "text_file"))
    raise ValueError(
      f"corpus {corpus_name_or_path!r} is neither a dataset name ({known}) nor an existing path"
    )
  return specs.DataSpec(
    dataset=dataset, text_file=text_file, tokenizer="sentencepiece", tfds_dir="", prepared_dir=""
  )


def _dataset_infos(root: str) -> list[str]:
  """The dataset_info.json files under a catalog dataset's directory (one per prepared version)."""
  return [
    fs.join(root, f)
    for f in (fs.files(root) if fs.isdir(root) else [])
    if fs.basename(f) == "dataset_info.json"
  ]


def _catalog_builder(spec: DatasetSpec, tfds_dir: str) -> tfds.core.DatasetBuilder:
  """Opens a prepared catalog dataset from its directory (no registry, no network, no TF)."""
  root = fs.join(tfds_dir, spec.tfds_path)
  infos = _dataset_infos(root)
  if not infos:
    raise FileNotFoundError(
      f"dataset {spec.name!r} is not prepared: nothing under {root}. Prepare it on a machine "
      f"with network access (e.g. `tfds build {spec.tfds_name} --data_dir {tfds_dir} "
      f"--file_format array_record`) and copy it there"
    )
  version_dirs = sorted(
    (fs.parent(p) for p in infos), key=lambda d: tfds.core.Version(fs.basename(d))
  )
  return tfds.builder_from_directory(version_dirs[-1])


class Documents(Sequence[str]):
  """Random-access, detokenized document strings of one split of a TFDS data source.

  `fingerprint` identifies the source (builder, version, split, size; a local file's content
  hash), so that tokens prepared from it can be matched to it later.
  """

  def __init__(
    self, source: Sequence[Any], text_key: str, detokenizer: str = "", fingerprint: str = ""
  ):
    self._source = source
    self._text_key = text_key
    self._detokenizer = detokenizer
    self.fingerprint = fingerprint

  def __len__(self) -> int:
    return len(self._source)

  def _text(self, record: Any) -> str:
    text = record[self._text_key]
    if isinstance(text, bytes):
      text = text.decode("utf-8")
    return detokenize(self._detokenizer, text) if self._detokenizer else text

  def __getitem__(self, index):
    if isinstance(index, slice):
      return (
        self.read(*index.indices(len(self))[:2])
        if index.step in (None, 1)
        else [self[i] for i in range(*index.indices(len(self)))]
      )
    n = len(self)
    if not -n <= index < n:
      raise IndexError(f"document index {index} out of range [0, {n})")
    return self._text(self._source[index % n])

  def read(self, start: int, stop: int) -> list[str]:
    """Documents start..stop-1 in one batched read (several times faster than one by one)."""
    keys = list(range(max(start, 0), min(stop, len(self))))
    getitems = getattr(self._source, "__getitems__", None)
    records = getitems(keys) if getitems else [self._source[k] for k in keys]
    return [self._text(r) for r in records]


def _fingerprint(builder: tfds.core.DatasetBuilder, split: str) -> str:
  """Builder name, config and version (a local file's config is its content hash), split, size."""
  info = builder.info.splits[split]
  return f"{builder.info.full_name}|{split}|{info.num_examples}|{int(info.num_bytes)}"


def _prepare_local(builder: tfds.core.DatasetBuilder, rebuild: Callable, tfds_dir: str) -> None:
  """Writes a local source as a TFDS dataset, quietly; a failure leaves no empty directory."""
  import contextlib

  existed = fs.local_dirs(tfds_dir)
  try:
    fs.makedirs(tfds_dir)
    with contextlib.redirect_stdout(io.StringIO()):
      tfds.display_progress_bar(False)
      builder.download_and_prepare(file_format="array_record")
  except PermissionError as e:
    fs.remove_new_empty_dirs(tfds_dir, existed)
    raise ValueError(
      f"the TFDS data dir {tfds_dir!r} is not writable ({e.strerror}: "
      f"{e.filename}); set data.tfds_dir or TFDS_DATA_DIR to a writable "
      "directory"
    ) from None
  except OSError:
    # Several processes sharing a TFDS dir may race; the loser's final rename fails.
    if not rebuild().is_prepared():
      fs.remove_new_empty_dirs(tfds_dir, existed)
      raise
  except BaseException:
    fs.remove_new_empty_dirs(tfds_dir, existed)
    raise


def check_split(data_config: specs.DataSpec, split: str) -> None:
  """Refuses a split the dataset does not have."""
  spec = get_spec(data_config.dataset)
  if split not in spec.splits:
    raise ValueError(
      f"dataset {spec.name!r} has no split {split!r}; splits: {', '.join(spec.splits)}"
    )


def available(data_config: specs.DataSpec) -> bool:
  """Whether this host has the dataset's source: a local source file that exists (the embedded
  corpus always), or a catalog dataset prepared in the TFDS dir."""
  spec = get_spec(data_config.dataset)
  if spec.make_builder is not None:
    return spec.name == "sotu" or bool(data_config.text_file) and fs.exists(data_config.text_file)
  return bool(_dataset_infos(fs.join(resolve_tfds_dir(data_config.tfds_dir), spec.tfds_path)))


def load_documents(data_config: specs.DataSpec, split: str, tfds_dir: str) -> Documents:
  """Documents of a split, detokenized; local builders are prepared on first use."""
  check_split(data_config, split)
  spec = get_spec(data_config.dataset)
  tfds_dir = resolve_tfds_dir(tfds_dir)
  if spec.make_builder is not None:
    make = spec.make_builder
    builder = make(data_config, tfds_dir)
    if not builder.is_prepared():
      _prepare_local(builder, lambda: make(data_config, tfds_dir), tfds_dir)
      builder = make(data_config, tfds_dir)
  else:
    builder = _catalog_builder(spec, tfds_dir)
  source = builder.as_data_source(split=spec.splits[split])
  return Documents(
    source, spec.text_key, spec.detokenizer, _fingerprint(builder, spec.splits[split])
  )
