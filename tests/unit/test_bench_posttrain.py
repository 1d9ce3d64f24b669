"""bench posttrain's reward curve per window of GRPO steps and its SVG plot."""

import xml.etree.ElementTree as ET

import numpy as np
import pytest

from ao_mdm.perf import bench_posttrain, svg


def test_the_reward_curve_is_the_mean_of_each_window_of_steps():
  rows = [{"step": s, "reward": 0.1 * (s > 4)} for s in range(1, 11)]
  assert bench_posttrain.reward_curve(rows, 4) == pytest.approx([0.0, 0.1, 0.1])
  assert bench_posttrain.reward_curve(rows, 10) == pytest.approx([0.06])


def test_the_curves_plot_is_an_svg_with_a_line_and_a_label_per_task():
  curves = {"arithmetic:4000": [(50, 0.1), (100, 0.3)], "reversal:4000": [(50, 0.5)]}
  root = ET.fromstring(svg.line_plot(curves, "GRPO steps", "sampled reward"))
  lines = root.findall("{http://www.w3.org/2000/svg}polyline")
  assert [len(x.get("points").split()) for x in lines] == [2, 1]
  texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
  assert "arithmetic:4000" in texts and "reversal:4000" in texts and "100" in texts


def test_grpo_costs_leave_out_the_last_interval_which_holds_no_rollout():
  """Step n's interval ends after step n + 1's rollout; the run's last holds only its update."""
  row = lambda step_s: dict(step_s=step_s, rollout_s=0.5, reward_s=0.01, scoring_s=0.09,
                            rollout_tokens_per_s=100.0)  # fmt: skip
  costs = bench_posttrain.grpo_costs([row(1.0), row(1.2), row(0.3)])
  assert costs["step_s"] == pytest.approx(1.1)
  assert costs["update_s"] == pytest.approx(1.1 - 0.5 - 0.01 - 0.09)
  short = bench_posttrain.grpo_costs([row(0.3)])  # 2 GRPO steps: the first read starts the clock
  assert np.isnan(short["step_s"]) and np.isnan(short["update_s"])


def test_the_baselines_take_turns_and_their_compiling_call_is_not_timed():
  calls = []
  draw = lambda name: lambda seed: calls.append((name, seed)) or 10
  rates = bench_posttrain.timed_rates({"a": draw("a"), "b": draw("b")}, range(3))
  assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
  assert [len(v) for v in rates.values()] == [2, 2] and all(r > 0 for r in rates["a"])
  later = bench_posttrain.timed_rates({"a": draw("a")}, range(4, 7))
  assert len(later["a"]) == 3
