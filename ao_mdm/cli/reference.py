"""The command reference, docs/cli.md: every command's summary and flags as Markdown, made by
`ao-mdm help --markdown` from the command modules, so that it says what each `--help` says."""

from collections import Counter
from collections.abc import Callable, Sequence
from types import ModuleType

from absl import flags

# A flag of this many commands, with the same help and default and a help this long, is
# described once, under "Flags of several commands".
SHARED_BY, SHARED_WORDS = 3, 20
HEADER = """\
# Command reference

Every `ao-mdm` command with its flags and their defaults, as `ao-mdm COMMAND --help` prints
them. This page is generated from the command modules (`ao_mdm/cli/commands/*.py`: `SUMMARY`
and `define`): change a summary or a flag's help there, then run
`ao-mdm help --markdown > docs/cli.md` (`tests/unit/test_cli_reference.py` fails while this
page is stale).

## Every command

- `ao-mdm help` lists the commands, `ao-mdm COMMAND --help` (or `ao-mdm help COMMAND`) a
  command's flags; a flag of another command is an error that says so.
- A bad input (a flag, a config file or key, a value out of range, a flag the command would
  ignore, an unreadable file, a missing or corrupt checkpoint, an unwritable or existing
  output) prints one `error:` line naming the value and what is accepted, changes no file and
  exits 2; paths are checked before JAX loads. `AO_MDM_TRACEBACK=1` shows the traceback.
- The libraries' log lines are hidden unless absl's `--verbosity=0` (INFO) or
  `--verbosity=-1` (WARNING) is given.
- Ctrl-C (exit 130) and SIGTERM (exit 143) stop every command with no traceback and no
  half-written output (finished samples are kept; `train` saves first and exits 130 or 0).
- Every path may be a Cloud Storage URL, `gs://BUCKET/PATH` (docs/launching.md, "Paths in a
  bucket"); `--storage_timeout` bounds the wait on a server that stops answering, and
  `STORAGE_EMULATOR_HOST` points every client at a local server.
- Compiled programs are kept for the next run (`--compile_cache`; docs/launching.md, "The
  compilation cache").
- Configs are ml_collections files (`configs/paper.py:ao_small` names one of a file's
  configs); `--config.KEY=VALUE` overrides any field, and a key the config lacks (a misspelt
  field) is refused with the closest known one.
- `--checkpoint=DIR` takes a training work dir or an export. Of a work dir the newest readable
  step is read (a corrupt one, or a step directory that is no training checkpoint, is skipped
  with one line saying which and why) with the tokenizer saved beside it (`DIR/tokenizer/`);
  the command names the step and the params it loaded, and never trains a tokenizer nor
  writes into `DIR`.
- A command that needs an extra (README.md, "Extras") names it in its error line when it is
  missing: `pip install -c constraints.txt -e '.[EXTRA]'`."""


def markdown(commands: Sequence[str], module_of: Callable[[str], ModuleType]) -> str:
  """docs/cli.md: what every command shares, the flags several share, then each command."""
  modules = {c: module_of(c) for c in commands}
  defined = {c: _flags(m) for c, m in modules.items()}
  counts = Counter(_key(f) for fs in defined.values() for f in fs)
  shared = {k for k, n in counts.items() if n >= SHARED_BY and len(k[1].split()) >= SHARED_WORDS}
  once = {_key(f): f for fs in defined.values() for f in fs if _key(f) in shared}
  lines = [HEADER, "", "## Flags of several commands", ""]
  lines += [f"- {_flag(f)}" for f in once.values()]
  lines += ["", "## Commands", ""]
  lines += [f"- [`{c}`](#ao-mdm-{c}): {modules[c].SUMMARY}" for c in commands]
  for c in commands:
    lines += ["", *_section(c, modules[c], defined[c], shared)]
  return "\n".join(lines) + "\n"


def _flags(module: ModuleType) -> list:
  """The flags `module.define` defines, in its order."""
  fv = flags.FlagValues()
  module.define(fv)
  return [fv[name] for name in fv]


def _key(flag: flags.Flag) -> tuple:
  return flag.name, flag.help, flag.default


def _flag(flag: flags.Flag) -> str:
  """`--name=a|b` (default: `a`): its help, the choices of an enum in the name."""
  name, text = f"--{flag.name}", flag.help
  if isinstance(flag.parser, flags.EnumParser):
    choices = "|".join(flag.parser.enum_values)
    name, text = f"{name}={choices}", text.removeprefix(f"<{choices}>: ")
  default = "" if flag.default in (None, "") else f" (default: `{flag.default}`)"
  return f"`{name}`{default}: {text}"


def _section(command: str, module: ModuleType, defined: list, shared: set) -> list:
  """One command: its summary and usage, its flags, the flags it refuses with a hint."""
  subcommands = "|".join(getattr(module, "SUBCOMMANDS", ()))
  usage = " ".join(filter(None, ("ao-mdm", command, subcommands, "[--flags]")))
  lines = [f"## ao-mdm {command}", "", module.SUMMARY, "", f"`{usage}`", ""]
  lines += [
    f"- `--{f.name}`: as in [Flags of several commands](#flags-of-several-commands)"
    if _key(f) in shared
    else f"- {_flag(f)}"
    for f in defined
  ]
  if any(f.name == "config" for f in defined):
    lines.append(
      "- `--config.KEY=VALUE`: override any config field, e.g. `--config.train.num_steps=100`"
    )
  lines += [f"- no `--{name}`: {hint}" for name, hint in getattr(module, "FLAG_HINTS", {}).items()]
  lines += [
    f"- no `--{old}`: it is `--{new}`, as in every command that reads a run"
    for old, new in getattr(module, "RENAMED_FLAGS", {}).items()
  ]
  return lines
