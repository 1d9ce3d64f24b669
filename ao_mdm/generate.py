"""Texts from a model in any decoding mode: the body of `ao-mdm sample` (docs/sampling.md)."""
from typing import Any, Callable, Optional

import ml_collections
import numpy as np

from ao_mdm import confidence
from ao_mdm import sampling
from ao_mdm import speculative

MODES = ("parallel", "speculative", "confidence")
_MODE_OPTIONS = {  # the options each mode's sampler takes
    "parallel": ("steps", "schedule", "temperature", "top_p", "top_k", "order", "top_p_rule"),
    "speculative": ("temperature", "top_p", "top_k", "top_p_rule", "draft"),
    "confidence": ("steps", "schedule", "temperature", "top_p", "top_k", "top_p_rule", "score"),
}


def check_counts(num_samples: int, batch_size: int) -> None:
  """The sample and batch counts must be positive (checked before a checkpoint is loaded)."""
  if num_samples < 1 or batch_size < 1:
    raise ValueError(f"--num_samples={num_samples} and --batch_size={batch_size} must be >= 1")


def sample_texts(params: Any, cfg: ml_collections.ConfigDict, tokenizer: Any, *,
                 num_samples: int, batch_size: int, prompt: str = "", infill: str = "",
                 infill_span: int = 8, seed: int = 0, progress: Optional[Callable] = None,
                 mode: str = "parallel", **options) -> list[dict]:
  """`num_samples` texts ({text, tokens}, and `marked` with a prompt or infill) in batches;
  `options` go to the mode's sampler: sampling.sample (parallel), speculative.sample (draft;
  the order is L2R, one token or more per forward) or confidence.sample (steps, score); options
  of another mode are ignored, unknown ones refused.

  Batch i uses seed + i * batch_size; ids beyond the tokenizer's vocab are never drawn.
  """
  check_counts(num_samples, batch_size)
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}; accepted: {', '.join(MODES)}")
  sampler = {"parallel": sampling.sample, "speculative": speculative.sample,
             "confidence": confidence.sample}[mode]
  unknown = set(options) - {k for keys in _MODE_OPTIONS.values() for k in keys}
  if unknown:
    raise TypeError(f"sample_texts got unknown options {sorted(unknown)}")
  options = {k: v for k, v in options.items() if k in _MODE_OPTIONS[mode]}
  positions, ids = sampling.layout_known(tokenizer.encode, cfg.block_size, prompt, infill,
                                         infill_span)
  batch_size = min(batch_size, num_samples)
  known = np.zeros(cfg.block_size, bool)
  known[positions] = True
  records = []
  for start in range(0, num_samples, batch_size):
    out = sampler(params, cfg, batch_size=batch_size, seed=seed + start,
                  known_positions=positions, known_tokens=ids,
                  vocab_limit=min(tokenizer.vocab_size, cfg.vocab_size), **options)
    for i, row in enumerate(out.tokens[:num_samples - start]):
      text = sampling.decode_text(tokenizer.decode, row, tokenizer.eos_id, tokenizer.vocab_size)
      records.append({"text": text, "tokens": row.tolist()})
      if out.stats:  # speculative: sequential forwards and draft counts of this sample
        records[-1].update({k: v[i].item() for k, v in out.stats.items() if np.ndim(v)})
      if positions:
        records[-1]["marked"] = sampling.mark_generated(tokenizer.decode, row, known,
                                                        tokenizer.eos_id, tokenizer.vocab_size)
    if progress:
      progress(1)
  return records
