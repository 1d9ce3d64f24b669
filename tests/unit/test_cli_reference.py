"""docs/cli.md is what `ao-mdm help --markdown` prints (regenerate it when a command's summary or
flags change), and that output lists every flag of every command as its `--help` does."""

import pathlib
import re
import sys
import types

from absl import flags
import pytest

from ao_mdm.cli import main, reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI_MD = ROOT / "docs" / "cli.md"


def _generated(monkeypatch, capsys) -> str:
  """The output of `ao-mdm help --markdown`, run in this process."""
  monkeypatch.setattr(sys, "argv", ["ao-mdm", "help", "--markdown"])
  with pytest.raises(SystemExit) as exit_:
    main.run()
  assert exit_.value.code == 0
  return capsys.readouterr().out


def test_docs_cli_md_is_the_generated_reference(monkeypatch, capsys):
  text = _generated(monkeypatch, capsys)
  assert text.startswith("# Command reference\n") and "## ao-mdm bench" in text
  assert str(ROOT) not in text and str(pathlib.Path.home()) not in text  # the same on any host
  assert CLI_MD.read_text() == text, (
    "docs/cli.md is stale: run `ao-mdm help --markdown > docs/cli.md`"
  )


def _sections(text: str) -> dict:
  """command -> the text of its `## ao-mdm COMMAND` section."""
  parts = re.split(r"^## ao-mdm ([a-z0-9-]+)$", text, flags=re.M)
  return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_flag_of_every_command_is_listed_under_it(monkeypatch, capsys):
  sections = _sections(_generated(monkeypatch, capsys))
  assert list(sections) == list(main.COMMANDS)
  for command in main.COMMANDS:
    module = main.command_module(command)
    listed = set(re.findall(r"^- `--([a-z_]+)[`=]", sections[command], re.M))
    assert listed == main.flag_names(command), command
    assert module.SUMMARY in sections[command]
    for name in getattr(module, "FLAG_HINTS", {}):
      assert f"- no `--{name}`: " in sections[command]
  bench = "`ao-mdm bench sample|train|data|restart|serve|posttrain|plan [--flags]`"
  assert bench in sections["bench"]
  assert "- no `--workdir`: it is `--checkpoint`" in sections["export"]


def _command(summary: str, helps: dict) -> types.ModuleType:
  """A command module whose flags have the given help texts."""
  module = types.ModuleType("toy")
  module.SUMMARY = summary

  def define(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("out", None, helps["out"], flag_values=fv)
    flags.DEFINE_enum("mode", "l2r", ["l2r", "random"], helps["mode"], flag_values=fv)
    flags.DEFINE_integer("steps", 64, helps["steps"], flag_values=fv)

  module.define = define
  return module


def test_a_changed_help_or_summary_changes_the_reference():
  helps = {"out": "Where it goes.", "mode": "The order.", "steps": "Decoding steps."}
  text = reference.markdown(["toy"], lambda _: _command("do it: --out=DIR", helps))
  assert "- [`toy`](#ao-mdm-toy): do it: --out=DIR" in text
  assert "- `--out`: Where it goes.\n" in text
  assert "- `--mode=l2r|random` (default: `l2r`): The order.\n" in text  # no <l2r|random>
  assert "- `--steps` (default: `64`): Decoding steps.\n" in text
  changed = reference.markdown(
    ["toy"], lambda _: _command("do it: --out=DIR", {**helps, "steps": "Steps."})
  )
  assert changed != text and "- `--steps` (default: `64`): Steps.\n" in changed
  assert reference.markdown(["toy"], lambda _: _command("done: --out=DIR", helps)) != text


def test_a_long_help_that_several_commands_share_is_described_once():
  long = " ".join(["Long."] * reference.SHARED_WORDS)  # several commands give it alike
  helps = {"out": long, "mode": "The order.", "steps": "Decoding steps."}
  text = reference.markdown(["a", "b", "c"], lambda _: _command("do it", helps))
  assert text.count(long) == 1  # under "Flags of several commands"
  assert text.count("- `--out`: as in [Flags of several commands]") == 3
  assert text.count("The order.") == 3  # short: at each command
