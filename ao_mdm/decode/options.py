"""The decoding options' accepted values and their checks; free of JAX, so the command line
checks them before JAX loads (docs/sampling.md; the policies that take them: policies.py)."""

SCHEDULES = ("linear", "cosine")
ORDERS = ("random", "l2r")
TOP_P_RULES = ("authors", "nucleus")
SCORES = ("max_prob", "entropy")  # confidence of a prediction (confidence policy)
DEFAULT_STEPS = 64  # decoding steps when none are given (or the unknown positions, if fewer)
DEFAULT_BLOCK_LEN = 16  # positions per block of `ao-mdm sample --until_eos` (parallel policy)
DRAFT_TRAINING = {"steps": 600, "batch_size": 32}  # `ao-mdm train-draft`'s defaults


def check_sampling(
  steps=None,
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  order: str | None = None,
  top_p_rule: str = "authors",
  schedule: str = "linear",
) -> None:
  """One clear ValueError per bad sampling option (steps=None: the default count; order=None:
  the policy's)."""
  if steps is not None and int(steps) < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  check_choice("schedule", schedule, SCHEDULES)
  if not temperature >= 0:
    raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy)")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p} must be in (0, 1]")
  if int(top_k) < 0:
    raise ValueError(f"top_k={top_k} must be >= 0 (0 is off)")
  if order is not None:
    check_choice("order", order, ORDERS)
  check_choice("top_p_rule", top_p_rule, TOP_P_RULES)


def check_counts(num_samples: int, batch_size: int) -> None:
  if num_samples < 1 or batch_size < 1:
    raise ValueError(f"--num_samples={num_samples} and --batch_size={batch_size} must be >= 1")


MAX_BEST_OF = 64


def check_best_of(best_of: int) -> None:
  """best_of: draws of which the most likely one is kept, 1 to MAX_BEST_OF."""
  if not 1 <= best_of <= MAX_BEST_OF:
    raise ValueError(f"--best_of={best_of} must be in [1, {MAX_BEST_OF}]")


def check_choice(name: str, value: str, choices: tuple) -> None:
  """Refuses an option's value outside its choices (check_choice("order", order, ORDERS))."""
  if value not in choices:
    raise ValueError(f"{name}={value!r}; accepted: {', '.join(choices)}")


def check_block_len(block_len) -> None:
  """block_len: None (one block, the whole sequence) or >= 1."""
  if block_len is not None and int(block_len) < 1:
    raise ValueError(f"block_len={block_len} must be >= 1")
