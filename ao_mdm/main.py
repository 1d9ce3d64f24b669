"""The `ao-mdm` command: `ao-mdm COMMAND [--flags]`; `ao-mdm help` lists the commands.

A user error (bad flag, value, file or checkpoint) prints one `error:` line and exits 2;
AO_MDM_TRACEBACK=1 shows the traceback instead.
"""
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

COMMANDS = {
    "train": "train a model: --config=configs/tiny.py --workdir=DIR [--config.x.y=value ...]",
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
    "bench": "benchmarks: `bench sample --config=configs/bench_sampler.py`, "
             "`bench train --config=configs/bench_train.py`",
}
BENCHES = ("sample", "train")
# The flags each command reads; any other flag of ours given to it is an error.
_SAMPLING = ("prompt", "infill", "infill_span", "steps", "schedule", "temperature", "top_p",
             "top_p_rule", "top_k", "order", "num_samples")
COMMAND_FLAGS = {
    "train": ("config", "workdir", "init_from", "coordinator", "num_processes", "process_id"),
    "info": ("config",),
    "tokenizer": ("corpus", "vocab_size", "out"),
    "export": ("workdir", "out", "weights"),
    "sample": ("checkpoint", "weights", *_SAMPLING, "batch_size", "seed", "out"),
    "eval": ("checkpoint", "weights", "datasets", "text_file", "lambada_file", "protocol", "split",
             "orders", "ensemble", "max_blocks", "batch_size", "seed", "generated", "scorer"),
    "import-torch": ("checkpoint", "out", "weights", "variant"),
    "import-gpt2": ("hf_dir", "out"),
    "compile": ("config", "topology"),
    "bench": ("config",),
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
                    "Which params: ema | params (training work dirs), ema | model (import-torch).")
  flags.DEFINE_enum("variant", None, ["ao", "sigma"], "import-torch: model variant (default: "
                    "detected from the keys).")
  flags.DEFINE_string("checkpoint", None, "A training work dir or an export.")
  flags.DEFINE_string("prompt", "", "sample: text the samples start with.")
  flags.DEFINE_string("infill", "", "sample: text with [MASK] spans to fill in.")
  flags.DEFINE_integer("infill_span", 8, "sample: tokens generated per [MASK].")
  flags.DEFINE_integer("steps", 64, "sample: decoding steps S.")
  flags.DEFINE_enum("schedule", "linear", ["linear", "cosine"], "sample: unmasking schedule.")
  flags.DEFINE_float("temperature", 1.0, "sample: softmax temperature; 0 is greedy.")
  flags.DEFINE_float("top_p", 1.0, "sample: top-p mass in (0, 1]; 1 filters nothing.")
  flags.DEFINE_enum("top_p_rule", "authors", ["authors", "nucleus"],
                    "sample: authors = drop every token whose inclusive cumulative probability "
                    "exceeds top_p, keeping the most likely (the authors' catsample.py); nucleus = "
                    "keep the smallest set whose probability reaches top_p.")
  flags.DEFINE_integer("top_k", 0, "sample: keep the k most likely tokens; 0 is off.")
  flags.DEFINE_enum("order", "random", ["random", "l2r"], "sample: order of the unknown tokens.")
  flags.DEFINE_integer("num_samples", 4, "sample: how many samples.")
  flags.DEFINE_integer("batch_size", 4, "sample: samples per batch.")
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
  flags.DEFINE_string("init_from", None, "train: start from the params of an export or import.")
  flags.DEFINE_string("coordinator", None, "Multi-process: coordinator HOST:PORT (process 0).")
  flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
  flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")


def _require(**named) -> None:
  missing = [f"--{k}" for k, v in named.items() if v in (None, "")]
  if missing:
    raise app.UsageError(f"missing {', '.join(missing)}")


def _train() -> None:
  from ao_mdm import sharding, train
  _require(config=FLAGS.config, workdir=FLAGS.workdir)
  sharding.initialize_distributed(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
  train.train_and_evaluate(FLAGS.config, FLAGS.workdir, FLAGS.init_from)


def _info() -> None:
  import flax.linen as nn
  import jax
  from ao_mdm import model
  _require(config=FLAGS.config)
  cfg = FLAGS.config.model
  shapes = nn.unbox(jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.key(0)))
  n = model.count_params(shapes)
  fpt = model.flops_per_token(cfg, n)
  print(f"variant={cfg.variant} L={cfg.n_layer} D={cfg.n_embd} H={cfg.n_head} "
        f"T={cfg.block_size} V={cfg.vocab_size}")
  print(f"parameters: {n:,}")
  print(f"training FLOPs per token: {fpt:,.0f} ({fpt / 1e9:.3f} GFLOP)")


def _tokenizer() -> None:
  from ao_mdm.data import tokenizer
  _require(out=FLAGS.out)
  print(tokenizer.train_tokenizer_cli(FLAGS.corpus, FLAGS.vocab_size, FLAGS.out))


def _export() -> None:
  from ao_mdm import checkpoints
  _require(workdir=FLAGS.workdir, out=FLAGS.out)
  print(checkpoints.export(FLAGS.workdir, FLAGS.out, FLAGS.weights))


def _bench(what: str) -> None:
  from ao_mdm import bench
  _require(config=FLAGS.config)
  {"sample": bench.bench_sample, "train": bench.bench_train}[what](FLAGS.config)


def _sample() -> None:
  import json
  import os
  import tqdm
  from ao_mdm import checkpoints, sampling
  from ao_mdm.data import tokenizer as tok_lib
  _require(checkpoint=FLAGS.checkpoint)
  if FLAGS.num_samples < 1 or FLAGS.batch_size < 1:
    raise app.UsageError(f"--num_samples={FLAGS.num_samples} and --batch_size={FLAGS.batch_size} "
                         "must be >= 1")
  config, params = checkpoints.load_params(FLAGS.checkpoint, FLAGS.weights)
  tokenizer = tok_lib.get_tokenizer(config.data, config.model.vocab_size, FLAGS.checkpoint)
  tok_lib.check_vocab(tokenizer, config.model.vocab_size)
  positions, ids = sampling.layout_known(tokenizer.encode, config.model.block_size, FLAGS.prompt,
                                         FLAGS.infill, FLAGS.infill_span)
  records = []
  batch_size = min(FLAGS.batch_size, FLAGS.num_samples)
  batches = range(0, FLAGS.num_samples, batch_size)
  for start in tqdm.tqdm(batches, desc="sampling", unit="batch", disable=len(batches) < 2):
    out = sampling.sample(
        params, config.model, batch_size=batch_size, steps=FLAGS.steps,
        schedule=FLAGS.schedule, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
        top_k=FLAGS.top_k, seed=FLAGS.seed + start, known_positions=positions, known_tokens=ids,
        order=FLAGS.order, top_p_rule=FLAGS.top_p_rule,
        vocab_limit=min(tokenizer.vocab_size, config.model.vocab_size))
    for row in out.tokens[:FLAGS.num_samples - start]:
      records.append({"text": sampling.decode_text(tokenizer.decode, row, tokenizer.eos_id,
                                                   tokenizer.vocab_size),
                      "tokens": row.tolist(), "tokenizer": config.data.tokenizer})
  for i, r in enumerate(records):
    print(f"--- sample {i} (steps={FLAGS.steps}, {FLAGS.order} order) ---\n{r['text']}\n")
  if FLAGS.out:
    settings = {k: FLAGS[k].value for k in ("checkpoint", "prompt", "infill", "steps", "schedule",
                                            "temperature", "top_p", "top_p_rule", "top_k", "order",
                                            "seed")}
    tmp = FLAGS.out + ".tmp"
    with open(tmp, "w") as f:
      for r in records:
        f.write(json.dumps({**r, **settings}) + "\n")
    os.replace(tmp, FLAGS.out)
    print(f"wrote {len(records)} samples to {FLAGS.out}")


def _import_torch() -> None:
  from ao_mdm import torch_import
  _require(checkpoint=FLAGS.checkpoint, out=FLAGS.out)
  if FLAGS.weights not in ("ema", "model"):
    raise app.UsageError(f"--weights={FLAGS.weights}; import-torch accepts ema or model")
  torch_import.import_torch(FLAGS.checkpoint, FLAGS.out, FLAGS.weights, FLAGS.variant)
  print(f"wrote {FLAGS.out}")


def _import_gpt2() -> None:
  from ao_mdm import gpt2_scorer
  _require(hf_dir=FLAGS.hf_dir, out=FLAGS.out)
  print(f"wrote {gpt2_scorer.import_hf_gpt2(FLAGS.hf_dir, FLAGS.out)}")


def _generated_samples(path: str, scorer) -> list:
  """Token ids to score: the samples' own ids, or their text re-tokenized for a GPT-2 scorer."""
  import json
  from ao_mdm import gpt2_scorer
  from ao_mdm.data import gpt2
  with open(path, encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  if (not isinstance(scorer, gpt2_scorer.GPT2Scorer)
      or all(r.get("tokenizer") == "gpt2" for r in records)):
    return [r["tokens"] for r in records]
  encode = gpt2.GPT2Tokenizer().encode  # other tokenizers: score the text as GPT-2 reads it
  return [encode(r["text"])[:scorer.block_size] for r in records]


def _eval() -> None:
  import json
  import time
  import tqdm
  from ao_mdm import checkpoints, evaluation
  from ao_mdm.data import datasets, pipeline, tokenizer as tok_lib
  if FLAGS.generated:
    from ao_mdm import gpt2_scorer
    _require(scorer=FLAGS.scorer)
    if gpt2_scorer.is_gpt2_export(FLAGS.scorer):
      scorer = gpt2_scorer.load_gpt2_scorer(FLAGS.scorer)
    else:
      config, params = checkpoints.load_params(FLAGS.scorer, FLAGS.weights)
      scorer = evaluation.Scorer(params, config.model, config.mesh)
    samples = _generated_samples(FLAGS.generated, scorer)
    start = time.perf_counter()
    result = evaluation.generative_perplexity(scorer, samples, FLAGS.batch_size)
    result["seconds"] = time.perf_counter() - start
    print(f"generative perplexity {result['gen_ppl']:.2f} (median {result['gen_ppl_median']:.2f}), "
          f"unigram entropy {result['unigram_entropy']:.3f} nats, {result['samples']} samples")
    print(json.dumps(result))
    return
  _require(checkpoint=FLAGS.checkpoint)
  from ao_mdm import paper
  custom = [f"--{k}" for k in ("split", "max_blocks", "orders") if FLAGS[k].present]
  if FLAGS.protocol == "paper" and custom:
    raise app.UsageError(f"{', '.join(custom)} apply with --protocol=custom; --protocol=paper "
                         "fixes the split, block count and orders per dataset")
  config, params = checkpoints.load_params(FLAGS.checkpoint, FLAGS.weights)
  tokenizer = tok_lib.get_tokenizer(config.data, config.model.vocab_size, FLAGS.checkpoint)
  tok_lib.check_vocab(tokenizer, config.model.vocab_size)
  config.model.dtype = "float32"  # the authors evaluate any-order and ensemble in fp32
  scorer = evaluation.Scorer(params, config.model, config.mesh)
  ensemble = [int(m) for m in FLAGS.ensemble.split(",") if m.strip()]
  t = config.model.block_size
  named = {}
  if FLAGS.text_file:
    docs = datasets.read_text_documents(FLAGS.text_file)
    token_lists = [tokenizer.encode(d) for d in docs]
    blocks = pipeline.pack_documents(token_lists, tokenizer.eos_id, t)
    if len(blocks) == 0:
      raise app.UsageError(f"{FLAGS.text_file} has {sum(len(x) + 1 for x in token_lists)} tokens "
                           f"(EOS included); at least block_size={t} are needed for one block")
    named[FLAGS.text_file] = blocks
  else:
    tfds_dir = datasets.resolve_tfds_dir(config.data.tfds_dir)
    for name in [d.strip() for d in FLAGS.datasets.split(",") if d.strip()]:
      data_cfg = config.data.copy_and_resolve_references()
      data_cfg.dataset = name
      if name == "lambada":
        _require(lambada_file=FLAGS.lambada_file)
        data_cfg.text_file = FLAGS.lambada_file
      split = paper.eval_split(name) if FLAGS.protocol == "paper" else FLAGS.split
      max_blocks = None if FLAGS.protocol == "paper" else FLAGS.max_blocks or None
      named[name] = pipeline.eval_blocks(data_cfg, tokenizer, block_size=t, split=split,
                                         tfds_dir=tfds_dir, max_blocks=max_blocks)
  results = {}
  for name, blocks in named.items():
    start = time.perf_counter()
    if FLAGS.protocol == "paper":
      n_orders, ao_blocks = 1, paper.eval_any_order_blocks(name)
    else:
      n_orders, ao_blocks = FLAGS.orders, None
    units = evaluation.evaluation_units(len(blocks), ao_blocks)
    with tqdm.tqdm(total=units, desc=f"eval {name}", unit="block") as bar:
      r = evaluation.evaluate_blocks(scorer, blocks, orders=n_orders, any_order_blocks=ao_blocks,
                                     ensemble=ensemble, batch_size=FLAGS.batch_size,
                                     seed=FLAGS.seed, progress=bar.update)
    r["seconds"] = time.perf_counter() - start
    results[name] = r
  print(f"{'dataset':<24} {'tokens':>8} {'L2R ppl':>9} {'any-order ppl':>16} "
        + " ".join(f"{'ens M=' + str(m):>10}" for m in ensemble))
  for name, r in results.items():
    print(f"{name[-24:]:<24} {r['tokens']:>8} {r['l2r_ppl']:>9.2f} "
          f"{r['any_order_ppl']:>9.2f} +-{r['any_order_se']:<5.2f}"
          + " ".join(f"{r['ensemble_ppl'][str(m)]:>10.2f}" for m in ensemble))
  print(json.dumps(results))


def _compile() -> None:
  from ao_mdm import aot
  _require(config=FLAGS.config, topology=FLAGS.topology)
  try:
    aot.compile_for_topology(FLAGS.config, FLAGS.topology, name=FLAGS["config"].config_filename)
  except (ValueError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


def _quiet_environment() -> None:
  """Before JAX loads: no TensorFlow start-up lines, and no TPU start-up on a host without one.

  With libtpu installed (the [tpu] extra) JAX probes for a TPU and prints errors where there is
  none. A host with a TPU (/dev/accel*, /dev/vfio/N) or an NVIDIA GPU keeps JAX's own choice;
  `compile` targets TPU topologies through the CPU platform either way.
  """
  import glob
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
  if len(sys.argv) < 2 or sys.argv[1] in ("help", "-h", "--help"):
    print(_usage())
    sys.exit(0 if len(sys.argv) >= 2 else 2)
  if sys.argv[1] not in COMMANDS:
    print(f"error: unknown command {sys.argv[1]!r}; accepted: {', '.join(COMMANDS)} "
          "(`ao-mdm help` describes them)", file=sys.stderr)
    sys.exit(2)
  command, rest = sys.argv[1], sys.argv[2:]
  _quiet_environment()
  handler = {"train": _train, "info": _info, "tokenizer": _tokenizer, "export": _export,
             "sample": _sample, "import-torch": _import_torch, "eval": _eval,
             "import-gpt2": _import_gpt2,
             "compile": _compile}.get(command)
  if command == "bench":
    if not rest or rest[0] not in BENCHES:
      print(f"usage: ao-mdm bench {{{'|'.join(BENCHES)}}} --config=...", file=sys.stderr)
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
      handler()
    except (app.UsageError, ValueError, FileNotFoundError, FileExistsError) as e:
      if os.environ.get("AO_MDM_TRACEBACK"):
        raise
      message = " ".join(str(e).split("\n"))  # one line
      print(f"error: {message}", file=sys.stderr)
      sys.exit(2)
  app.run(main, argv=[f"ao-mdm {command}"] + rest)


if __name__ == "__main__":
  run()
