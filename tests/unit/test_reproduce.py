"""benchmarks/reproduce.py: paired statistics of the findings (the whole script runs in
tests/integration/test_reproduce_cli.py)."""

import importlib.util
import os

import numpy as np
import pytest

from helpers import ROOT

spec = importlib.util.spec_from_file_location(
  "reproduce", os.path.join(ROOT, "benchmarks", "reproduce.py")
)
reproduce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reproduce)


def test_paired_difference_and_its_standard_error():
  r = reproduce.paired([3.0, 5.0, 4.0], [1.0, 2.0, 3.0])  # differences 2, 3, 1
  assert r["diff_nll"] == pytest.approx(2.0)
  assert r["se"] == pytest.approx(1.0 / np.sqrt(3))  # std(ddof=1) = 1
  assert r["ppl_ratio"] == pytest.approx(np.e**2) and r["sigmas"] == pytest.approx(2 * np.sqrt(3))


def test_findings_hold_only_beyond_two_standard_errors():
  rng = np.random.default_rng(0)
  base = rng.normal(5.0, 0.3, 64)

  def run(l2r_shift, ao_shift, noise=0.01):
    return {
      "seed": 0,
      "eval": {
        "l2r_nll_seq": list(base + l2r_shift + rng.normal(0, noise, 64)),
        "any_order_nll_seq": list(base + ao_shift + rng.normal(0, noise, 64)),
      },
    }

  runs = {
    "ar_s0": run(0.0, 1.0),
    "random_s0": run(0.5, 0.6),
    "mixed_s0": run(0.2, 0.62),
    "sigma_s0": run(0.3, 0.8),
  }
  found = {f["finding"][:4]: f for f in reproduce.findings(runs)}
  assert found["(a) "]["holds"] and found["(c) "]["holds"]
  assert found["(b) "]["ppl_ratio"] == pytest.approx(np.exp(0.3), rel=0.02)
  assert found["(b) "]["holds"]  # exp(-0.3) = 0.74 <= 0.8, many SE
  assert found["(b')"]["holds"]  # exp(0.02) <= 1.1
  runs["sigma_s0"] = run(0.3, 0.62, noise=0.3)  # no real difference, just noise
  found = {f["finding"][:4]: f for f in reproduce.findings(runs)}
  assert not found["(c) "]["holds"]
