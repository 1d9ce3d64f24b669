"""GRPO with exact log-probabilities (config section grpo; docs/posttraining.md): each step draws
`group` answers per prompt with the decode engine, rewards them, replaces the groups whose answers
all got one reward (no signal) by groups of other training prompts, and the train step
(train/step.py) optimises the clipped ratio objective with a KL penalty to the initial params.

An answer's probability is exact: the decoder draws each token given the tokens of its earlier
steps (all earlier tokens when one token is drawn per step), and eval/responses.answer_logprobs
recomputes that same probability in one forward, for the policy, the old policy and the reference.
"""

from collections.abc import Callable
import functools
import importlib
import math
import numbers
import time
from typing import Any, NamedTuple

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from ao_mdm import sharding, specs
from ao_mdm.data import pairs
from ao_mdm.decode import batching, driver, policies
from ao_mdm.eval import responses
from ao_mdm.storage import fs
from ao_mdm.train import step as train_step


def load_reward(name: str) -> Callable[[str, str, str], float]:
  """The function named `module:function` (an installed or importable module, never a file)."""
  module, _, function = name.partition(":")
  try:
    fn = getattr(importlib.import_module(module), function) if function else None
  except (ImportError, AttributeError) as e:
    raise ValueError(f"grpo.reward={name!r}: {e}") from None
  if not callable(fn):
    raise ValueError(f"grpo.reward={name!r} must name a function as module:function")
  return fn


def scored(
  reward: Callable[[str, str, str], Any], name: str, prompt: str, answer: str, reference: str
) -> float:
  """reward(prompt, answer, reference) as a float, or a ValueError naming the reward function
  (grpo.reward), the prompt and the answer: a reward that raises, is not a number (int, float,
  bool or a numpy number) or is not finite would otherwise fail without a source, or train on."""
  where = f"grpo.reward={name!r} on prompt {prompt!r}, answer {answer!r}"
  try:
    value = reward(prompt, answer, reference)
  except Exception as e:  # the user's code: any failure is reported with its inputs
    raise ValueError(f"{where} raised {type(e).__name__}: {e}") from e
  if not isinstance(value, (numbers.Real, np.bool_)):
    raise ValueError(f"{where} returned {type(value).__name__} {value!r}, not a number")
  if not math.isfinite(value):
    raise ValueError(f"{where} returned {value}; a reward must be a finite number")
  return float(value)


def exact_match(prompt: str, answer: str, reference: str) -> float:
  """1 when the answer equals the reference answer (spaces at the ends aside), else 0: the
  reward of the shipped arithmetic task."""
  del prompt
  return float(answer.strip() == reference.strip())


def digit_match(prompt: str, answer: str, reference: str) -> float:
  """1 for the exact answer; else half the share of the reference's digits that a number answer
  has in the same place from the right (partial credit: a denser signal than exact_match)."""
  del prompt
  answer, reference = answer.strip(), reference.strip()
  if answer == reference:
    return 1.0
  if not answer.isdigit():
    return 0.0
  same = sum(a == r for a, r in zip(reversed(answer), reversed(reference)))
  return 0.5 * same / max(len(answer), len(reference))


def advantages(rewards_G: np.ndarray) -> np.ndarray:
  """Rewards normalised within each group: (r - mean) / (std + 1e-4), float32, [prompts, G]."""
  mean = rewards_G.mean(-1, keepdims=True)
  return ((rewards_G - mean) / (rewards_G.std(-1, keepdims=True) + 1e-4)).astype(np.float32)


def reference_params(
  config: specs.Spec, workdir: str, init_params: Any, resumed: bool, shardings: Any, say: Callable
) -> Any:
  """The KL's reference: the --init_from params, kept in WORKDIR/reference for the restarts
  (every process writes its shards)."""
  from ao_mdm.checkpoint import checkpoints, layout

  path = fs.join(workdir, layout.REFERENCE)
  if init_params is not None:
    placed = jax.device_put(init_params, shardings)
    if multihost_utils.broadcast_one_to_all(np.bool_(not checkpoints.has_params(path))):
      checkpoints.write_params(path, config.to_dict(), placed)
    # A copy: the train state's params, donated at every step, may share these buffers.
    return jax.tree.map(jnp.copy, placed)
  if not resumed or not checkpoints.has_params(path):
    raise ValueError(
      "GRPO starts from a trained model: give --init_from=RUN_OR_EXPORT (its params start the "
      "run and are the reference of the KL penalty)"
    )
  return checkpoints.load_params(path, log=say, shardings=lambda c: shardings)[1]


@functools.cache
def _gathered(mesh: jax.sharding.Mesh) -> Callable:
  """params -> the params whole on every device of `mesh` (an all-gather among the processes)."""
  return jax.jit(lambda params: params, out_shardings=jax.sharding.NamedSharding(mesh, P()))


def state_sizes(batch: int) -> tuple[int, ...]:
  """The continuous batch's sizes below `batch`: half of it, where answers of many lengths
  spend most steps, and each next half, down to 2 (rows computed per busy row, reversal's
  rollout: 1.13; 4x apart 1.18)."""
  return tuple(batch >> i for i in range(1, batch.bit_length() - 1))


def on_this_host(params: Any) -> Any:
  """The params whole on this process's first device, where its rollouts run: each process draws
  the answers to its own prompts, with no collective among the processes."""
  device = jax.local_devices()[0]
  whole = _gathered(jax.tree.leaves(params)[0].sharding.mesh)(params)
  return jax.tree.map(
    lambda x: next(s.data for s in x.addressable_shards if s.device == device), whole
  )


def _agreed(local: Any) -> np.ndarray:
  """[processes, ...]: every process's `local`, in process order."""
  return np.asarray(multihost_utils.process_allgather(np.asarray(local))).reshape(
    -1, *np.shape(local)
  )


def _narrowed(batch: dict) -> dict:
  """The answers cut after the last drawn slot of any process's, rounded up to a multiple of 8,
  when the slots kept hold only positions before the cut (L2R answers stopped at EOS): no compute
  on slots that no drawn token sees. Every process cuts alike (one shape for the step)."""
  counted_BT, order_BT = batch["counted"], batch["order"]
  t = order_BT.shape[1]
  last = int(_agreed(np.flatnonzero(counted_BT.any(0)).max(initial=0)).max()) + 1
  width = min(-(-last // 8) * 8, t)
  if width == t or not _agreed(np.all(order_BT[:, :width] < width)).all():
    return batch
  return {k: v if v.shape[1] != t else v[:, :width] for k, v in batch.items()}


# Draws, at most, of other training prompts for the groups whose answers all got one reward: twice
# as many prompts as such groups a draw (DAPO's dynamic sampling; docs/posttraining.md).
RESAMPLE_ROUNDS = 2


class Answers(NamedTuple):
  """A step's drawn answers, [B, T]: tokens (by position) and order; by slot, the slots drawn,
  the first slot of each slot's decoding step, and the model's log-prob of the drawn token (at
  temperature 1, as the decoder computed it)."""

  tokens: np.ndarray
  order: np.ndarray
  counted: np.ndarray
  first: np.ndarray
  logprobs: np.ndarray


class _Group(NamedTuple):
  """Answers to draw to a pairs row's prompt (tokens[:prompt]; its reference answer ends at
  length - 1): for the batch's `slot`, as its own prompt (attempt -1) or its redraw
  `attempt`."""

  tokens: np.ndarray
  prompt: int
  length: int
  slot: int
  attempt: int


class Rollouts:
  """Draws and scores a step's answers: `(params, this process's prompt rows, step) -> (global
  batch, metrics)`. Each process draws the answers to its rows on its first device; the
  reference scores the global batch on the training mesh (`batch_sharding`)."""

  def __init__(
    self, config: specs.Spec, tokenizer: Any, reference: Any, batch_sharding: jax.sharding.Sharding
  ):
    self.config, self.tokenizer, self.reference = config, tokenizer, reference
    self.batch_sharding = batch_sharding
    self.reward = load_reward(config.grpo.reward)
    cfg, g = config.model, config.grpo
    self.vocab_limit = min(tokenizer.vocab_size, cfg.vocab_size)
    self.drawn_tokens = 0  # answer tokens the current step has drawn, redraws included
    orders: dict[str, Any] = {}  # a policy of fixed orders takes grpo's order (and blocks)
    if policies.get(g.policy).orders:
      orders = dict(order=g.order, block_len=g.block_len or None)
    batch = config.train.batch_size // jax.process_count()
    self.batcher = batching.Batcher.continuing(
      None,  # each call's params
      cfg,
      batch=batch,
      policy=g.policy,
      tokens_per_step=g.tokens_per_step,
      eos_id=tokenizer.eos_id,
      vocab_limit=self.vocab_limit,
      sizes=state_sizes(batch),  # their programs compile at first use
      **orders,
    )
    self._logprobs = jax.jit(train_step.answers_logprobs(config), out_shardings=batch_sharding)
    self._train_rows: pairs.Rows | None = None  # the prompts of resampled groups, when needed

  def __call__(self, params: Any, rows_PX: np.ndarray, step: int) -> tuple[dict, dict]:
    g = self.config.grpo
    jax.block_until_ready(params)  # the last update's time is not the rollout's
    start, self.drawn_tokens = time.perf_counter(), 0
    local = on_this_host(params)
    # Seeds numbered by the row of the global batch: the answers do not depend on the processes.
    n = len(rows_PX)
    first = jax.process_index() * n  # this process's first prompt in the global batch
    row = step * n * jax.process_count() + first
    seeds_P = (self.config.seed * 1_000_003 + (row + np.arange(n)) * g.group) % 2**31
    answers, rewards_PG, own_PG, reward_s = self._drawn(
      local, np.asarray(rows_PX), seeds_P, step, first
    )
    drawn_reward = own_PG.mean()  # the policy's reward on the step's own prompts
    signal = np.sum(own_PG.std(-1) > 0)
    tokens_BT, counted_BT = answers.tokens, answers.counted
    rollout_s = time.perf_counter() - start - reward_s
    batch = {
      "tokens": tokens_BT,
      "order": answers.order,
      "first": answers.first.astype(np.int32),
      "counted": counted_BT.astype(np.float32),
      "advantage": advantages(rewards_PG).reshape(-1, 1),
    }
    batch = sharding.global_batch(_narrowed(batch), self.batch_sharding)
    start = time.perf_counter()  # the old policy's are the train step's (train/step.py)
    batch["ref"] = jax.block_until_ready(self._logprobs(self.reference, batch))
    scoring_s = time.perf_counter() - start
    every = _agreed(
      np.array(
        [
          drawn_reward * rewards_PG.size,
          rewards_PG.size,
          counted_BT.sum(),
          self.drawn_tokens,
          rollout_s,
          scoring_s,
          reward_s,
          signal,
        ]
      )
    )
    reward, answers_n, tokens, drawn = every[:, :4].sum(0)
    rollout_s = every[:, 4].max()
    metrics = {
      "reward": float(reward / answers_n),
      "answer_tokens": float(tokens / answers_n),
      "rollout_s": float(rollout_s),
      "scoring_s": float(every[:, 5].max()),
      "reward_s": float(every[:, 6].max()),
      "signal_fraction": float(every[:, 7].sum() * g.group / answers_n),
      # Every answer token drawn, the groups drawn again for want of signal included.
      "rollout_tokens_per_s": float(drawn / rollout_s),
    }
    return batch, metrics

  def _drawn(
    self, params: Any, rows_PX: np.ndarray, seeds_P: np.ndarray, step: int, first: int
  ) -> tuple[Answers, np.ndarray, np.ndarray, float]:
    """(answers, their rewards [P, group], the rewards of the answers to the rows' own prompts,
    seconds spent turning answers into rewards: their text and the reward function) of `group`
    answers to each prompt row, answer j of row i with seed seeds_P[i] + j.

    A group whose answers all got one reward carries no signal (zero advantages): as soon as
    its answers are in, 2 other training prompts are drawn for its slot (by a seed of the step
    and the slot's index in the global batch, local index + `first`: a resumed run, and any
    split among processes, draws alike) and the first with signal takes the slot; with none,
    again, RESAMPLE_ROUNDS times at most (DAPO's dynamic sampling). The redraws join the same
    continuous batch, in the rows that finished answers free."""
    g = self.config.grpo
    groups: list[_Group] = []
    redrawn: dict[tuple[int, int], list[int]] = {}  # (slot, attempt) -> its 2 groups
    done: dict[int, batching.Finished] = {}  # by request: group k's are k * group + j
    rewards: dict[int, np.ndarray] = {}  # by group, once all its answers are in
    taken = list(range(len(rows_PX)))  # slot -> the group whose answers it takes
    reward_s = 0.0

    def drawing(row: np.ndarray, seed: int, slot: int, attempt: int) -> list[batching.Request]:
      (tokens,), (prompt,), (length,) = pairs.split_rows(row[None])
      groups.append(_Group(tokens, int(prompt), int(length), slot, attempt))
      redrawn.setdefault((slot, attempt), []).append(len(groups) - 1)
      return self._requests(tokens[: int(prompt)], int(seed))

    def redraws(slot: int, attempt: int) -> list[batching.Request]:
      if attempt >= RESAMPLE_ROUNDS:
        return []
      if self._train_rows is None:
        self._train_rows = pairs.rows_for(
          self.config.data.pairs,
          "train",
          self.tokenizer,
          self.config.model.block_size,
          log=lambda _: None,
        )
      rng = np.random.default_rng([self.config.seed, step, first + slot, attempt])
      picks = rng.integers(0, len(self._train_rows), 2)
      seeds = rng.integers(0, 2**31 - g.group, 2)
      rows = self._train_rows.rows(picks.tolist())
      return [q for row, s in zip(rows, seeds) for q in drawing(row, s, slot, attempt)]

    def then(i: int, finished: batching.Finished) -> list[batching.Request]:
      nonlocal reward_s
      done[i] = finished
      k = i // g.group
      members = range(k * g.group, (k + 1) * g.group)
      if any(j not in done for j in members):
        return []
      start = time.perf_counter()
      rewards[k] = self._rewards(groups[k], [done[j] for j in members])
      reward_s += time.perf_counter() - start
      slot, attempt = groups[k].slot, groups[k].attempt
      if attempt < 0:
        return [] if rewards[k].std() > 0 else redraws(slot, 0)
      candidates = redrawn[(slot, attempt)]
      if any(c not in rewards for c in candidates):
        return []
      useful = [c for c in candidates if rewards[c].std() > 0]
      if useful:
        taken[slot] = useful[0]
        return []
      return redraws(slot, attempt + 1)

    requests = [
      q for i, (row, s) in enumerate(zip(rows_PX, seeds_P)) for q in drawing(row, s, i, -1)
    ]
    self.batcher.params = params
    answers = self._answers(driver.decode_all(self.batcher, requests, then))
    rows_B = (np.asarray(taken)[:, None] * g.group + np.arange(g.group)).ravel()
    own_PG = np.stack([rewards[k] for k in range(len(rows_PX))])
    return (
      Answers(*(x[rows_B] for x in answers)),
      np.stack([rewards[k] for k in taken]),
      own_PG,
      reward_s,
    )

  def _requests(self, prompt: np.ndarray, seed: int) -> list[batching.Request]:
    """`group` answers to `prompt` (token ids), answer j with seed seed + j."""
    g, t = self.config.grpo, self.config.model.block_size
    return [
      batching.prompt_request(
        prompt,
        t,
        g.tokens_per_step,
        seed=(seed + j) % 2**31,
        temperature=g.temperature,
        block_len=g.block_len or None,
      )
      for j in range(g.group)
    ]

  def _rewards(self, group: _Group, done: list[batching.Finished]) -> np.ndarray:
    """The rewards [group] of a group's answers, by grpo.reward."""
    decode, p, name = self.tokenizer.decode, group.prompt, self.config.grpo.reward
    prompt = decode(group.tokens[:p].tolist())
    reference = decode(group.tokens[p : group.length - 1].tolist())
    answers = [decode(responses.response_ids(f.tokens, p, self.tokenizer.eos_id)) for f in done]
    return np.asarray(
      [scored(self.reward, name, prompt, a, reference) for a in answers], np.float32
    )

  def draw(
    self, params: Any, tokens_PT: np.ndarray, prompt_P: np.ndarray, seeds_P: np.ndarray
  ) -> Answers:
    """`group` answers to each prompt (tokens_PT[i, :prompt_P[i]]), drawn by grpo.policy in the
    continuous batch, tokens_per_step per forward (speculative: drafts), answer j of prompt i
    with seed seeds_P[i] + j; no redraws."""
    self.batcher.params = params
    requests = [
      q for x, p, s in zip(tokens_PT, prompt_P, seeds_P) for q in self._requests(x[:p], int(s))
    ]
    return self._answers(driver.decode_all(self.batcher, requests))

  def _answers(self, done: list[batching.Finished]) -> Answers:
    """The finished requests' answers, their drawn tokens counted in drawn_tokens."""
    t = self.config.model.block_size
    tokens_BT = np.stack([f.tokens for f in done]).astype(np.int32)
    order_BT = np.stack([f.order for f in done]).astype(np.int32)
    step_BT = np.stack([f.steps for f in done])
    self.drawn_tokens += int((np.take_along_axis(step_BT, order_BT, 1) >= 0).sum())
    if self.batcher.spec.sequential:  # each token drawn given every slot before it
      first_BT = np.broadcast_to(np.arange(t), tokens_BT.shape)
    else:
      first_BT = responses.first_slots(step_BT, order_BT)
    return Answers(
      tokens_BT,
      order_BT,
      np.take_along_axis(step_BT, order_BT, 1) >= 0,
      first_BT,
      np.take_along_axis(np.stack([f.raw_logprobs for f in done]), order_BT, 1),
    )
