"""Our sampler against a PyTorch port of the authors' sampling (scxue/AO-GPT-MDM,
model_AOGPT_generate.py `generate`): the per-step counts from torch's own float32 ops, and
greedy unconditional decoding token for token through their KV-cache loop.
"""
import math

import numpy as np
import pytest

from ao_mdm import sampling

torch = pytest.importorskip("torch")


def torch_counts(t: int, known: int, steps: int, schedule: str) -> list:
  """Their count rule with torch float32 tensors, as in `generate` / `cond_generate`."""
  time = torch.linspace(1, 0, steps + 1)
  if schedule == "cosine":
    time = torch.cos((1 - time) * math.pi * 0.5)
  reached = (known + ((t - known) * (1 - time[1:])).to(torch.int64)).tolist()  # int() of each
  counts = [known]
  for n in reached:
    counts.append(max(n, counts[-1] + 1))
  return counts


@pytest.mark.parametrize("schedule", sampling.SCHEDULES)
@pytest.mark.parametrize("known", [0, 16])
def test_counts_equal_torch_float32_for_every_step_count(schedule, known):
  t = 1024
  for steps in range(1, t - known + 1):
    assert sampling.schedule_counts(t, known, steps, schedule).tolist() == \
        torch_counts(t, known, steps, schedule), steps
