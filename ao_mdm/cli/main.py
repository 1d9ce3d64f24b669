"""The `ao-mdm` command: `ao-mdm COMMAND [--flags]`; `ao-mdm help` lists the commands.

Each command is one module of cli/commands/ (its summary, flags, checks and body); this module
parses the flags, runs the command's checks before JAX loads, then its body. A user error (bad
flag, value, file or checkpoint) prints one `error:` line and exits 2; AO_MDM_TRACEBACK=1 shows
the traceback instead.
"""

import importlib
import os
import sys
from types import ModuleType
from typing import NoReturn

from absl import app, flags, logging

from ao_mdm import specs
from ao_mdm.cli import checks, reference

# Every command, in the order `ao-mdm help` lists them; the module is cli/commands/<name>.py
# with '-' as '_'.
COMMANDS = (
  "train",
  "prepare",
  "train-draft",
  "info",
  "tokenizer",
  "export",
  "sample",
  "serve",
  "eval",
  "harness",
  "import-torch",
  "export-torch",
  "import-gpt2",
  "compile",
  "bench",
)


def command_module(name: str) -> ModuleType:
  return importlib.import_module(f"ao_mdm.cli.commands.{name.replace('-', '_')}")


def flag_names(name: str) -> set:
  """The flags command `name` defines."""
  fv = flags.FlagValues()
  command_module(name).define(fv)
  return set(fv)


def _usage() -> str:
  width = max(map(len, COMMANDS))
  return "\n".join(
    ["usage: ao-mdm COMMAND [--flags]", "", "commands:"]
    + [f"  {name:<{width}} {command_module(name).SUMMARY}" for name in COMMANDS]
  )


def _command_help(command: str, fv: flags.FlagValues, ours: list) -> str:
  """`ao-mdm COMMAND --help`: what the command does and its flags with their defaults."""
  lines = [
    f"usage: ao-mdm {command} [--flags]",
    f"  {command_module(command).SUMMARY}",
    "",
    "flags:",
  ]
  for name in ours:
    flag = fv[name]
    default = "" if flag.default in (None, "") else f" (default: {flag.default})"
    lines.append(f"  --{name}: {flag.help}{default}")
  if "config" in ours:
    lines.append(
      "  --config.KEY=VALUE: override any config field, e.g. --config.train.num_steps=100"
    )
  lines += [
    f"  no --{name}: {hint}"
    for name, hint in getattr(command_module(command), "FLAG_HINTS", {}).items()
  ]
  return "\n".join(lines)


def run() -> None:
  """Console-script entry point: `ao-mdm COMMAND [SUBCOMMAND] --flags`."""
  try:
    _run(sys.argv[1:])
  except BrokenPipeError:  # e.g. `ao-mdm --help | head`: the reader left, nothing to report
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)


def _run(args: list) -> None:
  if args == ["help", "--markdown"]:  # the command reference: docs/cli.md
    print(reference.markdown(COMMANDS, command_module), end="")
    sys.exit(0)
  if len(args) == 2 and args[0] == "help" and args[1] in COMMANDS:
    args = [args[1], "--help"]  # `ao-mdm help sample` is `ao-mdm sample --help`
  if not args or args[0] in ("help", "-h", "--help"):
    print(_usage())
    sys.exit(0 if args else 2)
  if args[0] not in COMMANDS:
    _fail(
      f"unknown command {args[0]!r}; accepted: {', '.join(COMMANDS)} (`ao-mdm help` describes them)"
    )
  command, rest = args[0], args[1:]
  what: tuple[str, ...] = ()  # a subcommand: `bench train`
  module = command_module(command)
  from ao_mdm.runtime import interrupts

  interrupts.install(hold=getattr(module, "HOLDS_SIGNALS", False))
  if not os.environ.get("AO_MDM_TRACEBACK"):  # errors that Python ignores anyway (a library's
    sys.unraisablehook = lambda unraisable: None  # coroutines left by a failed read, collected)
  try:
    checks.quiet_environment()
  except ValueError as e:
    _fail(str(e))
  helping = any(a in ("--help", "-h", "--helpshort") for a in rest)
  subcommands = getattr(module, "SUBCOMMANDS", None)
  if subcommands and not (rest and rest[0] in ("--help", "-h", "--helpshort")):
    if not rest or rest[0] not in subcommands:
      _fail(
        f"ao-mdm {command} takes one of {', '.join(subcommands)} first, got "
        f"{repr(rest[0]) if rest else 'nothing'}; e.g. `ao-mdm bench train "
        "--config=configs/bench_train.py`"
      )
    what, rest = (rest[0],), rest[1:]
  fv = flags.FLAGS
  before = set(fv)
  module.define(fv)
  ours = [n for n in fv if n not in before]
  if helping:
    print(_command_help(command, fv, ours))
    sys.exit(0)
  name = " ".join((command,) + what)

  def main(argv):
    if not fv["verbosity"].present:  # absl's --verbosity=0 (INFO) brings them back to debug
      logging.set_verbosity(logging.FATAL)  # Orbax's and TFDS's lines: ours say what failed
    try:
      if len(argv) > 1:
        raise ValueError(f"unexpected argument(s) {' '.join(argv[1:])!r}; flags are --name=value")
      values = {n: fv[n].value for n in ours}
      given = {n for n in ours if fv[n].present}
      if "config" in ours and values["config"] is not None:  # the config as the library takes it
        values["config_file"] = fv["config"].config_filename
        values["bench"] = values["config"].get("bench")
        values["config"] = specs.parse(values["config"])
      checks.storage(values, given)
      module.check(values, given, *what)
      if os.environ.get("AO_MDM_CHECK_ONLY"):  # scripts/gpu_check.sh --dry_run: flags only
        print(f"checked: ao-mdm {name}")
        return
      module.run(values, given, *what)
    except (app.UsageError, ValueError, OSError, ImportError, TimeoutError) as e:
      _fail(checks.error_text(e), exit_now=getattr(e, "exit_now", False))

  app.run(
    main, argv=[f"ao-mdm {name}"] + rest, flags_parser=lambda argv: _parse_flags(argv, command)
  )


def _fail(message: str, exit_now: bool = False) -> NoReturn:
  """One `error:` line and exit 2 (at once with `exit_now`: a thread that cannot be stopped
  would hold the exit); AO_MDM_TRACEBACK=1 re-raises for the traceback."""
  if os.environ.get("AO_MDM_TRACEBACK") and sys.exc_info()[0]:
    raise
  print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
  if exit_now:
    sys.stdout.flush()
    os._exit(2)
  sys.exit(2)


def _parse_flags(argv: list, command: str) -> list:
  """absl's parsing, with a bad config file, key or value reported as one error line, and a
  flag of another command named as such."""
  try:
    rest = flags.FLAGS(argv)
    if flags.FLAGS["config"].present if "config" in flags.FLAGS else False:
      checks.loaded_config(flags.FLAGS.config)
    return rest
  except flags.UnrecognizedFlagError as e:
    renamed = getattr(command_module(command), "RENAMED_FLAGS", {})
    if e.flagname in renamed:
      _fail(
        f"--{e.flagname} is now --{renamed[e.flagname]} in `ao-mdm {command}`, as in every "
        f"command that reads a run: give --{renamed[e.flagname]}=..."
      )
    hint = getattr(command_module(command), "FLAG_HINTS", {}).get(e.flagname)
    if hint:
      _fail(f"--{e.flagname} not accepted by `ao-mdm {command}`: {hint}")
    if any(e.flagname in flag_names(other) for other in COMMANDS if other != command):
      _fail(
        f"--{e.flagname} not accepted by `ao-mdm {command}`; `ao-mdm {command} --help` "
        "lists its flags"
      )
    _fail(checks.config_flag_error(argv, e))
  except Exception as e:  # flag and config-file errors
    _fail(checks.config_flag_error(argv, e))


if __name__ == "__main__":
  run()
