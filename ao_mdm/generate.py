"""Texts from a model in any decoding mode: the body of `ao-mdm sample` (docs/sampling.md)."""
import json
import os
from collections.abc import Iterator
from typing import Any, Callable, Optional

import ml_collections
import numpy as np

from ao_mdm import checkpoints
from ao_mdm import checks
from ao_mdm import confidence
from ao_mdm import decoding
from ao_mdm import draft
from ao_mdm import interrupts
from ao_mdm import options as options_lib
from ao_mdm import sampling
from ao_mdm import speculative

DEFAULT_STEPS = 64  # or the number of unknown positions, if fewer


def sample_texts(params: Any, cfg: ml_collections.ConfigDict, tokenizer: Any, *,
                 num_samples: int, batch_size: int, prompt: str = "", infill: str = "",
                 infill_span: int = 8, seed: int = 0, progress: Optional[Callable] = None,
                 mode: str = "parallel", **options) -> Iterator[dict]:
  """Yields `num_samples` texts ({text, tokens}, `marked` with a prompt or infill, the `steps`
  used) as each batch finishes; `options` go to the mode's sampler: sampling.sample (parallel),
  speculative.sample (draft, order: L2R by default; one token or more per forward) or
  confidence.sample (steps, score); options of another mode are ignored, unknown ones refused.
  steps=None: DEFAULT_STEPS, or the number of unknown positions if fewer. order=None (parallel):
  left to right after a prompt or infill, random without (sampling.default_order); the parallel
  mode's records name the order used.

  Batch i uses seed + i * batch_size; ids beyond the tokenizer's vocab are never drawn.
  """
  checks.sample_counts(num_samples, batch_size)
  checks.mode_options(mode, set())
  sampler = {"parallel": sampling.sample, "speculative": speculative.sample,
             "confidence": confidence.sample}[mode]
  unknown = set(options) - options_lib.MODE_OPTION_NAMES
  if unknown:
    raise TypeError(f"sample_texts got unknown options {sorted(unknown)}")
  options = {k: v for k, v in options.items() if k in options_lib.MODE_OPTIONS[mode]}
  positions, ids = sampling.layout_known(tokenizer.encode, cfg.block_size, prompt, infill,
                                         infill_span)
  if "steps" in options and options["steps"] is None:
    options["steps"] = min(DEFAULT_STEPS, cfg.block_size - len(positions))
  if mode == "parallel":
    options["order"] = sampling.default_order(options.get("order"), len(positions))
  elif mode == "speculative":
    options["order"] = options.get("order") or "l2r"
  # Cast once here: each batch's sampler then finds the params (and a draft head's) already in
  # the decoding dtype.
  params, cfg = decoding.with_dtype(params, cfg, options.get("dtype", "float32"))
  if options.get("draft_head") is not None:
    options["draft_head"] = decoding.with_dtype(options["draft_head"], cfg, cfg.dtype)[0]
  batch_size = min(batch_size, num_samples)
  known = np.zeros(cfg.block_size, bool)
  known[positions] = True
  for start in range(0, num_samples, batch_size):
    out = sampler(params, cfg, batch_size=batch_size, seed=seed + start,
                  known_positions=positions, known_tokens=ids,
                  vocab_limit=min(tokenizer.vocab_size, cfg.vocab_size), **options)
    if progress:
      progress(1)
    for i, row in enumerate(out.tokens[:num_samples - start]):
      text = sampling.decode_text(tokenizer.decode, row, tokenizer.eos_id, tokenizer.vocab_size)
      record = {"text": text, "tokens": row.tolist()}
      if "steps" in options:
        record["steps"] = int(options["steps"])
      if "order" in options:
        record["order"] = options["order"]
      if out.stats:  # speculative: sequential forwards and draft counts of this sample
        record.update({k: v[i].item() for k, v in out.stats.items() if np.ndim(v)})
      if positions:
        record["marked"] = sampling.mark_generated(tokenizer.decode, row, known,
                                                   tokenizer.eos_id, tokenizer.vocab_size)
      yield record


def describe(record: dict, mode: str, settings: dict) -> str:
  """How a sample was made, as `ao-mdm sample` prints it above the text."""
  if mode == "speculative":
    drafter = "learned head" if settings.get("draft_head") else "self-drafted"
    return (f"speculative, {record['order']} order, draft {settings['draft']} ({drafter}): "
            f"{record['forwards']} forwards, "
            f"{record['accepted']} drafts accepted")
  return f"steps={record['steps']}, {record.get('order', mode)} order"


def sample_command(checkpoint: str, weights: str, out: Optional[str], show: Callable,
                   progress: Callable = lambda total: (lambda n: None), *, num_samples: int,
                   batch_size: int, seed: int, prompt: str, infill: str, infill_span: int,
                   mode: str, **options) -> int:
  """`ao-mdm sample`: each sample shown as it finishes and, with `out`, written as a JSON line
  to `out.partial`, renamed to `out` at the end; on Ctrl-C the finished ones are kept."""
  config, params, tokenizer = checkpoints.load_run(checkpoint, weights)
  settings = {"checkpoint": checkpoint, "prompt": prompt, "infill": infill, "seed": seed,
              "mode": mode, **options}
  if options.get("draft_head"):  # the path is recorded; the sampler takes the params
    options["draft_head"] = draft.load(options["draft_head"], config.model, params)
  partial = f"{out}.partial" if out else None
  if partial:  # missing directories of `out` are made (checks.output_file checked the parent)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  written = [0]

  def keep_finished():
    if partial and written[0]:
      os.replace(partial, out)
      return f"kept the {written[0]} finished samples in {out}"
    if partial:
      os.remove(partial)
    return None
  update = progress(-(-num_samples // min(batch_size, num_samples)))
  with open(partial or os.devnull, "w") as f, interrupts.on_interrupt(keep_finished):
    for i, r in enumerate(sample_texts(
        params, config.model, tokenizer, num_samples=num_samples, batch_size=batch_size,
        prompt=prompt, infill=infill, infill_span=infill_span, seed=seed, progress=update,
        mode=mode, **options)):
      show(f"--- sample {i} ({describe(r, mode, settings)}) ---\n{r.get('marked', r['text'])}\n")
      f.write(json.dumps({**r, "tokenizer": config.data.tokenizer, **settings,
                          "steps": r.get("steps"), "order": r.get("order")}) + "\n")
      f.flush()
      written[0] += 1
  if partial:
    os.replace(partial, out)
  return written[0]
