"""Step schedules (docs/sampling.md): how many positions are known after each decoding step, as
the authors count them, spread over blocks, and the fewest steps that commit at most k a step."""

import numpy as np

from ao_mdm.decode import options


def schedule_counts(t: int, known: int, steps: int, schedule: str) -> np.ndarray:
  """Cumulative known counts n_0 = P, ..., n_S = T after each of S steps, as the authors count.

  Their model_AOGPT_generate.py (`generate`, `cond_generate`): time = torch.linspace(1, 0, S + 1)
  in float32, cosine maps it to cos((1 - time) * pi * 0.5), and step i reveals up to
  n_i = max(P + int((T - P) * (1 - time_i)), n_{i-1} + 1), every operation in float32 and int()
  truncating; T is our block_size where they write 1024. With P = 0 this is their `generate`.
  """
  options.check_choice("schedule", schedule, options.SCHEDULES)
  if not 0 <= known < t:
    raise ValueError(f"{known} known tokens leave nothing to generate in T={t} positions")
  if not 1 <= steps <= t - known:
    raise ValueError(f"steps={steps} must be in [1, {t - known}] (the number of unknown tokens)")
  f32 = np.float32
  # torch.linspace(1, 0, S + 1) in float32: step = -1 / S; the first half of the points is
  # 1 + step * j as one fused multiply-add (exact in float64, then one rounding), the second half
  # 0 - step * (S - j) (equal to torch's values for every S up to 4096, checked on its CPU kernel).
  j = np.arange(steps + 1)
  step = np.float64(f32(-1.0) / f32(steps))
  time = np.where(
    j < (steps + 1) // 2, (step * j + 1.0).astype(f32), (-(step * (steps - j))).astype(f32)
  )
  if schedule == "cosine":  # the argument in float32, its cosine rounded from float64
    time = np.cos((((f32(1) - time) * f32(np.pi)) * f32(0.5)).astype(np.float64)).astype(f32)
  # (T - P) * (1 - time_i) in float32, truncated as int() does (the values are >= 0).
  reached = known + (f32(t - known) * (f32(1) - time[1:])).astype(np.int64)
  counts = [known]
  for n in reached.tolist():  # at least one new token per step
    counts.append(max(n, counts[-1] + 1))
  # time_S is 0 (or cos(pi/2) ~ -4e-8, 1.0 after the float32 subtraction): n_S = T; and for
  # S <= T - P no earlier step reaches T (checked for every P and S with T up to 1024).
  assert counts[-1] == t, (t, known, steps, schedule, counts)
  return np.asarray(counts, np.int32)


def block_counts(
  t: int, known: int, steps: int, schedule: str, block_len: int | None = None
) -> np.ndarray:
  """schedule_counts for the unknown positions in blocks of `block_len` (None: one block), left to
  right: block j of l_j positions gets floor(S e_j / U) - floor(S e_{j-1} / U) of the S steps
  (e_j: the unknown positions up to its end, U: all of them), at least one each, S in all, and
  counts by the schedule inside it (schedule_counts with T = l_j)."""
  options.check_block_len(block_len)
  unknown = t - known
  if block_len is None or block_len >= unknown:
    return schedule_counts(t, known, steps, schedule)
  ends = list(range(block_len, unknown, block_len)) + [unknown]
  if not len(ends) <= steps <= unknown:
    raise ValueError(
      f"steps={steps} must be in [{len(ends)}, {unknown}]: the {unknown} unknown "
      f"positions make {len(ends)} blocks of block_len={block_len}, each decoded "
      "in at least one step (give more steps or a larger block_len)"
    )
  counts, start, done = [known], 0, 0
  for end in ends:
    block_steps = steps * end // unknown - done
    done += block_steps
    inner = schedule_counts(end - start, 0, block_steps, schedule)
    counts += (known + start + inner[1:]).tolist()
    start = end
  return np.asarray(counts, np.int32)


def steps_within(
  t: int, known: int, per_step: int, schedule: str = "linear", block_len: int | None = None
) -> int:
  """The fewest steps (block_counts) that commit no more than per_step tokens in any step: an
  even split of the unknown positions, or one step more where the schedule's float32 rounding
  would put per_step + 1 tokens in a step."""
  unknown = t - known
  blocks = -(-unknown // block_len) if block_len and block_len < unknown else 1
  widest = lambda steps: np.diff(block_counts(t, known, steps, schedule, block_len)).max()
  steps = max(-(-unknown // per_step), blocks)
  while steps < unknown and widest(steps) > per_step:
    steps += 1
  return steps
