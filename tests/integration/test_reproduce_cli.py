"""benchmarks/reproduce.py run whole (--smoke), then again: the second run finds every result and
runs nothing."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.mark.slow
def test_the_whole_script_runs_and_resumes(tmp_path):
  cmd = [sys.executable, "benchmarks/reproduce.py", "--smoke", f"--out={tmp_path}"]
  first = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200)
  assert first.returncode == 0, first.stderr[-3000:]
  results = tmp_path / "results"
  assert (results / "mixed_s0_quality.json").is_file()
  findings = json.loads((results / "findings.json").read_text())
  assert len(findings) == 4 and "| seed | finding |" in first.stdout
  again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert again.returncode == 0 and "$ " not in again.stdout and "wrote " not in again.stdout
