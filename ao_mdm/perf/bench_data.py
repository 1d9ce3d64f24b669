"""`ao-mdm bench data`: preparing and reading a synthetic corpus at two sizes, in one run.

Per size: the raw tokenizer's batch throughput on the corpus's documents (all cores), `ao-mdm
prepare` with 1 and with N workers (wall time and the peak RSS of its whole process tree), and
the train iterator over the prepared split (time to first batch, delivered tokens/s, peak RSS),
next to the same blocks read through grain from an ArrayRecord file (the format MaxText and
md4 stream). Prepare and the iterator run as fresh processes, as a user runs them. With
bench.gcs (a bucket, or "local": a GCS server on 127.0.0.1), the iterator again over the same
preparation in the bucket, and the save and restore rates of a checkpoint there and locally.
"""

from collections.abc import Callable
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import ml_collections
import numpy as np

from ao_mdm import specs
from ao_mdm.data import corpus, datasets, tokenizer
from ao_mdm.storage import fs, paths

# OpenWebText in GPT-2 tokens (the paper's training set): what the projection scales to.
OPENWEBTEXT_TOKENS = 9.0e9


def synthetic_documents(
  n_chars: int, seed: int = 0, sentences_per_document: tuple[int, int] = (4, 60)
):
  """Yields documents of the embedded corpus's sentences in a seeded shuffled order (reshuffled
  after each pass) until they hold `n_chars` characters: a corpus of any size for benchmarks.

  Each document joins a uniform random count of sentences from `sentences_per_document` with
  spaces (about 1,100 GPT-2 tokens on average, near OpenWebText's) and holds no newline.
  """
  pool = [s for r in corpus.sotu_records() for s in tokenizer.sentences(r["text"]) if "\n" not in s]
  rng = random.Random(seed)
  order: list[str] = []
  pos, written = 0, 0
  while written < n_chars:
    k = rng.randint(*sentences_per_document)
    picked: list[str] = []
    while len(picked) < k:
      if pos == len(order):
        order, pos = rng.sample(pool, len(pool)), 0
      take = order[pos : pos + k - len(picked)]
      picked += take
      pos += len(take)
    doc = " ".join(picked)
    written += len(doc)
    yield doc


def write_synthetic_corpus(path: str, tokens: int, seed: int = 0) -> int:
  """Writes about `tokens` GPT-2 tokens of synthetic_documents, one per line, to path
  (through a temporary file); returns the documents written."""
  from ao_mdm.data import gpt2

  sample = list(synthetic_documents(2_000_000, seed=seed + 1))
  chars_per_token = sum(map(len, sample)) / sum(map(len, gpt2.GPT2Tokenizer().encode_batch(sample)))
  n = 0
  with fs.open_write(path) as f:
    for doc in synthetic_documents(int(tokens * chars_per_token), seed=seed):
      f.write((doc + "\n").encode("utf-8"))
      n += 1
  return n


def _data_config(config: specs.Spec, text_file: str, root: str, prepared: str) -> specs.DataSpec:
  return config.data.replace(
    dataset="text_file",
    text_file=text_file,
    tfds_dir=os.path.join(root, "tfds"),
    prepared_dir=os.path.join(root, prepared),
  )


def _tree_rss(pid: int) -> int:
  import psutil

  try:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
  except psutil.Error:
    return 0


def _run_measured(cmd: list) -> tuple[float, int, str]:
  """Wall seconds, peak RSS of the process tree (sampled every 0.1 s) and stdout of cmd."""
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  peak = [0]
  out: dict[str, str] = {}
  reader = threading.Thread(target=lambda: out.update(zip(("out", "err"), proc.communicate())))
  reader.start()
  while reader.is_alive():
    peak[0] = max(peak[0], _tree_rss(proc.pid))
    reader.join(0.1)
  seconds = time.perf_counter() - start
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd[:4])} ... failed: {out['err'][-2000:]}")
  return seconds, peak[0], out["out"]


def _raw_tokenizer(docs: datasets.Documents, tokenizer: Any, threads: int) -> float:
  """Tokens/s of the tokenizer's own batch call on every document (reading not timed)."""
  seconds, tokens = 0.0, 0
  for start in range(0, len(docs), 2048):
    texts = docs.read(start, start + 2048)
    t = time.perf_counter()
    tokens += sum(map(len, tokenizer.encode_batch(texts, num_threads=threads)))
    seconds += time.perf_counter() - t
  return tokens / seconds


def _peak_rss_mb() -> float:
  """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def iterator_child(args_json: str) -> None:
  """In a fresh process: open the prepared split, time the first batch, then `batches` more;
  the same for an ArrayRecord file of the same blocks; prints one JSON line."""
  import grain

  from ao_mdm.data import gpt2, pipeline, prepared

  a = json.loads(args_json)
  data = specs.DataSpec(**a["data"])
  rss_start = _peak_rss_mb()
  start = time.perf_counter()
  split = prepared.open_split(data, gpt2.GPT2Tokenizer(), "train")
  it = pipeline.train_iterator(
    split.blocks(a["block_size"]),
    global_batch_size=a["batch"],
    seed=0,
    process_index=0,
    process_count=1,
  )
  next(it)
  first = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(a["batches"]):
    batch = next(it)
  seconds = time.perf_counter() - start
  out = {
    "time_to_first_batch_s": first,
    "tokens_per_s": a["batches"] * batch.size / seconds,
    "peak_rss_mb": _peak_rss_mb(),
    "peak_rss_before_open_mb": rss_start,
  }
  if not a["array_record"]:
    sys.stdout.write(json.dumps(out) + "\n")
    return
  source = grain.sources.ArrayRecordDataSource(a["array_record"])
  ds = (
    grain.MapDataset.source(source)
    .shuffle(seed=0)
    .repeat()
    .map(lambda r: np.frombuffer(r, np.uint16).astype(np.int32))
    .batch(a["batch"], drop_remainder=True)
  )
  it = iter(ds.to_iter_dataset(read_options=pipeline.READ_OPTIONS))
  next(it)
  start = time.perf_counter()
  for _ in range(a["batches"]):
    next(it)
  out["array_record_tokens_per_s"] = a["batches"] * batch.size / (time.perf_counter() - start)
  sys.stdout.write(json.dumps(out) + "\n")


def _write_array_record(blocks: Any, path: str) -> None:
  """The blocks, one uint16 record each, in an ArrayRecord file (random access per record)."""
  from array_record.python import array_record_module

  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
  for start in range(0, len(blocks), 4096):
    for row in blocks.array(start + 4096)[start:]:
      writer.write(row.astype(np.uint16).tobytes())
  writer.close()


def _iterator(
  config: specs.Spec, bench: ml_collections.ConfigDict, data: specs.DataSpec, array_record: str = ""
) -> dict:
  """The iterator child's figures, run as a fresh process (with this process's environment)."""
  child = {
    "data": dataclasses.asdict(data),
    "block_size": config.model.block_size,
    "batch": int(bench.batch_size),
    "batches": int(bench.iterator_batches),
    "array_record": array_record,
  }
  out = subprocess.run(
    [
      sys.executable,
      "-c",
      "import sys; from ao_mdm.perf import bench_data; bench_data.iterator_child(sys.argv[1])",
      json.dumps(child),
    ],
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


def _gcs_dir(b: ml_collections.ConfigDict) -> tuple:
  """(gs:// directory of this run, the local server started for it or None)."""
  if not b.gcs:
    return None, None
  from ao_mdm.storage import emulator, gcs

  server = None
  if b.gcs == "local":
    server = emulator.LocalServer(("bench",))
    os.environ.update(server.env())
    from ao_mdm.runtime import quiet

    with quiet.silenced_stderr():  # tensorstore's line about the emulator's credentials
      gcs.start_tensorstore()
    base = "gs://bench"
  else:
    base = paths.check(b.gcs, "bench.gcs")
    if not fs.is_gcs(base):
      raise ValueError(f"bench.gcs={b.gcs!r}: expected '', 'local' or gs://BUCKET/DIR")
  return f"{base}/ao_mdm_bench_data_{os.getpid()}", server


def checkpoint_rates(directory: str, n_params: int, repeats: int = 2) -> dict:
  """MB/s of an Orbax save (synchronous, to completion) and restore of `n_params` float32
  parameters (ten arrays) at `directory`; best of `repeats`."""
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp

  from ao_mdm.checkpoint import checkpoints

  n = max(1, n_params // 10)
  state = {f"w{i}": jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(10)}
  mb = sum(x.nbytes for x in state.values()) / 1e6
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
  )
  save, restore = [], []
  for step in range(repeats):
    mgr = checkpoints.manager(directory, max_to_keep=1, async_save=False, item_names=("state",))
    start = time.perf_counter()
    checkpoints.save_items(mgr, step, state=ocp.args.StandardSave(state))
    save.append(time.perf_counter() - start)
    start = time.perf_counter()
    got = checkpoints.restore_items(mgr, step, state=ocp.args.StandardRestore(target))
    jax.block_until_ready(got.state)
    restore.append(time.perf_counter() - start)
    mgr.close()
  fs.rmtree(directory)
  return {"mb": mb, "save_mb_per_s": mb / min(save), "restore_mb_per_s": mb / min(restore)}


def bench_data(
  config: specs.Spec,
  bench: ml_collections.ConfigDict,
  config_file: str,
  log: Callable[[str], None] = print,
) -> dict:
  """Prepare and iterator figures at each size of bench.sizes; logs them, then one JSON line.
  With bench.gcs, also the iterator over the same preparation in a bucket and checkpoint save
  and restore rates there and locally.

  `config_file` is the config's path: `ao-mdm prepare` runs on it as a user would run it."""
  from ao_mdm.data import gpt2, prepare, prepared

  b = bench
  if b.dir and fs.is_gcs(paths.check(b.dir, "bench.dir")):
    raise ValueError(
      f"bench.dir={b.dir!r} is the bench's local scratch directory; give a bucket as bench.gcs"
    )
  remote, server = _gcs_dir(b)
  root = b.dir or tempfile.mkdtemp(prefix="ao_mdm_bench_data_")
  os.makedirs(root, exist_ok=True)
  cores = prepare.default_workers()
  tokenizer = gpt2.GPT2Tokenizer()
  results: dict[str, Any] = {
    "cores": cores,
    "block_size": int(config.model.block_size),
    "batch_size": int(b.batch_size),
    "sizes": {},
  }
  try:
    for size in b.sizes:
      name = f"{size / 1e6:g}M"
      text = os.path.join(root, f"synthetic_{name}.txt")
      if not os.path.isfile(text):
        log(f"[{name}] writing the synthetic corpus")
        write_synthetic_corpus(text, int(size))
      start = time.perf_counter()
      docs = datasets.load_documents(
        _data_config(config, text, root, "p"), "train", os.path.join(root, "tfds")
      )
      r: dict[str, Any] = {
        "documents": len(docs),
        "text_mb": os.path.getsize(text) / 2**20,
        "source_build_s": time.perf_counter() - start,
      }
      r["raw_tokenizer_tokens_per_s"] = _raw_tokenizer(docs, tokenizer, cores)
      log(
        f"[{name}] raw tokenizer ({cores} threads): "
        f"{r['raw_tokenizer_tokens_per_s'] / 1e6:.2f}M tokens/s"
      )
      for workers in sorted({1, cores}):
        prepared_dir = f"prepared_w{workers}"
        shutil.rmtree(os.path.join(root, prepared_dir), ignore_errors=True)
        cmd = [
          sys.executable,
          "-m",
          "ao_mdm.cli.main",
          "prepare",
          f"--config={config_file}",
          f"--config.data.text_file={text}",
          f"--config.data.tfds_dir={os.path.join(root, 'tfds')}",
          f"--config.data.prepared_dir={os.path.join(root, prepared_dir)}",
          "--splits=train",
          f"--workers={workers}",
        ]
        seconds, peak, _ = _run_measured(cmd)
        split = prepared.open_split(
          _data_config(config, text, root, prepared_dir), tokenizer, "train", docs
        )
        r["tokens"] = split.tokens
        r[f"prepare_w{workers}"] = {
          "seconds": seconds,
          "tokens_per_s": split.tokens / seconds,
          "peak_rss_mb": peak / 2**20,
        }
        log(
          f"[{name}] prepare, {workers} worker(s): {seconds:.1f} s, "
          f"{split.tokens / seconds / 1e6:.2f}M tokens/s, peak RSS {peak / 2**20:.0f} MB "
          "(process tree)"
        )
      array_record = os.path.join(root, f"blocks_{name}.array_record")
      _write_array_record(split.blocks(int(config.model.block_size)), array_record)
      data = _data_config(config, text, root, f"prepared_w{cores}")
      r["iterator"] = it = _iterator(config, b, data, array_record)
      log(
        f"[{name}] train iterator: first batch {it['time_to_first_batch_s']:.2f} s, "
        f"{it['tokens_per_s'] / 1e6:.1f}M tokens/s (ArrayRecord through grain: "
        f"{it['array_record_tokens_per_s'] / 1e6:.1f}M), peak RSS {it['peak_rss_mb']:.0f} MB"
      )
      os.remove(array_record)
      if remote:  # the same preparation in the bucket, read by a fresh process, twice: the
        # first open hashes every shard (new generations), the second finds them verified
        data = data.replace(prepared_dir=f"{remote}/prepared_{name}")
        start = time.perf_counter()
        fs.copytree(os.path.join(root, f"prepared_w{cores}"), data.prepared_dir)
        r["gcs_upload_mb_per_s"] = split.tokens * 2 / 1e6 / (time.perf_counter() - start)
        r["gcs_iterator_first_open"] = _iterator(config, b, data)
        r["gcs_iterator"] = it = _iterator(config, b, data)
        log(
          f"[{name}] train iterator from {remote}: first batch "
          f"{it['time_to_first_batch_s']:.2f} s ("
          f"{r['gcs_iterator_first_open']['time_to_first_batch_s']:.2f} s at the first "
          f"open, which hashes every shard), {it['tokens_per_s'] / 1e6:.1f}M tokens/s"
        )
        fs.rmtree(data.prepared_dir)
      results["sizes"][name] = r
    if remote:
      for where, directory in (
        ("local", os.path.join(root, "checkpoint")),
        ("gcs", f"{remote}/checkpoint"),
      ):
        results[f"checkpoint_{where}"] = c = checkpoint_rates(directory, int(b.checkpoint_params))
        log(
          f"checkpoint of {b.checkpoint_params / 1e6:.0f}M float32 params ({where}): save "
          f"{c['save_mb_per_s']:.0f} MB/s, restore {c['restore_mb_per_s']:.0f} MB/s"
        )
  finally:
    if not b.dir:
      shutil.rmtree(root, ignore_errors=True)
    if server is not None:
      server.stop()
  results["summary"] = _summary(results, cores)
  log(json.dumps(results))
  return results


def _summary(results: dict, cores: int) -> dict:
  """The issue's ratios and the OpenWebText projection, from the largest size."""
  sizes = list(results["sizes"].values())
  big = sizes[-1]
  one, many = big["prepare_w1"]["tokens_per_s"], big[f"prepare_w{cores}"]["tokens_per_s"]
  out = {
    "prepare_over_raw_tokenizer": many / big["raw_tokenizer_tokens_per_s"],
    f"prepare_{cores}_workers_over_1": many / one,
    "prepare_peak_rss_mb": big[f"prepare_w{cores}"]["peak_rss_mb"],
    "iterator_time_to_first_batch_s": max(s["iterator"]["time_to_first_batch_s"] for s in sizes),
    "iterator_tokens_per_s": min(s["iterator"]["tokens_per_s"] for s in sizes),
    "openwebtext_core_hours": OPENWEBTEXT_TOKENS / one / 3600,
  }
  if len(sizes) > 1:
    out["iterator_rss_growth_mb"] = (
      big["iterator"]["peak_rss_mb"] - sizes[0]["iterator"]["peak_rss_mb"]
    )
  if "gcs_iterator" in big:
    out["gcs_iterator_tokens_per_s"] = min(s["gcs_iterator"]["tokens_per_s"] for s in sizes)
    out["gcs_iterator_time_to_first_batch_s"] = max(
      s["gcs_iterator"]["time_to_first_batch_s"] for s in sizes
    )
    out["gcs_over_local_iterator"] = (
      big["gcs_iterator"]["tokens_per_s"] / big["iterator"]["tokens_per_s"]
    )
    for key in ("save_mb_per_s", "restore_mb_per_s"):
      out[f"checkpoint_{key}"] = {w: results[f"checkpoint_{w}"][key] for w in ("local", "gcs")}
  return out
