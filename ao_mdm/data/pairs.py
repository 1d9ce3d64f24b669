"""Prompt/response pairs for fine-tuning (docs/posttraining.md): read from a JSON-lines file or
generated (`arithmetic:N`), tokenized into padded rows that train/step.py orders prompt first.

A row is int32 [T + 2]: the tokens (prompt, response, EOS, then zeros), then the prompt's length p
and the length n up to and with the EOS. Padding rather than packing: a response then sees its
own prompt only, and the padding, last in the order, is seen by no slot the loss counts.
"""

from collections.abc import Sequence
import json
import math

import numpy as np

from ao_mdm.storage import fs

EXTRA = 2  # the (prompt length, length) columns after a row's tokens
GENERATED = ("arithmetic", "reversal")  # tasks made in-process from a seed (`load`)
VALIDATION_FRACTION = 0.05  # of a file's pairs, the last ones (at least one)
ARITHMETIC_VALIDATION = 256  # pairs of a generated task's validation split


def render_chat(messages: list) -> tuple[str, str]:
  """A chat as (prompt, response): each turn as `role: content` on its own line, the prompt
  ending with `assistant: `; the last turn, the assistant's, is the response."""
  if not messages or any(
    not isinstance(m, dict) or not isinstance(m.get("content"), str) for m in messages
  ):
    raise ValueError("messages must be a non-empty list of {role, content} objects")
  for i, m in enumerate(messages):
    if not isinstance(m.get("role"), str) or not m["role"]:
      raise ValueError(f'messages[{i}] has no role: each turn needs a "role" string')
  if messages[-1]["role"] != "assistant":
    raise ValueError("the last message must be the assistant's (the response)")
  turns = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:-1])
  return turns + "assistant: ", messages[-1]["content"]


def read_pairs(path: str) -> list[tuple[str, str]]:
  """The (prompt, response) of each line of a JSON-lines file: {"prompt", "response"} strings,
  or {"messages": [{"role", "content"}, ...]} (render_chat). Blank lines are skipped."""
  data = fs.read_bytes(path)
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    where = data[: e.start].count(b"\n") + 1
    raise ValueError(f"{path}, line {where}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None
  pairs = []
  for number, line in enumerate(text.split("\n"), 1):
    if not line.strip():
      continue
    try:
      item = json.loads(line)
      if not isinstance(item, dict):
        raise ValueError("not a JSON object")
      if "messages" in item:
        pairs.append(render_chat(item["messages"]))
      elif isinstance(item.get("prompt"), str) and isinstance(item.get("response"), str):
        pairs.append((item["prompt"], item["response"]))
      else:
        raise ValueError('expected string fields "prompt" and "response", or "messages"')
    except ValueError as e:  # json.JSONDecodeError is one
      raise ValueError(f"{path}, line {number}: {e}") from None
  if len(pairs) < 2:
    raise ValueError(f"{path} holds {len(pairs)} pair(s); train and validation need 2 or more")
  return pairs


def arithmetic(n: int, seed: int) -> list[tuple[str, str]]:
  """n sums of two numbers below 100: ("37+45=", "82"); the first n of a seed's sums are those
  of any larger n. The carry makes the order an answer's digits are drawn in matter."""
  rng = np.random.default_rng(seed)
  return [(f"{x}+{y}=", str(x + y)) for x, y in rng.integers(0, 100, (n, 2)).tolist()]


def reversal(n: int, seed: int) -> list[tuple[str, str]]:
  """n strings of 6 to 15 digits and the same digits reversed: ("5281739>", "9371825"); the
  first n of a seed's are those of any larger n. A task of another kind than the sums: each
  answer digit is copied from a place that depends on the prompt's length (the demo model learns
  it to about 63% greedy exact match, arithmetic:N's sums to 18-70%)."""
  u = np.random.default_rng(seed).random((n, 16))  # a row a pair: its length, then its digits
  strings = ["".join(str(int(10 * d)) for d in x[1 : 7 + int(10 * x[0])]) for x in u.tolist()]
  return [(f"{s}>", s[::-1]) for s in strings]


def generated(name: str, n: int, seed: int) -> list[tuple[str, str]]:
  """The first n pairs of the generated task `name` (one of GENERATED) from a seed."""
  return {"arithmetic": arithmetic, "reversal": reversal}[name](n, seed)


def load(source: str, split: str) -> list[tuple[str, str]]:
  """The pairs of data.pairs's `split` (train or validation): a file's last 5% are validation;
  a generated task's `NAME:N` (arithmetic:N, reversal:N) draws N training pairs (seed 0) and
  ARITHMETIC_VALIDATION distinct pairs that are none of them (seed 1)."""
  name, _, count = source.partition(":")
  if name in GENERATED:
    if not count.isdigit() or not 1 <= int(count) <= 5000:
      raise ValueError(f"data.pairs={source!r}: expected {name}:N with 1 <= N <= 5000 pairs")
    train = generated(name, int(count), 0)
    if split == "train":
      return train
    seen = set(train)
    unseen = [x for x in generated(name, 40 * ARITHMETIC_VALIDATION, 1) if x not in seen]
    return list(dict.fromkeys(unseen))[:ARITHMETIC_VALIDATION]
  pairs = read_pairs(source)
  n_val = math.ceil(VALIDATION_FRACTION * len(pairs))
  return pairs[:-n_val] if split == "train" else pairs[-n_val:]


def encode(pairs: Sequence[tuple[str, str]], tokenizer, t: int) -> tuple[np.ndarray, int]:
  """(int32 [N, t + EXTRA] rows, how many pairs were dropped for not fitting in t tokens with
  the EOS). A pair whose prompt is empty gets none of its slots conditioned on text."""
  prompts = tokenizer.encode_batch([p for p, _ in pairs])
  responses = tokenizer.encode_batch([r for _, r in pairs])
  rows = []
  for p_ids, r_ids in zip(prompts, responses):
    ids = p_ids + r_ids + [tokenizer.eos_id]
    if len(ids) <= t:
      rows.append(ids + [0] * (t - len(ids)) + [len(p_ids), len(ids)])
  return np.asarray(rows, np.int32).reshape(-1, t + EXTRA), len(pairs) - len(rows)


def split_rows(rows_BX):
  """(tokens [B, T], prompt lengths [B], lengths [B]) of rows (numpy or jax)."""
  return rows_BX[:, :-EXTRA], rows_BX[:, -2], rows_BX[:, -1]


def narrowed(*rows: np.ndarray) -> tuple:
  """The rows cut to the longest pair among them, rounded up to a multiple of 8 (a wide block
  spends most of a short pair's compute on padding that no counted slot sees)."""
  longest = max(int(r[:, -1].max(initial=1)) for r in rows)
  width = min(-(-longest // 8) * 8, rows[0].shape[1] - EXTRA)
  return tuple(np.concatenate([r[:, :width], r[:, -EXTRA:]], axis=1) for r in rows)


class Rows:
  """Encoded pairs as a row source of data/pipeline.py's batches (all in memory)."""

  def __init__(self, rows_NX: np.ndarray, name: str):
    self.array, self._name = rows_NX, name
    self.block_size = rows_NX.shape[1] - EXTRA

  @property
  def name(self) -> str:
    return self._name

  def __len__(self) -> int:
    return len(self.array)

  def rows(self, indices: Sequence[int]) -> np.ndarray:
    return self.array[np.asarray(indices, np.int64)]


def rows_for(source: str, split: str, tokenizer, t: int, log=print) -> Rows:
  """The encoded pairs of a split, with one line on how many did not fit."""
  pairs = load(source, split)
  rows, dropped = encode(pairs, tokenizer, t)
  if not len(rows):
    raise ValueError(
      f"none of the {len(pairs)} {split} pairs of data.pairs={source!r} fits in "
      f"model.block_size={t} tokens (prompt, response and EOS)"
    )
  if dropped:
    log(f"{split}: left out {dropped} of {len(pairs)} pairs longer than {t} tokens")
  return Rows(rows, f"data.pairs {split}")
