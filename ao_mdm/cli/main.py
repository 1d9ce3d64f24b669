"""The `ao-mdm` command: `ao-mdm COMMAND [--flags]`; `ao-mdm help` lists the commands.

It parses flags, checks them (checks.command_inputs, before JAX loads), calls the library and
prints. A user error (bad flag, value, file or checkpoint) prints one `error:` line and exits 2;
AO_MDM_TRACEBACK=1 shows the traceback instead.
"""
import os
import sys

from absl import app, flags, logging

from ao_mdm.cli import checks
from ao_mdm.cli import options

FLAGS = flags.FLAGS


def _train(f: dict) -> None:
  from ao_mdm import sharding
  from ao_mdm.train import loop
  sharding.initialize_distributed(f["coordinator"], f["num_processes"], f["process_id"],
                                  f["init_timeout"])
  result = loop.train_and_evaluate(f["config"], f["workdir"], f["init_from"], f["start_over"])
  sys.exit(result.get("exit_code", 0))


def _prepare(f: dict) -> None:
  from ao_mdm.data import prepare
  for line in prepare.prepare_command(f["config"], checks.names(f["splits"]), f["workers"],
                                      f["workdir"], f["process_id"], f["num_processes"],
                                      f["verify"]):
    print(line)


def _train_draft(f: dict) -> None:
  from ao_mdm.decode import draft
  given = {"num_steps": "steps", "batch_size": "batch_size", "seed": "seed"}
  settings = {k: f[v] for k, v in given.items() if FLAGS[v].present}
  if f["order"]:
    settings["l2r_fraction"] = 1.0 if f["order"] == "l2r" else 0.0
  settings = draft.Settings(**settings)
  print(f"wrote {draft.train_command(f['checkpoint'], f['workdir'], f['weights'], settings)}")


def _info(f: dict) -> None:
  from ao_mdm import model
  print(model.describe(f["config"].model))


def _tokenizer(f: dict) -> None:
  from ao_mdm.data import tokenizer
  print(tokenizer.train_tokenizer_cli(f["corpus"], f["vocab_size"], f["out"]))


def _export(f: dict) -> None:
  from ao_mdm.train import checkpoints
  print(checkpoints.export(f["workdir"], f["out"], f["weights"]))


def _sample(f: dict) -> None:
  import tqdm
  from ao_mdm.decode import generate
  settings = {k: f[k] for k in options.SAMPLE_OPTIONS}
  if not FLAGS["steps"].present:
    settings["steps"] = None  # DEFAULT_STEPS, or fewer if fewer positions are unknown
  settings["dtype"] = f["dtype"] or "float32"
  bars = []

  def progress(total):
    bars.append(tqdm.tqdm(total=total, desc="sampling", unit="batch", disable=total < 2))
    return bars[-1].update
  written = generate.sample_command(f["checkpoint"], f["weights"], f["out"], tqdm.tqdm.write,
                                    progress, batch_size=f["batch_size"], seed=f["seed"],
                                    **settings)
  for bar in bars:
    bar.close()
  if f["out"]:
    print(f"wrote {written} samples to {f['out']}")


def _import_torch(f: dict) -> None:
  from ao_mdm.interop import torch_import
  torch_import.import_torch(f["checkpoint"], f["out"], f["weights"], f["variant"])
  print(f"wrote {f['out']}")


def _import_gpt2(f: dict) -> None:
  from ao_mdm.eval import gpt2_scorer
  print(f"wrote {gpt2_scorer.import_hf_gpt2(f['hf_dir'], f['out'])}")


def _eval(f: dict) -> None:
  import json
  import tqdm
  from ao_mdm.eval import perplexity
  if f["generated"]:
    r = perplexity.generated_command(f["generated"], f["scorer"], f["weights"], f["batch_size"])
    print(f"generative perplexity {r['gen_ppl']:.2f} +- {r['gen_ppl_sem']:.2f} (median "
          f"{r['gen_ppl_median']:.2f}), "
          f"unigram entropy {r['unigram_entropy']:.3f} nats, {r['samples']} samples")
    print(json.dumps(r))
    return
  bars = []

  def progress(name, total):
    bars.append(tqdm.tqdm(total=total, desc=f"eval {name}", unit="block"))
    return bars[-1].update
  ensemble = checks.int_list(f["ensemble"], "--ensemble")
  results, counts = perplexity.eval_command(
      f["checkpoint"], f["weights"], datasets=checks.names(f["datasets"]), ensemble=ensemble,
      progress=progress, **{k: f[k] for k in ("text_file", "lambada_file", "protocol", "split",
                                               "orders", "max_blocks", "batch_size", "seed")})
  for bar in bars:
    bar.close()
  print(perplexity.format_table(results, ensemble, unigram=counts is not None))
  print(json.dumps(results))


def _compile(f: dict) -> None:
  from ao_mdm.train import aot
  name = FLAGS["config"].config_filename
  if f["program"] == "train":
    aot.compile_for_topology(f["config"], f["topology"], name=name)
  else:
    aot.compile_sampler(f["config"], f["topology"], name, batch_size=f["batch_size"],
                        steps=f["steps"], schedule=f["schedule"], dtype=f["dtype"] or "float32")


def _bench(f: dict, what: str) -> None:
  from ao_mdm.cli import bench
  bench.run(what, f["config"], FLAGS["config"].config_filename, baseline=f["baseline"],
            mode=f["mode"], checkpoint=f["checkpoint"], weights=f["weights"], dtype=f["dtype"],
            draft_head=f["draft_head"])


HANDLERS = {"train": _train, "train-draft": _train_draft, "prepare": _prepare, "info": _info, "tokenizer": _tokenizer,
            "export": _export, "sample": _sample, "eval": _eval, "import-torch": _import_torch,
            "import-gpt2": _import_gpt2, "compile": _compile, "bench": _bench}


def _usage() -> str:
  lines = ["usage: ao-mdm COMMAND [--flags]", "", "commands:"]
  width = max(map(len, options.COMMANDS))
  return "\n".join(lines + [f"  {name:<{width}} {text}" for name, text in options.COMMANDS.items()])


def _command_help(command: str) -> str:
  """`ao-mdm COMMAND --help`: what the command does and its flags with their defaults."""
  lines = [f"usage: ao-mdm {command} [--flags]", f"  {options.COMMANDS[command]}", "", "flags:"]
  for name in options.COMMAND_FLAGS[command]:
    flag = FLAGS[name]
    value = options.COMMAND_DEFAULTS.get(command, {}).get(name, flag.default)
    default = "" if value in (None, "") else f" (default: {value})"
    lines.append(f"  --{name}: {flag.help}{default}")
  if "config" in options.COMMAND_FLAGS[command]:
    lines.append("  --config.KEY=VALUE: override any config field, e.g. --config.train.num_steps=100")
  return "\n".join(lines)


def run() -> None:
  """Console-script entry point: `ao-mdm COMMAND [SUBCOMMAND] --flags`."""
  try:
    _run(sys.argv[1:])
  except BrokenPipeError:  # e.g. `ao-mdm --help | head`: the reader left, nothing to report
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)


def _run(args: list) -> None:
  if len(args) == 2 and args[0] == "help" and args[1] in options.COMMANDS:
    args = [args[1], "--help"]  # `ao-mdm help sample` is `ao-mdm sample --help`
  if not args or args[0] in ("help", "-h", "--help"):
    print(_usage())
    sys.exit(0 if args else 2)
  if args[0] not in options.COMMANDS:
    _fail(f"unknown command {args[0]!r}; accepted: {', '.join(options.COMMANDS)} (`ao-mdm help` "
          "describes them)")
  command, rest, what = args[0], args[1:], ""
  from ao_mdm import interrupts
  interrupts.install()
  if not os.environ.get("AO_MDM_TRACEBACK"):  # errors that Python ignores anyway (a library's
    sys.unraisablehook = lambda unraisable: None  # coroutines left by a failed read, collected)
  try:
    checks.quiet_environment()
  except ValueError as e:
    _fail(str(e))
  helping = any(a in ("--help", "-h", "--helpshort") for a in rest)
  if command == "bench" and not (rest and rest[0] in ("--help", "-h", "--helpshort")):
    if not rest or rest[0] not in options.BENCHES:
      _fail(f"ao-mdm bench takes one of {', '.join(options.BENCHES)} first, got "
            f"{repr(rest[0]) if rest else 'nothing'}; e.g. `ao-mdm bench train "
            "--config=configs/bench_train.py`")
    what, rest = rest[0], rest[1:]
  before = set(FLAGS)
  options.define_flags()
  ours = sorted(set(FLAGS) - before)
  if helping:
    print(_command_help(command))
    sys.exit(0)

  def main(argv):
    logging.set_verbosity(logging.ERROR)  # Orbax/TFDS warnings are not the user's business
    try:
      if len(argv) > 1:
        raise ValueError(f"unexpected argument(s) {' '.join(argv[1:])!r}; flags are --name=value")
      values = {name: FLAGS[name].value for name in ours}
      given = {n for n in ours if FLAGS[n].present}
      checks.storage(values, given)
      checks.command_inputs(command, values, given, what)
      if os.environ.get("AO_MDM_CHECK_ONLY"):  # scripts/gpu_check.sh --dry_run: flags only
        print(f"checked: ao-mdm {command} {what}".strip())
        return
      if "compile_cache" in options.COMMAND_FLAGS[command]:
        from ao_mdm.storage import compile_cache  # pylint: disable=g-import-not-at-top
        compile_cache.enable(compile_cache.where(
            values["compile_cache"], values["workdir"] if command == "train" else None))
      HANDLERS[command](values, *([what] if what else []))
    except (app.UsageError, ValueError, OSError, ImportError, TimeoutError) as e:
      _fail(checks.error_text(e))

  app.run(main, argv=[f"ao-mdm {command} {what}".strip()] + rest, flags_parser=_parse_flags)


def _fail(message: str) -> None:
  """One `error:` line and exit 2; AO_MDM_TRACEBACK=1 re-raises for the traceback."""
  if os.environ.get("AO_MDM_TRACEBACK") and sys.exc_info()[0]:
    raise  # pylint: disable=misplaced-bare-raise
  print(f"error: {' '.join(message.split())}", file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv: list) -> list:
  """absl's parsing, with a bad config file, key or value reported as one error line."""
  try:
    rest = FLAGS(argv)
    if FLAGS["config"].present:
      checks.loaded_config(FLAGS.config)
    return rest
  except Exception as e:  # pylint: disable=broad-except  (flag and config-file errors)
    _fail(checks.config_flag_error(argv, e))


if __name__ == "__main__":
  run()
