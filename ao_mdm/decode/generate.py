"""Texts from a model in any decoding mode, batch by batch (what `ao-mdm sample` shows and
writes; docs/sampling.md)."""

from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

import numpy as np

from ao_mdm import specs
from ao_mdm.decode import common, policies, text
from ao_mdm.decode import options as options_lib


def sample_texts(
  params: Any,
  cfg: specs.ModelSpec,
  tokenizer: Any,
  *,
  num_samples: int,
  batch_size: int,
  prompt: str = "",
  infill: str = "",
  infill_span: int = 8,
  seed: int = 0,
  progress: Callable | None = None,
  mode: str = "parallel",
  until_eos: bool = False,
  best_of: int = 1,
  **options,
) -> Iterator[dict]:
  """An iterator of `num_samples` texts ({text, tokens}, `marked` with a prompt or infill, the
  `steps` used, per token the log-probability it was drawn with after filtering and the model's
  own: `logprobs`, `raw_logprobs`), each batch's as it finishes, decoded by the policy `mode`
  (decode/policies.py). The arguments are checked at the call, the policy's own options by its
  sampler (first batch). `options` go to the policy's sampler; options of another policy are
  ignored, unknown ones refused. steps=None: decode/options.DEFAULT_STEPS, or the number of
  unknown positions if fewer. order=None: the policy's default (Policy.order); the records
  name the order used.
  until_eos (a policy and order that can stop there, no infill): each sample ends at its first
  EOS after the prompt (tokenizer.eos_id; the parallel policy decodes in blocks of block_len,
  default options.DEFAULT_BLOCK_LEN, and stops after the block that holds it); its record's
  tokens end there and it gains `length` (those tokens, T without an EOS) and `forwards` (its
  steps or speculative forwards). An infill sample ends where its text ends: only the [MASK]
  spans are drawn (a text ending in [MASK] is continued by infill_span tokens).

  best_of=n: each sample is the best of n draws by the exact log-probability per drawn token of
  what it drew given the known tokens (common.drawn_logprob; its record gains `logprob`,
  that sum, and `best_of`).

  Batch i uses seed + i * batch_size (its draw j of best_of: + j * num_samples); ids beyond the
  tokenizer's vocab are never drawn.
  """
  options_lib.check_counts(num_samples, batch_size)
  options_lib.check_best_of(best_of)
  policy = policies.get(mode)
  if until_eos:
    policies.check_until_eos(mode, options.get("order"), infill)
  unknown = set(options) - policies.option_names()
  if unknown:
    raise TypeError(f"sample_texts got unknown options {sorted(unknown)}")
  options = {k: v for k, v in options.items() if k in policy.options}
  for name, value in policy.until_eos_defaults if until_eos else ():
    if options.get(name) is None:
      options[name] = value
  positions, ids, end = text.layout_known(
    tokenizer.encode, cfg.block_size, prompt, infill, infill_span
  )
  if end < cfg.block_size:
    options["end"] = end
  if "steps" in options and options["steps"] is None:
    options["steps"] = min(options_lib.DEFAULT_STEPS, end - len(positions))
  if policy.orders:
    options["order"] = policy.order(options.get("order"), len(positions))
  # Cast once here: each batch's sampler then finds the params (and a draft head's) already in
  # the decoding dtype.
  params, cfg = common.with_dtype(params, cfg, options.get("dtype", "float32"))
  if options.get("draft_head") is not None:
    options["draft_head"] = common.with_dtype(options["draft_head"], cfg, cfg.dtype)[0]
  batch_size = min(batch_size, num_samples)
  known = np.zeros(cfg.block_size, bool)
  known[positions] = True
  stop = {"eos_id": tokenizer.eos_id} if until_eos else {}

  draw = lambda batch_seed: policy.sample(
    params,
    cfg,
    batch_size=batch_size,
    seed=batch_seed,
    known_positions=positions,
    known_tokens=ids,
    vocab_limit=min(tokenizer.vocab_size, cfg.vocab_size),
    **stop,
    **options,
  )

  def best(start: int) -> tuple[common.SampleOutput, np.ndarray | None]:
    """The batch at `start`, each row the best of `best_of` draws (and their log-probs)."""
    outs = [draw(seed + start + j * num_samples) for j in range(best_of)]
    if best_of == 1:
      return outs[0], None
    logprob, per_token = [], []
    for out in outs:
      drawn_BT = ~known & (np.arange(cfg.block_size) < lengths(out)[:, None])
      logprob.append(common.drawn_logprob(params, cfg, out.tokens, known[None], drawn_BT))
      per_token.append(logprob[-1] / np.maximum(drawn_BT.sum(1), 1))
    pick_B = np.argmax(np.stack(per_token), axis=0)
    chosen = common.SampleOutput(
      **{f.name: _pick([getattr(o, f.name) for o in outs], pick_B) for f in fields(outs[0])}
    )
    return chosen, np.stack(logprob)[pick_B, np.arange(batch_size)]

  def lengths(out: common.SampleOutput) -> np.ndarray:
    """[B] each row's positions that are part of its sample (until_eos: up to its EOS)."""
    if until_eos:  # the tokens after the first EOS are not part of the sample
      assert out.stats is not None  # with eos_id: the lengths
      return np.minimum(out.stats["length"], end)
    return np.full(len(out.tokens), end)

  def records() -> Iterator[dict]:
    for start in range(0, num_samples, batch_size):
      out, logprob = best(start)
      if progress:
        progress(1)
      length_B = lengths(out)
      for i, row in enumerate(out.tokens[: num_samples - start]):
        row = row[: length_B[i]]
        decoded = text.decode_text(tokenizer.decode, row, tokenizer.eos_id, tokenizer.vocab_size)
        record = {"text": decoded, "tokens": row.tolist()}
        if out.logprobs is not None:  # per position, as drawn and the model's own; known: 0
          for name in ("logprobs", "raw_logprobs"):
            record[name] = [float(f"{x:.7g}") for x in getattr(out, name)[i][: len(row)]]
        if "steps" in options:
          record["steps"] = int(options["steps"])
        if "order" in options:
          record["order"] = options["order"]
        if options.get("block_len") is not None:
          record["block_len"] = int(options["block_len"])
        if out.stats:  # sequential forwards (and speculative draft counts, until_eos lengths)
          record.update({k: v[i].item() for k, v in out.stats.items() if np.ndim(v)})
        if logprob is not None:
          record.update(best_of=best_of, logprob=float(f"{logprob[i]:.7g}"))
        if positions:
          record["marked"] = text.mark_generated(
            tokenizer.decode, row, known, tokenizer.eos_id, tokenizer.vocab_size
          )
        yield record

  return records()


def _pick(values: list, pick_B: np.ndarray) -> Any:
  """Row b of values[pick_B[b]], for one SampleOutput field of each draw (a dict: per key; a
  value without a row axis, or None, as the first draw has it)."""
  first = values[0]
  if isinstance(first, dict):
    return {k: _pick([v[k] for v in values], pick_B) for k in first}
  if first is None or not np.ndim(first):
    return first
  return np.stack(values)[pick_B, np.arange(len(pick_B))]
