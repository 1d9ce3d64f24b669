"""The generated tasks of data.pairs (`NAME:N`, pairs.GENERATED): seeded, answers right, and a
validation split of unseen pairs."""

import pytest

from ao_mdm.data import pairs


def test_reversal_is_seeded_right_and_its_splits_differ():
  train = pairs.load("reversal:300", "train")
  assert train == pairs.load("reversal:300", "train") and len(train) == 300
  assert train[:50] == pairs.load("reversal:50", "train")  # a prefix of any larger N
  for prompt, response in train:
    digits = prompt.removesuffix(">")
    assert prompt.endswith(">") and digits.isdigit() and 6 <= len(digits) <= 15
    assert response == digits[::-1]
  assert {len(p) - 1 for p, _ in train} == set(range(6, 16))  # every length drawn
  validation = pairs.load("reversal:300", "validation")
  assert len(set(validation)) == len(validation) == pairs.ARITHMETIC_VALIDATION
  assert not set(validation) & set(train)
  with pytest.raises(ValueError, match=r"expected reversal:N with 1 <= N <= 5000"):
    pairs.load("reversal:0", "train")


def test_every_generated_task_loads():
  for name in pairs.GENERATED:
    train, validation = pairs.load(f"{name}:20", "train"), pairs.load(f"{name}:20", "validation")
    assert len(train) == 20 and validation and not set(train) & set(validation)
