"""The CLI contract: per-command --help, and one `error:` line (no traceback) per bad input."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ao_mdm(*args):
  return subprocess.run([sys.executable, "-m", "ao_mdm.main", *args], capture_output=True,
                        text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("command", ["train", "sample", "eval", "import-gpt2", "compile"])
def test_command_help_lists_its_own_flags(command):
  out = ao_mdm(command, "--help")
  assert out.returncode == 0 and out.stderr == ""
  assert out.stdout.startswith(f"usage: ao-mdm {command}")
  listed = {line.split(":")[0].strip() for line in out.stdout.splitlines() if line.startswith("  --")}
  assert ("--top_p_rule" in listed) == (command == "sample")
  assert ("--protocol" in listed) == (command == "eval")


@pytest.mark.parametrize("args, message", [
    (["no-such-command"], "unknown command 'no-such-command'; accepted: train, info"),
    (["info", "--config=configs/tiny.py", "stray"], "unexpected argument(s) 'stray'"),
    (["info", "--config=configs/tiny.py", "--steps=3"], "--steps not accepted by `ao-mdm info`"),
    (["sample", "--checkpoint=/nonexistent/run"], "no checkpoint directory at '/nonexistent/run'"),
    (["export", "--workdir=/nonexistent/run"], "missing --out"),
    (["import-gpt2", "--hf_dir=/nonexistent/hf", "--out=/tmp/x"], "/nonexistent/hf"),
    (["eval", "--checkpoint=/nonexistent/run", "--orders=2"], "--orders apply with --protocol=custom"),
])
def test_bad_input_gives_one_error_line(args, message):
  out = ao_mdm(*args)
  assert out.returncode != 0
  assert "Traceback" not in out.stderr
  errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and message in errors[0], out.stderr
