"""Rewards of the tests of GRPO's reward checks (`grpo.reward=reward_fns:NAME`, tests/ on the
path): each misbehaves in one way a user's reward can."""

import time


def not_a_number(prompt: str, answer: str, reference: str) -> float:
  """NaN for every answer."""
  return float("nan")


def infinite(prompt: str, answer: str, reference: str) -> float:
  """+inf for every answer."""
  return float("inf")


def explodes(prompt: str, answer: str, reference: str) -> float:
  """Raises for every answer."""
  raise RuntimeError("reward exploded on purpose")


def says_high(prompt: str, answer: str, reference: str) -> str:
  """A string, not a number."""
  return "high"


def slow(prompt: str, answer: str, reference: str) -> float:
  """exact match after 5 ms: a reward whose time must show in reward_s."""
  time.sleep(0.005)
  return float(answer.strip() == reference.strip())


def odd_prompts_flat(prompt: str, answer: str, reference: str) -> float:
  """0 when the prompt's first id is odd (a group without signal); else the parity of the
  answer's first id (the tests' tokenizer writes ids as text)."""
  if int(prompt.split()[0]) % 2 or not answer.split():
    return 0.0
  return float(int(answer.split()[0]) % 2)
