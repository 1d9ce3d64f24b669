"""Responses to prompts (docs/posttraining.md): their exact NLL under prompt-first orders, and
completions decoded row by row (each prompt its own) with exact-match accuracy."""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ao_mdm import model as model_lib
from ao_mdm import orders, specs
from ao_mdm.data import pairs
from ao_mdm.decode import batching, driver


def response_nll(
  scorer: Any, rows_NX: np.ndarray, order: specs.OrderSpec, *, seed: int = 0, batch_size: int = 8
) -> float:
  """Mean NLL per response token (EOS included) given its prompt, the response in `order.kind`'s
  order after the prompt (orders.prompt_first), from the scorer's exact per-slot NLLs."""
  total, count = 0.0, 0
  for start in range(0, len(rows_NX), batch_size):
    tokens_BT, prompt_B, length_B = pairs.split_rows(rows_NX[start : start + batch_size])
    t = tokens_BT.shape[1]
    order_BT = orders.prompt_first(
      jax.random.key(seed + start), jnp.asarray(prompt_B), jnp.asarray(length_B), t, order
    )
    nll_BT = scorer.slot_nll(tokens_BT, np.asarray(order_BT))
    counted_BT = np.asarray(orders.response_slots(jnp.asarray(prompt_B), jnp.asarray(length_B), t))
    total += float(nll_BT[counted_BT].sum())
    count += int(counted_BT.sum())
  return total / count


def _steps_forward(module: Any, tokens_BT, order_BT, first_BT):
  """Logits of slot s's target given slots [0, first[s]) only: T teacher-forced slots, then T
  query slots, query s fed as slot first[s] is (the token before its step) and masked to see the
  teacher-forced slots before first[s] and itself (a parallel step's tokens do not see each
  other, as the decoder drew them)."""
  t = tokens_BT.shape[1]
  prev_tok_BT, prev_pos_BT = model_lib.slot_inputs(tokens_BT, order_BT)
  q_tok_BT = jnp.take_along_axis(prev_tok_BT, first_BT, axis=1)
  q_pos_BT = jnp.take_along_axis(prev_pos_BT, first_BT, axis=1)
  x_BWD, cond = module.embed(
    jnp.concatenate([prev_tok_BT, q_tok_BT], 1),
    jnp.concatenate([prev_pos_BT, q_pos_BT], 1),
    jnp.concatenate([order_BT, order_BT], 1),
  )
  _, q_cond = module.embed(q_tok_BT, q_pos_BT, order_BT)
  s_T = jnp.arange(t)
  causal_BTT = jnp.broadcast_to(s_T[None, :] <= s_T[:, None], (len(first_BT), t, t))
  q_sees_BTT = s_T[None, None, :] < first_BT[:, :, None]
  eye_BTT = jnp.broadcast_to(jnp.eye(t, dtype=bool), q_sees_BTT.shape)
  mask_BWW = jnp.concatenate(
    [
      jnp.concatenate([causal_BTT, jnp.zeros_like(causal_BTT)], 2),
      jnp.concatenate([q_sees_BTT, eye_BTT], 2),
    ],
    1,
  )
  h_BWD, _ = module.stack(x_BWD, cond, mask={"new": mask_BWW[:, None]})
  return module.logits(h_BWD[:, t:], q_cond)


def answer_logprobs(
  model: model_lib.AOGPT, params: Any, tokens_BT: jax.Array, order_BT: jax.Array, first_BT=None
) -> jax.Array:
  """[B, T] float32 log-prob of each slot's token (at order[s]) given the tokens of slots
  [0, first[s]): the exact probability a decoder drew it with when first[s] is the first slot
  of its step. first=None: every slot its own step (s), one training forward."""
  if first_BT is None:
    return -model_lib.slot_nll(model, params, tokens_BT, order_BT)
  logits_BTV = model.apply({"params": params}, tokens_BT, order_BT, first_BT, method=_steps_forward)
  labels_BT = model_lib.slot_labels(tokens_BT, order_BT)
  return -optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT)


def first_slots(step_BT: np.ndarray, order_BT: np.ndarray) -> np.ndarray:
  """[B, T] the first slot of each slot's decoding step (engine.Drawn's steps per position, -1
  for known or undrawn positions, which are their own)."""
  b, t = order_BT.shape
  step_by_slot = np.take_along_axis(step_BT, order_BT, axis=1)
  first = np.broadcast_to(np.arange(t), (b, t)).copy()
  for s in range(1, t):
    same = (step_by_slot[:, s] >= 0) & (step_by_slot[:, s] == step_by_slot[:, s - 1])
    first[same, s] = first[same, s - 1]
  return first


def complete(
  params: Any,
  cfg: specs.ModelSpec,
  prompts: Sequence[Sequence[int]],
  *,
  eos_id: int,
  vocab_limit: int | None = None,
  batch: int = 16,
  seed: int = 0,
  temperature: float = 0.0,
  tokens_per_step: int = 1,
) -> list[batching.Finished]:
  """Each prompt (token ids) continued left to right until EOS or T, `tokens_per_step` per
  forward, in a continuous batch of `batch` rows; prompt i draws with seed + i."""
  batcher = batching.Batcher.continuing(
    params,
    cfg,
    batch=batch,
    tokens_per_step=tokens_per_step,
    eos_id=eos_id,
    vocab_limit=vocab_limit,
  )
  requests = [
    batching.prompt_request(ids, cfg.block_size, tokens_per_step, seed + i, temperature)
    for i, ids in enumerate(prompts)
  ]
  return driver.decode_all(batcher, requests)


def response_ids(tokens_T: np.ndarray, prompt_len: int, eos_id: int) -> list[int]:
  """A row's drawn tokens after the prompt, up to (not with) the first EOS."""
  drawn = tokens_T[prompt_len:].tolist()
  return drawn[: drawn.index(eos_id)] if eos_id in drawn else drawn


def exact_match(
  params: Any,
  cfg: specs.ModelSpec,
  tokenizer: Any,
  items: Sequence[tuple[str, str]],
  *,
  batch: int = 16,
  temperature: float = 0.0,
  samples: int = 1,
) -> tuple[float, list[str]]:
  """(share of L2R completions equal to the response, spaces stripped at the ends; the
  completions, `samples` per prompt in turn). Greedy by default; at a temperature each prompt is
  drawn `samples` times, each with its own seed, and the share is over every draw. Prompts that
  leave no position to draw count as misses."""
  t = cfg.block_size
  ids = [x for x in (tokenizer.encode(p) for p, _ in items) for _ in range(samples)]
  wants = [w for _, w in items for _ in range(samples)]
  fits = [i for i, x in enumerate(ids) if len(x) < t]
  finished = complete(
    params,
    cfg,
    [ids[i] for i in fits],
    eos_id=tokenizer.eos_id,
    vocab_limit=min(tokenizer.vocab_size, cfg.vocab_size),
    batch=batch,
    temperature=temperature,
  )
  texts = [""] * len(ids)
  for i, f in zip(fits, finished):
    texts[i] = tokenizer.decode(response_ids(f.tokens, len(ids[i]), tokenizer.eos_id))
  hits = sum(got.strip() == want.strip() for got, want in zip(texts, wants))
  return hits / len(ids), texts
