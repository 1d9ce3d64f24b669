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
from ao_mdm.decode import batching, policies
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


def replaced_groups(
  answers: Answers, into: np.ndarray, more: Answers, useful: np.ndarray, group: int
) -> Answers:
  """`answers` with its groups `into` (of `group` rows each) replaced by the groups `useful` of
  `more`, in turn."""
  out_b = (into[:, None] * group + np.arange(group)).ravel()
  from_b = (useful[:, None] * group + np.arange(group)).ravel()

  def swapped(mine: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    mine = mine.copy()
    mine[out_b] = theirs[from_b]
    return mine

  return Answers(*(swapped(m, t) for m, t in zip(answers, more)))


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
    self.drawn_tokens = 0  # answer tokens the current step has drawn, every round
    orders: dict[str, Any] = {}  # a policy of fixed orders takes grpo's order (and blocks)
    if policies.get(g.policy).orders:
      orders = dict(order=g.order, block_len=g.block_len or None)
    self.batcher = batching.Batcher.continuing(
      None,  # each call's params
      cfg,
      batch=config.train.batch_size // jax.process_count(),
      policy=g.policy,
      tokens_per_step=g.tokens_per_step,
      eos_id=tokenizer.eos_id,
      vocab_limit=self.vocab_limit,
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
    answers, rewards_PG, reward_s = self._rewarded(local, np.asarray(rows_PX), seeds_P)
    drawn_reward = rewards_PG.mean()  # the policy's reward on the step's own prompts
    signal = np.sum(rewards_PG.std(-1) > 0)
    answers, rewards_PG, extra_s = self._resampled(local, answers, rewards_PG, step, first)
    reward_s += extra_s
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

  def _rewarded(self, params: Any, rows_PX: np.ndarray, seeds_P: np.ndarray) -> tuple:
    """(answers, rewards [P, group], seconds turning answers into rewards: their text and the
    reward function) of `group` answers drawn to each prompt row, answer j of prompt i with
    seed seeds_P[i] + j."""
    g = self.config.grpo
    tokens_PT, prompt_P, length_P = pairs.split_rows(rows_PX)
    answers = self.draw(params, tokens_PT, prompt_P, seeds_P)
    rewards, decode, start = [], self.tokenizer.decode, time.perf_counter()
    for b, tokens_T in enumerate(answers.tokens):
      i, p = b // g.group, int(prompt_P[b // g.group])
      answer = decode(responses.response_ids(tokens_T, p, self.tokenizer.eos_id))
      reference = decode(tokens_PT[i, p : int(length_P[i]) - 1].tolist())
      prompt = decode(tokens_PT[i, :p].tolist())
      rewards.append(scored(self.reward, g.reward, prompt, answer, reference))
    reward_s = time.perf_counter() - start
    return answers, np.asarray(rewards, np.float32).reshape(-1, g.group), reward_s

  def _resampled(
    self, params: Any, answers: Answers, rewards_PG: np.ndarray, step: int, first: int
  ) -> tuple:
    """(answers, rewards, reward seconds) with the groups whose rewards are all equal, which
    carry no signal (zero advantages), replaced by groups of other training prompts that have
    some. Each such group draws 2 candidate prompts and their answers by a seed of the step
    and its prompt's index in the global batch (local index + `first`), and takes the first
    candidate with signal: a resumed run, and any split among processes, draws alike."""
    g, reward_s = self.config.grpo, 0.0
    if self._train_rows is None:
      self._train_rows = pairs.rows_for(
        self.config.data.pairs,
        "train",
        self.tokenizer,
        self.config.model.block_size,
        log=lambda _: None,
      )
    for attempt in range(RESAMPLE_ROUNDS):
      flat = np.flatnonzero(rewards_PG.std(-1) == 0)
      if not len(flat):
        break
      rngs = [
        np.random.default_rng([self.config.seed, step, first + int(i), attempt]) for i in flat
      ]
      picks = np.concatenate([r.integers(0, len(self._train_rows), 2) for r in rngs])
      seeds = np.concatenate([r.integers(0, 2**31 - g.group, 2) for r in rngs])
      more, more_PG, more_s = self._rewarded(params, self._train_rows.rows(picks.tolist()), seeds)
      reward_s += more_s
      has_signal = (more_PG.std(-1) > 0).reshape(-1, 2)  # per flat group, its 2 candidates
      into = flat[has_signal.any(1)]
      useful = (2 * np.arange(len(flat)) + has_signal.argmax(1))[has_signal.any(1)]
      answers = replaced_groups(answers, into, more, useful, g.group)
      rewards_PG = rewards_PG.copy()
      rewards_PG[into] = more_PG[useful]
    return answers, rewards_PG, reward_s

  def draw(
    self, params: Any, tokens_PT: np.ndarray, prompt_P: np.ndarray, seeds_P: np.ndarray
  ) -> Answers:
    """`group` answers to each prompt (tokens_PT[i, :prompt_P[i]]), drawn by grpo.policy in the
    continuous batch, tokens_per_step per forward (speculative: drafts), answer j of prompt i
    with seed seeds_P[i] + j."""
    g, t = self.config.grpo, self.config.model.block_size
    requests = [
      batching.prompt_request(
        tokens_PT[i, :p],
        t,
        g.tokens_per_step,
        seed=int(seeds_P[i] + j) % 2**31,
        temperature=g.temperature,
        block_len=g.block_len or None,
      )
      for i, p in enumerate(prompt_P.tolist())
      for j in range(g.group)
    ]
    self.batcher.params = params
    done = batching.decode_all(self.batcher, requests)
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
