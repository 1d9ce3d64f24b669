"""`ao-mdm info` prints the parameter counts of the paper's models (tests/unit/test_model.py
counts them in the library)."""

import pytest

from helpers import ROOT, ao_mdm


@pytest.mark.parametrize(
  "name,expected",
  [
    ("ao_small", "170,605,952"),
    ("ao_medium", "425,804,928"),
    ("sigma_small", "125,263,872"),
    ("sigma_medium", "355,921,920"),
  ],
)
def test_info_command_on_paper_configs(name, expected):
  out = ao_mdm("info", f"--config={ROOT}/configs/paper.py:{name}")
  assert out.returncode == 0, out.stderr
  assert f"parameters: {expected}\n" in out.stdout
