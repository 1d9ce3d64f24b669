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
