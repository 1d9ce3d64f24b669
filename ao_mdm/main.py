"""The `ao-mdm` command: `ao-mdm COMMAND [--flags]`; `ao-mdm help` lists the commands."""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

COMMANDS = {
    "train": "train a model: --config=configs/tiny.py --workdir=DIR [--config.x.y=value ...]",
    "info": "parameter count and FLOPs per token of a config: --config=...",
    "tokenizer": "train a SentencePiece tokenizer: --corpus=sotu|PATH --vocab_size=N --out=DIR",
    "export": "write the EMA params alone: --workdir=DIR --out=DIR [--weights=ema|params]",
    "bench": "benchmarks: `bench sample --config=configs/bench_sampler.py`",
}
BENCHES = ("sample",)
FLAGS = flags.FLAGS


def _define_flags() -> None:
  config_flags.DEFINE_config_file("config", None, "ml_collections config file.",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Training work dir (checkpoints, tokenizer, logs).")
  flags.DEFINE_string("out", None, "Output path.")
  flags.DEFINE_string("corpus", "sotu", "Dataset registry name or a local text file.")
  flags.DEFINE_integer("vocab_size", 2048, "Tokenizer vocab size (a multiple of 128).")
  flags.DEFINE_enum("weights", "ema", ["ema", "params"], "Which params to export or load.")


def _require(**named) -> None:
  missing = [f"--{k}" for k, v in named.items() if v in (None, "")]
  if missing:
    raise app.UsageError(f"missing {', '.join(missing)}")


def _train() -> None:
  from ao_mdm import train
  _require(config=FLAGS.config, workdir=FLAGS.workdir)
  train.train_and_evaluate(FLAGS.config, FLAGS.workdir)


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
  {"sample": bench.bench_sample}[what](FLAGS.config)


def _usage() -> str:
  lines = ["usage: ao-mdm COMMAND [--flags]", "", "commands:"]
  lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
  return "\n".join(lines)


def run() -> None:
  """Console-script entry point: `ao-mdm COMMAND [SUBCOMMAND] --flags`."""
  if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    print(_usage(), file=sys.stderr)
    sys.exit(0 if len(sys.argv) >= 2 and sys.argv[1] in ("help", "-h", "--help") else 2)
  command, rest = sys.argv[1], sys.argv[2:]
  handler = {"train": _train, "info": _info, "tokenizer": _tokenizer, "export": _export}.get(command)
  if command == "bench":
    if not rest or rest[0] not in BENCHES:
      print(f"usage: ao-mdm bench {{{'|'.join(BENCHES)}}} --config=...", file=sys.stderr)
      sys.exit(2)
    what, rest = rest[0], rest[1:]
    handler, command = (lambda: _bench(what)), f"bench {what}"
  _define_flags()

  def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    handler()
  app.run(main, argv=[f"ao-mdm {command}"] + rest)


if __name__ == "__main__":
  run()
