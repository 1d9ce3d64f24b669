"""The `ao-mdm` command: `ao-mdm COMMAND [--flags]`; `ao-mdm help` lists the commands.

A user error (bad flag, value, file or checkpoint) prints one `error:` line and exits 2;
AO_MDM_TRACEBACK=1 shows the traceback instead.
"""
import os
import sys
from typing import Optional

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

COMMANDS = {
    "train": "train a model: --config=configs/tiny.py --workdir=DIR [--config.x.y=value ...]",
    "prepare": "tokenize a config's dataset once into token shards that train and eval read: "
               "--config=... [--splits=train,validation --workers=N --workdir=DIR]",
    "info": "parameter count and FLOPs per token of a config: --config=...",
    "tokenizer": "train a SentencePiece tokenizer: --corpus=sotu|PATH --vocab_size=N --out=DIR",
    "export": "write the EMA params alone: --workdir=DIR --out=DIR [--weights=ema|params]",
    "sample": "sample texts: --checkpoint=DIR [--prompt=TEXT | --infill='a [MASK] b'] [--steps=64 ...]",
    "eval": "perplexities: --checkpoint=DIR [--datasets=sotu,wikitext2 | --text_file=PATH] "
            "[--protocol=paper|custom --ensemble=8,64]; or --generated=FILE.jsonl --scorer=DIR",
    "import-torch": "convert a reference PyTorch checkpoint: --checkpoint=ckpt.pt --out=DIR "
                    "[--weights=ema|model] [--variant=ao|sigma]",
    "import-gpt2": "convert a local Hugging Face GPT-2 (e.g. gpt2-large) into a scorer for "
                   "eval --generated: --hf_dir=DIR --out=DIR",
    "compile": "ahead-of-time compile of the train step for a TPU topology: --config=... "
               "--topology=v5e:4x4",
    "bench": "benchmarks: `bench sample --config=configs/bench_sampler.py [--mode=speculative "
             "--checkpoint=DIR]`, `bench train --config=configs/bench_train.py`, "
             "`bench data --config=configs/bench_data.py`",
}
BENCHES = ("sample", "train", "data")
# The flags each command reads; any other flag of ours given to it is an error.
_SAMPLING = ("prompt", "infill", "infill_span", "mode", "steps", "schedule", "draft", "score",
             "temperature", "top_p", "top_p_rule", "top_k", "order", "num_samples")
COMMAND_FLAGS = {
    "train": ("config", "workdir", "init_from", "start_over", "coordinator", "num_processes",
              "process_id", "init_timeout"),
    "prepare": ("config", "splits", "workers", "workdir", "num_processes", "process_id"),
    "info": ("config",),
    "tokenizer": ("corpus", "vocab_size", "out"),
    "export": ("workdir", "out", "weights"),
    "sample": ("checkpoint", "weights", *_SAMPLING, "batch_size", "seed", "out"),
    "eval": ("checkpoint", "weights", "datasets", "text_file", "lambada_file", "protocol", "split",
             "orders", "ensemble", "max_blocks", "batch_size", "seed", "generated", "scorer"),
    "import-torch": ("checkpoint", "out", "weights", "variant"),
    "import-gpt2": ("hf_dir", "out"),
    "compile": ("config", "topology"),
    "bench": ("config", "baseline", "mode", "checkpoint", "weights"),
}
FLAGS = flags.FLAGS


def _define_flags() -> None:
  config_flags.DEFINE_config_file("config", None, "ml_collections config file.",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Training work dir (checkpoints, tokenizer, logs).")
  flags.DEFINE_string("out", None, "Output path.")
  flags.DEFINE_string("corpus", "sotu", "Dataset registry name or a local text file.")
  flags.DEFINE_integer("vocab_size", 2048, "Tokenizer vocab size (a multiple of 128).")
  flags.DEFINE_enum("weights", "ema", ["ema", "params", "model"],
                    "Which params: of a training work dir, ema | params (an export or import "
                    "holds one set: ema); import-torch: which of the PyTorch checkpoint's to "
                    "import, ema | model.")
  flags.DEFINE_enum("variant", None, ["ao", "sigma"], "import-torch: model variant (default: "
                    "detected from the keys).")
  flags.DEFINE_string("checkpoint", None, "A training work dir or an export (import-torch: "
                      "the authors' PyTorch ckpt.pt file).")
  flags.DEFINE_string("prompt", "", "sample: text the samples start with.")
  flags.DEFINE_string("infill", "", "sample: text with [MASK] spans to fill in.")
  flags.DEFINE_integer("infill_span", 8, "sample: tokens generated per [MASK].")
  flags.DEFINE_enum("mode", "parallel", ["parallel", "speculative", "confidence"],
                    "sample: parallel = S steps in a random (or L2R) order; speculative = exact "
                    "L2R samples, --draft tokens drafted and verified per forward; confidence = "
                    "S steps, the most confident positions first.")
  flags.DEFINE_integer("steps", 64, "sample: decoding steps S (parallel, confidence).")
  flags.DEFINE_integer("draft", 4, "sample: tokens drafted per forward (speculative).")
  flags.DEFINE_enum("score", "max_prob", ["max_prob", "entropy"],
                    "sample: confidence of a prediction (confidence mode): its largest "
                    "probability, or minus its entropy.")
  flags.DEFINE_enum("schedule", "linear", ["linear", "cosine"], "sample: unmasking schedule.")
  flags.DEFINE_float("temperature", 1.0, "sample: softmax temperature; 0 is greedy.")
  flags.DEFINE_float("top_p", 1.0, "sample: top-p mass in (0, 1]; 1 filters nothing.")
  flags.DEFINE_enum("top_p_rule", "authors", ["authors", "nucleus"],
                    "sample: authors = drop every token whose inclusive cumulative probability "
                    "exceeds top_p, keeping the most likely (the authors' catsample.py); nucleus = "
                    "keep the smallest set whose probability reaches top_p.")
  flags.DEFINE_integer("top_k", 0, "sample: keep the k most likely tokens; 0 is off.")
  flags.DEFINE_enum("order", None, ["random", "l2r"],
                    "sample: order of the unknown tokens; default: l2r after --prompt or "
                    "--infill (as the authors' cond_generate), random without.")
  flags.DEFINE_integer("num_samples", 4, "sample: how many samples.")
  flags.DEFINE_integer("batch_size", 4, "sample: samples per batch; eval: blocks per batch.")
  flags.DEFINE_integer("seed", 0, "Random seed.")
  flags.DEFINE_string("datasets", "sotu", "eval: comma-separated dataset registry names.")
  flags.DEFINE_string("text_file", None, "eval: a local UTF-8 text file (one document per line).")
  flags.DEFINE_enum("protocol", "paper", ["paper", "custom"],
                    "eval: paper = the authors' protocol (split per dataset: wikitext2 train, "
                    "others test; any-order on 128 shuffled blocks, all of PTB, one order each; "
                    "L2R and ensemble on the whole split); custom = --split, --max_blocks, "
                    "--orders.")
  flags.DEFINE_string("split", "validation", "eval (custom protocol): dataset split.")
  flags.DEFINE_integer("orders", 4, "eval (custom protocol): random orders per sequence for the "
                       "any-order perplexity.")
  flags.DEFINE_string("ensemble", "", "eval: context-order ensemble sizes M, e.g. 8,64; costs "
                      "about M/2 full forwards per target token.")
  flags.DEFINE_integer("max_blocks", 64, "eval (custom protocol): at most this many blocks per "
                       "dataset (0: all).")
  flags.DEFINE_string("lambada_file", None, "eval: OpenAI's lambada_test.jsonl (local) for "
                      "--datasets=lambada.")
  flags.DEFINE_string("hf_dir", None, "import-gpt2: a local Hugging Face GPT-2 directory.")
  flags.DEFINE_string("generated", None, "eval: samples (ao-mdm sample --out) to score.")
  flags.DEFINE_string("scorer", None, "eval: scores --generated samples left to right: an "
                      "import-gpt2 export (the paper: GPT-2 Large) or an ao_mdm checkpoint.")
  flags.DEFINE_string("topology", None, "compile: a TPU topology such as v5e:4x4.")
  flags.DEFINE_enum("baseline", "none", ["none", "torch"],
                    "bench train: torch = also train the same model, step and batch in plain "
                    "PyTorch (eager, float32, all cores; needs the [torch] extra) and print its "
                    "tokens/s and ours over it.")
  flags.DEFINE_string("splits", "train,validation", "prepare: comma-separated splits.")
  flags.DEFINE_integer("workers", None, "prepare: worker processes (default: every core).")
  flags.DEFINE_string("init_from", None, "train: start from the params of an export or import.")
  flags.DEFINE_boolean("start_over", False, "train: when no checkpoint of --workdir can be "
                       "read, move them aside and train from step 0 (otherwise an error).")
  flags.DEFINE_string("coordinator", None, "Multi-process: coordinator HOST:PORT (process 0).")
  flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
  flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")
  flags.DEFINE_integer("init_timeout", 180, "Multi-process: seconds to wait for the other "
                       "processes and the coordinator before giving up.")


def _require(**named) -> None:
  missing = [f"--{k}" for k, v in named.items() if v in (None, "")]
  if missing:
    raise app.UsageError(f"missing {', '.join(missing)}")


def _int_list(name: str) -> list:
  """A comma-separated flag of positive integers, e.g. --ensemble=8,64."""
  items = [x.strip() for x in FLAGS[name].value.split(",") if x.strip()]
  if not all(x.isdigit() and int(x) > 0 for x in items):
    raise app.UsageError(f"--{name}={FLAGS[name].value}: expected positive integers separated "
                         "by commas, e.g. 8,64")
  return [int(x) for x in items]


def _preflight(command: str) -> None:
  """Path and value checks that need no JAX: a bad one fails in well under a second."""
  from ao_mdm import checks
  if command == "train":
    _require(config=FLAGS.config, workdir=FLAGS.workdir)
    if os.path.exists(FLAGS.workdir) and not os.path.isdir(FLAGS.workdir):
      raise app.UsageError(f"--workdir {FLAGS.workdir!r} is a file; give a directory")
    checks.output_file(os.path.join(FLAGS.workdir, "metrics.jsonl"), "--workdir")
    if FLAGS.init_from:
      checks.checkpoint(FLAGS.init_from, "--init_from")
    checks.processes(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id,
                     FLAGS.init_timeout)
  elif command == "prepare":
    _require(config=FLAGS.config)
    if FLAGS.workdir and os.path.exists(FLAGS.workdir) and not os.path.isdir(FLAGS.workdir):
      raise app.UsageError(f"--workdir {FLAGS.workdir!r} is a file; give a directory")
    if FLAGS.workers is not None and FLAGS.workers < 1:
      raise app.UsageError(f"--workers={FLAGS.workers} must be >= 1")
    if not _names("splits"):
      raise app.UsageError("--splits is empty; give e.g. --splits=train,validation")
  elif command in ("info", "compile", "bench"):
    _require(config=FLAGS.config)
    if command == "compile":
      _require(topology=FLAGS.topology)
      checks.topology(FLAGS.topology)
    if command == "bench" and FLAGS.checkpoint:
      checks.checkpoint(FLAGS.checkpoint)
  elif command == "tokenizer":
    _require(out=FLAGS.out)
    if os.path.sep in FLAGS.corpus or os.path.isfile(FLAGS.corpus):
      checks.text_file(FLAGS.corpus, "--corpus")
    checks.new_output_dir(FLAGS.out)
  elif command == "export":
    _require(workdir=FLAGS.workdir, out=FLAGS.out)
    if FLAGS.weights not in ("ema", "params"):
      raise app.UsageError(f"--weights={FLAGS.weights}; export accepts ema or params")
    checks.checkpoint(FLAGS.workdir, "--workdir")
    checks.new_output_dir(FLAGS.out)
  elif command == "sample":
    _require(checkpoint=FLAGS.checkpoint)
    checks.checkpoint(FLAGS.checkpoint)
    if FLAGS.out:
      checks.new_output_file(FLAGS.out)
    if FLAGS.prompt and FLAGS.infill:
      raise app.UsageError("give --prompt or --infill, not both")
    if FLAGS["infill_span"].present and not FLAGS.infill:
      raise app.UsageError("--infill_span applies with --infill")
    checks.mode_options(FLAGS.mode, {name for name in (*_SETTINGS, "draft", "score")
                                     if FLAGS[name].present})
  elif command == "eval":
    if FLAGS.generated:
      others = [f"--{k}" for k in ("checkpoint", "datasets", "text_file", "lambada_file",
                                   "protocol", "split", "orders", "ensemble", "max_blocks")
                if FLAGS[k].present]
      if others:
        raise app.UsageError(f"{', '.join(others)} do not apply with --generated (which scores "
                             "samples under --scorer)")
      _require(scorer=FLAGS.scorer)
      checks.text_file(FLAGS.generated, "--generated")
      if not os.path.isfile(os.path.join(FLAGS.scorer, "gpt2_config.json")):  # not import-gpt2's
        checks.checkpoint(FLAGS.scorer, "--scorer")
      return
    _require(checkpoint=FLAGS.checkpoint)
    checks.checkpoint(FLAGS.checkpoint)
    for name in ("text_file", "lambada_file"):
      if FLAGS[name].value:
        checks.text_file(FLAGS[name].value, f"--{name}")
    if FLAGS.text_file:
      others = [f"--{k}" for k in ("datasets", "lambada_file", "split", "max_blocks")
                if FLAGS[k].present]
      if others:
        raise app.UsageError(f"{', '.join(others)} do not apply with --text_file (which "
                             "evaluates every block of that one file)")
    elif not _names("datasets"):
      raise app.UsageError("--datasets is empty; give registry names, e.g. --datasets=sotu")
    elif FLAGS.lambada_file and "lambada" not in _names("datasets"):
      raise app.UsageError("--lambada_file applies with --datasets=...,lambada")
    custom = [f"--{k}" for k in ("split", "max_blocks", "orders") if FLAGS[k].present]
    if FLAGS.protocol == "paper" and custom:
      raise app.UsageError(f"{', '.join(custom)} apply with --protocol=custom; --protocol=paper "
                           "fixes the split, block count and orders per dataset")
    if FLAGS.orders < 1 or FLAGS.batch_size < 1 or FLAGS.max_blocks < 0:
      raise app.UsageError(f"--orders={FLAGS.orders} and --batch_size={FLAGS.batch_size} must be "
                           f">= 1, --max_blocks={FLAGS.max_blocks} >= 0 (0: all)")
    _int_list("ensemble")
  elif command == "import-torch":
    _require(checkpoint=FLAGS.checkpoint, out=FLAGS.out)
    if FLAGS.weights not in ("ema", "model"):
      raise app.UsageError(f"--weights={FLAGS.weights}; import-torch accepts ema or model")
    if not os.path.isfile(FLAGS.checkpoint):
      raise FileNotFoundError(f"--checkpoint {FLAGS.checkpoint!r}: no such file (a PyTorch "
                              "ckpt.pt of the authors' code)")
    checks.new_output_dir(FLAGS.out)
  elif command == "import-gpt2":
    _require(hf_dir=FLAGS.hf_dir, out=FLAGS.out)
    checks.new_output_dir(FLAGS.out)


def _train() -> None:
  from ao_mdm import sharding, train
  sharding.initialize_distributed(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id,
                                  FLAGS.init_timeout)
  result = train.train_and_evaluate(FLAGS.config, FLAGS.workdir, FLAGS.init_from,
                                    FLAGS.start_over)
  sys.exit(result.get("exit_code", 0))


def _names(name: str) -> list:
  return [x.strip() for x in FLAGS[name].value.split(",") if x.strip()]


def _prepare() -> None:
  from ao_mdm.data import prepared, tokenizer as tok_lib
  config = FLAGS.config
  index, count = prepared.launcher_process(FLAGS.process_id, FLAGS.num_processes)
  tokenizer = tok_lib.run_tokenizer(config, FLAGS.workdir)
  for split in _names("splits"):
    done = prepared.prepare(config.data, tokenizer, split, workers=FLAGS.workers or 0,
                            process_index=index, process_count=count)
    if done is not None:
      print(f"{split}: {done.documents:,} documents, {done.tokens:,} tokens in "
            f"{len(done.manifest['shards'])} shards, verified: {done.directory}")


def _info() -> None:
  import flax.linen as nn
  import jax
  from ao_mdm import model
  cfg = FLAGS.config.model
  model.validate_model_config(cfg)
  shapes = nn.unbox(jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.key(0)))
  n = model.count_params(shapes)
  fpt = model.flops_per_token(cfg, n)
  print(f"variant={cfg.variant} L={cfg.n_layer} D={cfg.n_embd} H={cfg.n_head} "
        f"T={cfg.block_size} V={cfg.vocab_size}")
  print(f"parameters: {n:,}")
  print(f"training FLOPs per token: {fpt:,.0f} ({fpt / 1e9:.3f} GFLOP)")


def _tokenizer() -> None:
  from ao_mdm.data import tokenizer
  print(tokenizer.train_tokenizer_cli(FLAGS.corpus, FLAGS.vocab_size, FLAGS.out))


def _export() -> None:
  from ao_mdm import checkpoints
  print(checkpoints.export(FLAGS.workdir, FLAGS.out, FLAGS.weights))


def _bench(what: str) -> None:
  baseline = None if FLAGS.baseline == "none" else FLAGS.baseline
  if baseline and what != "train":
    raise app.UsageError(f"--baseline={baseline} applies to `ao-mdm bench train` only")
  if FLAGS.mode != "parallel" and what != "sample":
    raise app.UsageError(f"--mode={FLAGS.mode} applies to `ao-mdm bench sample` only")
  if FLAGS.mode == "speculative" and not FLAGS.checkpoint:
    raise app.UsageError("bench sample --mode=speculative needs --checkpoint (a trained model: "
                         "acceptance depends on it)")
  if what == "data":
    from ao_mdm.data import bench_data
    bench_data.bench_data(FLAGS.config, FLAGS["config"].config_filename)
    return
  from ao_mdm import bench
  if what == "train":
    bench.bench_train(FLAGS.config, baseline)
  elif FLAGS.mode == "speculative":
    config, params, _ = _load_run(FLAGS.checkpoint)
    bench.bench_speculative(FLAGS.config, params, config.model)
  else:
    bench.bench_sample(FLAGS.config)


def _load_run(path: str) -> tuple:
  """(config, params, tokenizer) of a training work dir or export."""
  from ao_mdm import checkpoints
  from ao_mdm.data import tokenizer as tok_lib
  config, params = checkpoints.load_params(path, FLAGS.weights)
  tokenizer = tok_lib.load_saved_tokenizer(config.data, config.model.vocab_size, path)
  tok_lib.check_vocab(tokenizer, config.model.vocab_size)
  return config, params, tokenizer


_SETTINGS = ("steps", "schedule", "temperature", "top_p", "top_p_rule", "top_k", "order")
_MODE_SETTINGS = ("mode", "draft", "score")


def _sample() -> None:
  import json
  import tqdm
  from ao_mdm import generate, interrupts, sampling
  options = {k: FLAGS[k].value for k in _SETTINGS}
  sampling.validate_sampling_args(**{**options, "steps": FLAGS.steps})
  if not FLAGS["steps"].present:
    options["steps"] = None  # generate.DEFAULT_STEPS, or fewer if fewer positions are unknown
  generate.check_counts(FLAGS.num_samples, FLAGS.batch_size)
  config, params, tokenizer = _load_run(FLAGS.checkpoint)
  batches = -(-FLAGS.num_samples // min(FLAGS.batch_size, FLAGS.num_samples))
  settings = {k: FLAGS[k].value
              for k in ("checkpoint", "prompt", "infill", "seed", *_SETTINGS, *_MODE_SETTINGS)}
  partial = f"{FLAGS.out}.partial" if FLAGS.out else None
  if partial:  # missing directories of --out are made (checks.output_file checked the parent)
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  written = [0]

  def keep_finished():  # Ctrl-C: the finished samples become the output
    out.flush()
    if partial and written[0]:
      os.replace(partial, FLAGS.out)
      print(f"kept the {written[0]} finished samples in {FLAGS.out}", file=sys.stderr)
    elif partial:
      os.remove(partial)
  with tqdm.tqdm(total=batches, desc="sampling", unit="batch", disable=batches < 2) as bar, \
      open(partial or os.devnull, "w") as out, interrupts.on_interrupt(keep_finished):
    for i, r in enumerate(generate.sample_texts(
        params, config.model, tokenizer, num_samples=FLAGS.num_samples,
        batch_size=FLAGS.batch_size, prompt=FLAGS.prompt, infill=FLAGS.infill,
        infill_span=FLAGS.infill_span, seed=FLAGS.seed, progress=bar.update, mode=FLAGS.mode,
        draft=FLAGS.draft, score=FLAGS.score, **options)):
      shown = r.get("marked", r["text"])  # with a prompt or infill: generated runs in [[ ]]
      how = (f"speculative L2R, draft {FLAGS.draft}: {r['forwards']} forwards, "
             f"{r['accepted']} drafts accepted" if FLAGS.mode == "speculative" else
             f"steps={r['steps']}, "
             f"{r.get('order', FLAGS.mode)} order")
      bar.write(f"--- sample {i} ({how}) ---\n{shown}\n")
      out.write(json.dumps({**r, "tokenizer": config.data.tokenizer, **settings,
                            "steps": r.get("steps"), "order": r.get("order")}) + "\n")
      out.flush()
      written[0] += 1
  if partial:
    os.replace(partial, FLAGS.out)
    print(f"wrote {written[0]} samples to {FLAGS.out}")


def _import_torch() -> None:
  from ao_mdm import torch_import
  torch_import.import_torch(FLAGS.checkpoint, FLAGS.out, FLAGS.weights, FLAGS.variant)
  print(f"wrote {FLAGS.out}")


def _import_gpt2() -> None:
  from ao_mdm import gpt2_scorer
  print(f"wrote {gpt2_scorer.import_hf_gpt2(FLAGS.hf_dir, FLAGS.out)}")


def _eval_generated() -> None:
  import json
  import time
  from ao_mdm import checkpoints, evaluation, gpt2_scorer
  records = evaluation.read_generated(FLAGS.generated)
  if gpt2_scorer.is_gpt2_export(FLAGS.scorer):
    scorer = gpt2_scorer.load_gpt2_scorer(FLAGS.scorer)
  else:
    config, params = checkpoints.load_params(FLAGS.scorer, FLAGS.weights)
    scorer = evaluation.Scorer(params, config.model, config.mesh)
  start = time.perf_counter()
  result = evaluation.generative_perplexity(
      scorer, evaluation.generated_ids(records, scorer), FLAGS.batch_size)
  result["seconds"] = time.perf_counter() - start
  print(f"generative perplexity {result['gen_ppl']:.2f} (median {result['gen_ppl_median']:.2f}), "
        f"unigram entropy {result['unigram_entropy']:.3f} nats, {result['samples']} samples")
  print(json.dumps(result))


def _eval() -> None:
  if FLAGS.generated:
    return _eval_generated()
  import json
  import tqdm
  from ao_mdm import evaluation
  ensemble = _int_list("ensemble")
  names = _names("datasets")
  config, params, tokenizer = _load_run(FLAGS.checkpoint)
  config.model.dtype = "float32"  # the authors evaluate any-order and ensemble in fp32
  sets = evaluation.eval_sets(
      config.data, tokenizer, config.model.block_size, names=names, text_file=FLAGS.text_file,
      lambada_file=FLAGS.lambada_file, protocol=FLAGS.protocol, split=FLAGS.split,
      max_blocks=FLAGS.max_blocks or None)
  scorer = evaluation.Scorer(params, config.model, config.mesh)
  bars = []

  def progress(name, total):
    bars.append(tqdm.tqdm(total=total, desc=f"eval {name}", unit="block"))
    return bars[-1].update
  counts = evaluation.load_unigram_counts(FLAGS.checkpoint)
  results = evaluation.evaluate_sets(scorer, sets, protocol=FLAGS.protocol, orders=FLAGS.orders,
                                     ensemble=ensemble, batch_size=FLAGS.batch_size,
                                     seed=FLAGS.seed, progress=progress, unigram_counts=counts)
  for bar in bars:
    bar.close()
  unigram = counts is not None  # runs saved before the counts existed have no baseline
  print(f"{'dataset':<24} {'tokens':>8} {'L2R ppl':>9} {'any-order ppl':>16} "
        + (f"{'unigram ppl':>12} " if unigram else "")
        + " ".join(f"{'ens M=' + str(m):>10}" for m in ensemble))
  for name, r in results.items():
    print(f"{name[-24:]:<24} {r['tokens']:>8} {r['l2r_ppl']:>9.2f} "
          f"{r['any_order_ppl']:>9.2f} +-{r['any_order_se']:<5.2f}"
          + (f"{r['unigram_ppl']:>12.2f} " if unigram else "")
          + " ".join(f"{r['ensemble_ppl'][str(m)]:>10.2f}" for m in ensemble))
  print(json.dumps(results))


def _compile() -> None:
  from ao_mdm import aot
  try:
    aot.compile_for_topology(FLAGS.config, FLAGS.topology, name=FLAGS["config"].config_filename)
  except RuntimeError as e:  # libtpu missing or locked
    raise app.UsageError(str(e)) from e


def _quiet_environment() -> None:
  """Before JAX loads: no TensorFlow start-up lines, and no TPU start-up on a host without one.

  With libtpu installed (the [tpu] extra) JAX probes for a TPU and prints errors where there is
  none. A host with a TPU (/dev/accel*, /dev/vfio/N) or an NVIDIA GPU keeps JAX's own choice;
  `compile` targets TPU topologies through the CPU platform either way.
  """
  import glob
  from ao_mdm import checks
  if os.environ.get("JAX_PLATFORMS"):
    try:
      checks.platforms(os.environ["JAX_PLATFORMS"])
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  if not any(glob.glob(p) for p in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _usage() -> str:
  lines = ["usage: ao-mdm COMMAND [--flags]", "", "commands:"]
  lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
  return "\n".join(lines)


def _command_help(command: str) -> str:
  """`ao-mdm COMMAND --help`: what the command does and its flags with their defaults."""
  lines = [f"usage: ao-mdm {command} [--flags]", f"  {COMMANDS[command]}", "", "flags:"]
  for name in COMMAND_FLAGS[command]:
    flag = FLAGS[name]
    default = "" if flag.default in (None, "") else f" (default: {flag.default})"
    lines.append(f"  --{name}: {flag.help}{default}")
  if "config" in COMMAND_FLAGS[command]:
    lines.append("  --config.KEY=VALUE: override any config field, e.g. --config.train.num_steps=100")
  return "\n".join(lines)


def _check_command_flags(command: str, argv: list) -> None:
  """Stray positional arguments and flags of other commands are errors."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected argument(s) {' '.join(argv[1:])!r}; flags are --name=value")
  allowed = set(COMMAND_FLAGS[command.split()[0]])
  foreign = [f"--{name}" for name in _OUR_FLAGS if FLAGS[name].present and name not in allowed]
  if foreign:
    raise app.UsageError(f"{', '.join(foreign)} not accepted by `ao-mdm {command}`; "
                         f"`ao-mdm {command.split()[0]} --help` lists its flags")


_OUR_FLAGS: list = []


def run() -> None:
  """Console-script entry point: `ao-mdm COMMAND [SUBCOMMAND] --flags`."""
  try:
    _run()
  except BrokenPipeError:  # e.g. `ao-mdm --help | head`: the reader left, nothing to report
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)


def _run() -> None:
  if len(sys.argv) == 3 and sys.argv[1] == "help" and sys.argv[2] in COMMANDS:
    sys.argv[1:] = [sys.argv[2], "--help"]  # `ao-mdm help sample` is `ao-mdm sample --help`
  if len(sys.argv) < 2 or sys.argv[1] in ("help", "-h", "--help"):
    print(_usage())
    sys.exit(0 if len(sys.argv) >= 2 else 2)
  if sys.argv[1] not in COMMANDS:
    print(f"error: unknown command {sys.argv[1]!r}; accepted: {', '.join(COMMANDS)} "
          "(`ao-mdm help` describes them)", file=sys.stderr)
    sys.exit(2)
  command, rest = sys.argv[1], sys.argv[2:]
  from ao_mdm import interrupts
  interrupts.install()
  _quiet_environment()
  handler = {"train": _train, "prepare": _prepare, "info": _info, "tokenizer": _tokenizer,
             "export": _export, "sample": _sample, "import-torch": _import_torch, "eval": _eval,
             "import-gpt2": _import_gpt2, "compile": _compile}.get(command)
  if command == "bench" and not (rest and rest[0] in ("--help", "-h", "--helpshort")):
    if not rest or rest[0] not in BENCHES:
      got = repr(rest[0]) if rest else "nothing"
      print(f"error: ao-mdm bench takes one of {', '.join(BENCHES)} first, got {got}; e.g. "
            "`ao-mdm bench train --config=configs/bench_train.py`", file=sys.stderr)
      sys.exit(2)
    what, rest = rest[0], rest[1:]
    handler, command = (lambda: _bench(what)), f"bench {what}"
  before = set(FLAGS)
  _define_flags()
  _OUR_FLAGS[:] = sorted(set(FLAGS) - before)
  if any(a in ("--help", "-h", "--helpshort") for a in rest):
    print(_command_help(command.split()[0]))
    sys.exit(0)

  def main(argv):
    logging.set_verbosity(logging.ERROR)  # Orbax/TFDS warnings are not the user's business
    try:
      _check_command_flags(command, argv)
      _preflight(command.split()[0])
      handler()
    except (app.UsageError, ValueError, OSError, ImportError) as e:
      _fail(_error_text(e))

  app.run(main, argv=[f"ao-mdm {command}"] + rest, flags_parser=_parse_flags)


def _fail(message: str) -> None:
  """One `error:` line and exit 2; AO_MDM_TRACEBACK=1 re-raises for the traceback."""
  if os.environ.get("AO_MDM_TRACEBACK"):
    raise
  print(f"error: {' '.join(message.split())}", file=sys.stderr)
  sys.exit(2)


def _error_text(e: Exception) -> str:
  """The message of an error, an OSError as `what: path` rather than `[Errno N] ...`."""
  if isinstance(e, OSError) and e.strerror and e.filename and str(e).startswith("[Errno"):
    return f"{e.strerror}: {e.filename!r}" + (f" -> {e.filename2!r}" if e.filename2 else "")
  return str(e)


def _parse_flags(argv: list) -> list:
  """absl's parsing, with a bad config file, key or value reported as one error line."""
  try:
    rest = FLAGS(argv)
    if FLAGS["config"].present:
      FLAGS.config.keys()  # a config file that failed to load raises here
      if not isinstance(FLAGS.config, ml_collections.ConfigDict):
        raise TypeError("get_config() did not return a ConfigDict")
    return rest
  except Exception as e:  # pylint: disable=broad-except  (flag and config-file errors)
    _fail(_flag_error(argv, e))


def _flag_error(argv: list, e: Exception) -> str:
  """The clearest line for a flag error: missing or broken config file, unknown config key."""
  path = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None)
  if path is not None:
    file, _, arg = path.partition(":")  # configs/paper.py:NAME passes NAME to get_config
    if not os.path.isfile(file):
      return f"--config {file!r}: no such file (e.g. configs/tiny.py)"
    try:
      config = _load_config_file(file, arg or None)
    except Exception as load_error:  # pylint: disable=broad-except
      return (f"--config {path!r} cannot be loaded ({type(load_error).__name__}: {load_error}); "
              "a config file defines get_config() returning a ConfigDict")
    if not isinstance(config, ml_collections.ConfigDict):
      return (f"--config {path!r}: get_config() returned a {type(config).__name__}, not an "
              "ml_collections.ConfigDict")
    for arg in argv[1:]:
      name = arg.lstrip("-").split("=", 1)[0]
      if not name.startswith("config."):
        continue
      node, keys = config, name.split(".")[1:]
      for i, key in enumerate(keys):
        if not hasattr(node, "keys") or key not in node:
          where = "config." + ".".join(keys[:i]) if i else "the config"
          known = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "none (a value)"
          return f"--{name}: {where} has no key {key!r}; its keys: {known}"
        node = node[key]
  return str(e)


def _load_config_file(path: str, arg: Optional[str] = None):
  import importlib.util
  spec = importlib.util.spec_from_file_location("ao_mdm_user_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)


if __name__ == "__main__":
  run()
