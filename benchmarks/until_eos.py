"""Variable-length generation (`ao-mdm sample --until_eos`) against fixed-length decoding at equal
steps per token: lengths, forwards per generated token and generative perplexity
(docs/sampling.md, "Until EOS").

Usage: .venv/bin/python benchmarks/until_eos.py --checkpoint runs/demo [--samples 64]
       [--batch_size 16] [--prompt TEXT ...]

For each prompt ("" is unconditional), at temperature 1, top-p 1, seed 0 and the same batches:
speculative L2R (k = 4) and parallel decoding in a random order at S = T and S = T/4, each fixed
length (the parallel mode in one block and in blocks of --block_len) and until EOS (in blocks).
Each setting runs once to compile, then timed. Generative perplexity is `ao-mdm eval
--generated`'s (perplexity.generative_perplexity) under --scorer (default: the model itself);
a sample of one token (an EOS first) cannot be scored and is left out of it, and counted.
Forwards are sequential model calls (parallel: steps; speculative: verification forwards),
per sample and per kept token (those up to the EOS), for a row alone and in its batch (a
batch runs until its last row is done). Prints a markdown table and one JSON line per row.
"""

import argparse
import json
import time

import numpy as np

DEFAULT_PROMPTS = ("", "God bless you, and God bless the United States of America.")


def summary(records: list, known: int, batch_size: int, eos_id: int) -> dict:
  """Length distribution, samples holding an EOS after the prompt, and forwards of one
  setting's records."""
  lengths = np.asarray([len(r["tokens"]) for r in records])
  forwards = np.asarray([r.get("forwards", r.get("steps")) for r in records])
  batches = [forwards[i : i + batch_size].max() for i in range(0, len(forwards), batch_size)]
  generated = lengths - known
  return {
    "length_mean": float(lengths.mean()),
    "length_median": float(np.median(lengths)),
    "length_min": int(lengths.min()),
    "length_max": int(lengths.max()),
    "with_eos": int(sum(eos_id in r["tokens"][known:] for r in records)),
    "forwards_mean": float(forwards.mean()),
    "forwards_per_token": float(forwards.sum() / generated.sum()),
    "batch_forwards_per_token": float(np.sum(batches) * batch_size / generated.sum()),
    "batch_forwards_mean": float(np.mean(batches)),
  }


HEADER = (
  "| prompt | setting | until EOS | length mean / median / min / max | samples with an EOS "
  "| forwards per sample (row / batch) | forwards per kept token (row / batch) | gen ppl "
  "| wall s |\n|---|---|---|---|---|---|---|---|---|"
)


def table_row(row: dict) -> str:
  """One markdown row of the table (from a row's JSON line)."""
  unscored = f" ({row['unscored']} unscored)" if row["unscored"] else ""
  return (
    f"| {row['prompt'][:20] or '(none)'} | {row['setting']} | "
    f"{'yes' if row['until_eos'] else 'no'} | {row['length_mean']:.1f} / "
    f"{row['length_median']:.0f} / {row['length_min']} / {row['length_max']} | "
    f"{row['with_eos']} | {row['forwards_mean']:.1f} / {row['batch_forwards_mean']:.1f} | "
    f"{row['forwards_per_token']:.2f} / {row['batch_forwards_per_token']:.2f} | "
    f"{row['gen_ppl']:.0f} +- {row['gen_ppl_sem']:.0f}{unscored} | {row['seconds']:.2f} |"
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--scorer", default=None, help="default: --checkpoint")
  parser.add_argument("--samples", type=int, default=64)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--block_len", type=int, default=16)
  parser.add_argument(
    "--prompt",
    action="append",
    default=None,
    help="repeatable; default: none, and the end of a speech",
  )
  args = parser.parse_args()
  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.decode import generate
  from ao_mdm.eval import perplexity, scoring

  config, params, tokenizer = checkpoints.load_run(args.checkpoint)
  scorer_config, scorer_params = checkpoints.load_params(args.scorer or args.checkpoint)
  scorer = scoring.Scorer(scorer_params, scorer_config.model)
  t, block = config.model.block_size, args.block_len
  settings = [
    ("speculative L2R k=4", dict(mode="speculative", draft=4), False),
    ("speculative L2R k=4", dict(mode="speculative", draft=4), True),
  ]
  for s in (t, t // 4):
    settings += [
      (f"parallel random S={s}", dict(steps=s, order="random"), False),
      (
        f"parallel random S={s}, blocks of {block}",
        dict(steps=s, order="random", block_len=block),
        False,
      ),
      (
        f"parallel random S={s}, blocks of {block}",
        dict(steps=s, order="random", block_len=block),
        True,
      ),
    ]
  print(HEADER)
  rows = []
  for prompt in args.prompt or DEFAULT_PROMPTS:
    known = len(tokenizer.encode(prompt)) if prompt else 0
    for name, options, until_eos in settings:
      if options.get("steps", 0) > t - known:
        options = {**options, "steps": t - known}
        name = name.replace(f"S={t}", f"S={t - known}")
      run = lambda n, opts=options, stop=until_eos: list(
        generate.sample_texts(
          params,
          config.model,
          tokenizer,
          num_samples=n,
          batch_size=args.batch_size,
          prompt=prompt,
          seed=0,
          until_eos=stop,
          **opts,
        )
      )
      run(args.batch_size)  # compile
      start = time.perf_counter()
      records = run(args.samples)
      seconds = time.perf_counter() - start
      row = {
        "prompt": prompt,
        "setting": name,
        "until_eos": until_eos,
        "seconds": seconds,
        **summary(records, known, args.batch_size, tokenizer.eos_id),
      }
      scored = [r["tokens"] for r in records if len(r["tokens"]) >= 2]
      row.update(perplexity.generative_perplexity(scorer, scored))
      row["unscored"] = len(records) - len(scored)
      rows.append(row)
      print(table_row(row), flush=True)
  for row in rows:
    print(json.dumps(row))


if __name__ == "__main__":
  main()
