"""Texts from a model in any decoding mode: the body of `ao-mdm sample` (docs/sampling.md)."""
import json
from collections.abc import Iterator
from typing import Any, Callable, Optional

import ml_collections
import numpy as np

from ao_mdm import interrupts
from ao_mdm.decode import common
from ao_mdm.decode import confidence
from ao_mdm.decode import draft
from ao_mdm.decode import options as options_lib
from ao_mdm.decode import parallel
from ao_mdm.decode import speculative
from ao_mdm.storage import fs
from ao_mdm.train import checkpoints

def sample_texts(params: Any, cfg: ml_collections.ConfigDict, tokenizer: Any, *,
                 num_samples: int, batch_size: int, prompt: str = "", infill: str = "",
                 infill_span: int = 8, seed: int = 0, progress: Optional[Callable] = None,
                 mode: str = "parallel", **options) -> Iterator[dict]:
  """An iterator of `num_samples` texts ({text, tokens}, `marked` with a prompt or infill, the
  `steps` used), each batch's as it finishes. The arguments are checked at the call, the mode's
  own options by its sampler (first batch). `options` go to the mode's sampler: parallel.sample
  (parallel), speculative.sample (draft, order: L2R by default; one token or more per forward)
  or confidence.sample (steps, score); options of another mode are ignored, unknown ones
  refused. steps=None: decode/options.DEFAULT_STEPS, or the number of unknown positions if
  fewer. order=None (parallel): left to right after a prompt or infill, random without
  (parallel.default_order); the parallel mode's records name the order used.

  Batch i uses seed + i * batch_size; ids beyond the tokenizer's vocab are never drawn.
  """
  options_lib.sample_counts(num_samples, batch_size)
  options_lib.one_of("mode", mode, options_lib.MODES)
  sampler = {"parallel": parallel.sample, "speculative": speculative.sample,
             "confidence": confidence.sample}[mode]
  unknown = set(options) - options_lib.MODE_OPTION_NAMES
  if unknown:
    raise TypeError(f"sample_texts got unknown options {sorted(unknown)}")
  options = {k: v for k, v in options.items() if k in options_lib.MODE_OPTIONS[mode]}
  positions, ids = parallel.layout_known(tokenizer.encode, cfg.block_size, prompt, infill,
                                         infill_span)
  if "steps" in options and options["steps"] is None:
    options["steps"] = min(options_lib.DEFAULT_STEPS, cfg.block_size - len(positions))
  if mode == "parallel":
    options["order"] = parallel.default_order(options.get("order"), len(positions))
  elif mode == "speculative":
    options["order"] = options.get("order") or "l2r"
  # Cast once here: each batch's sampler then finds the params (and a draft head's) already in
  # the decoding dtype.
  params, cfg = common.with_dtype(params, cfg, options.get("dtype", "float32"))
  if options.get("draft_head") is not None:
    options["draft_head"] = common.with_dtype(options["draft_head"], cfg, cfg.dtype)[0]
  batch_size = min(batch_size, num_samples)
  known = np.zeros(cfg.block_size, bool)
  known[positions] = True

  def records() -> Iterator[dict]:
    for start in range(0, num_samples, batch_size):
      out = sampler(params, cfg, batch_size=batch_size, seed=seed + start,
                    known_positions=positions, known_tokens=ids,
                    vocab_limit=min(tokenizer.vocab_size, cfg.vocab_size), **options)
      if progress:
        progress(1)
      for i, row in enumerate(out.tokens[:num_samples - start]):
        text = parallel.decode_text(tokenizer.decode, row, tokenizer.eos_id, tokenizer.vocab_size)
        record = {"text": text, "tokens": row.tolist()}
        if "steps" in options:
          record["steps"] = int(options["steps"])
        if "order" in options:
          record["order"] = options["order"]
        if out.stats:  # speculative: sequential forwards and draft counts of this sample
          record.update({k: v[i].item() for k, v in out.stats.items() if np.ndim(v)})
        if positions:
          record["marked"] = parallel.mark_generated(tokenizer.decode, row, known,
                                                     tokenizer.eos_id, tokenizer.vocab_size)
        yield record
  return records()


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
  to `out.partial`, renamed to `out` at the end; on Ctrl-C or an error the finished ones are
  kept."""
  config, params, tokenizer = checkpoints.load_run(checkpoint, weights)
  settings = {"checkpoint": checkpoint, "prompt": prompt, "infill": infill, "seed": seed,
              "mode": mode, **options}
  if options.get("draft_head"):  # the path is recorded; the sampler takes the params
    options["draft_head"] = draft.load(options["draft_head"], config.model, params)
  partial = f"{out}.partial" if out else None
  written = [0]

  def keep_finished(signalled: bool = False) -> Optional[str]:
    """The finished samples go to `out`; says how many unless all of them were written (after a
    signal, counted in the file: the signal may fall between a write and its count)."""
    if not partial:
      return None
    kept = written[0]
    if signalled and fs.exists(partial):
      kept = fs.read_bytes(partial).count(b"\n")
    if not kept:
      return None
    fs.move(partial, out)
    return f"kept the {kept} finished samples in {out}" if kept < num_samples else None
  updates = []  # the progress bar, made once sample_texts has checked the counts
  records = sample_texts(params, config.model, tokenizer, num_samples=num_samples,
                         batch_size=batch_size, prompt=prompt, infill=infill,
                         infill_span=infill_span, seed=seed, mode=mode,
                         progress=lambda n: updates[0](n), **options)
  updates.append(progress(-(-num_samples // min(batch_size, num_samples))))
  if partial:  # a partial file of an earlier, killed call
    fs.remove(partial)
  with interrupts.on_interrupt(lambda: keep_finished(signalled=True)):
    try:
      for i, r in enumerate(records):
        show(f"--- sample {i} ({describe(r, mode, settings)}) ---\n"
             f"{r.get('marked', r['text'])}\n")
        if partial:  # an error before the first sample leaves nothing
          fs.append(partial, (json.dumps({**r, "tokenizer": config.data.tokenizer, **settings,
                                          "steps": r.get("steps"),
                                          "order": r.get("order")}) + "\n").encode())
        written[0] += 1
    except Exception:
      said = keep_finished()
      if said:
        show(said)
      raise
  keep_finished()
  return written[0]
