"""The decoding modes and their options, with the checks of their values; free of JAX, so the
command line lists and checks them before JAX loads (docs/sampling.md)."""

MODES = ("parallel", "speculative", "confidence")  # of `ao-mdm sample`
SCHEDULES = ("linear", "cosine")
ORDERS = ("random", "l2r")
TOP_P_RULES = ("authors", "nucleus")
SCORES = ("max_prob", "entropy")  # confidence of a prediction (confidence mode)
MODE_OPTIONS = {  # the options each mode's sampler takes
  "parallel": (
    "steps",
    "schedule",
    "temperature",
    "top_p",
    "top_k",
    "order",
    "top_p_rule",
    "dtype",
    "block_len",
  ),
  "speculative": (
    "temperature",
    "top_p",
    "top_k",
    "top_p_rule",
    "draft",
    "order",
    "dtype",
    "draft_head",
  ),
  "confidence": (
    "steps",
    "schedule",
    "temperature",
    "top_p",
    "top_k",
    "top_p_rule",
    "score",
    "dtype",
  ),
}
MODE_OPTION_NAMES = frozenset(name for names in MODE_OPTIONS.values() for name in names)
DEFAULT_STEPS = 64  # decoding steps when none are given (or the unknown positions, if fewer)
DEFAULT_BLOCK_LEN = 16  # positions per block of `ao-mdm sample --until_eos` (parallel mode)
DRAFT_TRAINING = {"steps": 600, "batch_size": 32}  # `ao-mdm train-draft`'s defaults


def check_sampling(
  steps,
  temperature: float,
  top_p: float,
  top_k: int,
  order: str | None,
  top_p_rule: str = "authors",
  schedule: str = "linear",
) -> None:
  """One clear ValueError per bad sampling option (steps=None: the default count)."""
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


def check_choice(name: str, value: str, choices: tuple) -> None:
  """Refuses an option's value outside its choices (e.g. check_choice("mode", mode, MODES))."""
  if value not in choices:
    raise ValueError(f"{name}={value!r}; accepted: {', '.join(choices)}")


def check_until_eos(mode: str, order, infill: str = "") -> None:
  """Refuses --until_eos where no text follows a first EOS: confidence mode (its order is chosen
  online), a speculative random order, an infill text (it ends at its text's end already)."""
  if mode not in ("parallel", "speculative"):
    raise ValueError(
      f"--until_eos applies to --mode=parallel or --mode=speculative, not --mode={mode}"
    )
  if mode == "speculative" and order not in (None, "l2r"):
    raise ValueError(
      f"--until_eos with --mode=speculative needs --order=l2r, not --order={order}"
      " (use --mode=parallel for blocks in a random order)"
    )
  if infill:
    raise ValueError(
      "--until_eos applies with --prompt or no text, not --infill: an infill "
      "sample ends where its text ends (end the text with [MASK] to continue it "
      "by --infill_span tokens)"
    )


def check_block_len(block_len) -> None:
  """block_len: None (one block, the whole sequence) or >= 1."""
  if block_len is not None and int(block_len) < 1:
    raise ValueError(f"block_len={block_len} must be >= 1")
