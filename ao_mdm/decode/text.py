"""The text side of decoding: where a prompt's or an infill text's tokens go among the T
positions, and the text of generated ids (documents split at EOS, generated runs marked)."""

import itertools
from typing import Any

MASK = "[MASK]"


def check_text(prompt: str, infill: str, span: int) -> None:
  """ValueError for what is wrong with a prompt or infill text whatever the model (a command
  checks it before loading one): both given, no [MASK] in an infill, a span below 1."""
  if prompt and infill:
    raise ValueError("give a prompt (--prompt) or an infill text (--infill), not both")
  if span < 1:
    raise ValueError(f"--infill_span={span} must be >= 1")
  if infill and MASK not in infill:
    raise ValueError(
      f"the infill text has no {MASK} to fill in; give e.g. --infill='a {MASK} "
      "b', or --prompt=TEXT to continue a text"
    )


def layout_known(
  encode: Any, t: int, prompt: str = "", infill: str = "", span: int = 8
) -> tuple[list, list, int]:
  """Known (positions, token ids) for a prefix prompt or an infill text with [MASK] spans, and
  the end of what is generated.

  Each [MASK] leaves `span` positions to generate. An infill ends where its text ends (a text
  ending in [MASK] is continued by `span` tokens); a prompt, or no text, is continued to T.
  """
  check_text(prompt, infill, span)
  pieces = infill.split(MASK) if infill else [prompt] if prompt else []
  positions: list[int] = []
  ids: list[int] = []
  cursor = 0
  for i, piece in enumerate(pieces):
    piece_ids = encode(piece) if piece else []
    positions += range(cursor, cursor + len(piece_ids))
    ids += piece_ids
    cursor += len(piece_ids) + (span if i < len(pieces) - 1 else 0)
  if cursor > t and infill:
    raise ValueError(
      f"the infill text and its {len(pieces) - 1} [MASK] span(s) of "
      f"--infill_span={span} take {cursor} positions, but T={t}; use a smaller "
      "--infill_span or a shorter text"
    )
  if cursor >= t and not infill:  # an infill may end at T: its [MASK]s are inside
    raise ValueError(
      f"the prompt takes {cursor} positions but T={t}; the prompt is too long "
      "(at least one position must be left to generate)"
    )
  return positions, ids, cursor if infill else t


def decode_text(decode: Any, ids: Any, eos_id: int, vocab_size: int) -> str:
  """Text of generated ids: documents split at EOS, ids beyond the tokenizer's vocab dropped."""
  docs: list[list[int]] = []
  current: list[int] = []
  for i in ids:
    if i == eos_id:
      docs.append(current)
      current = []
    elif i < vocab_size:
      current.append(int(i))
  docs.append(current)
  return "\n\n".join(decode(d) for d in docs)


def mark_generated(decode: Any, ids: Any, known: Any, eos_id: int, vocab_size: int) -> str:
  """The text with every run of generated tokens in [[ ]]; known tokens (prompt, infill
  context) as they are: shows what the model filled in."""
  pieces = []
  for generated, run in itertools.groupby(range(len(ids)), key=lambda i: not known[i]):
    text = decode_text(decode, [ids[i] for i in run], eos_id, vocab_size)
    pieces.append(f"[[{text}]]" if generated else text)
  return "".join(pieces)
