"""bf16 decoding against float32 on a trained model: greedy agreement and generative perplexity.

  python benchmarks/bf16_decoding.py --checkpoint=RUN [--scorer=RUN] [--steps=16,64]
      [--num_samples=64] [--seed=0]

For each S: greedy samples in both dtypes (same seeds, so the same random orders) and the
fraction of their first 16 positions that are equal; how close fp32's greedy decisions are to
ties (the share whose top-2 logit gap is below 0.1) and the bf16 logit error where the context is
the same in both (the first step's predictions: median and max |bf16 - fp32| of the chosen
logit); then temperature-1 samples in both dtypes and their generative perplexity under --scorer
(default: the run itself, left to right) with its standard error. One JSON line per S.
"""

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--scorer", default=None)
  parser.add_argument("--steps", default="16,64")
  parser.add_argument("--num_samples", type=int, default=64)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  import numpy as np

  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.decode import generate, parallel, schedules
  from ao_mdm.eval import perplexity, scoring

  config, params, tokenizer = checkpoints.load_run(args.checkpoint, "ema")
  scorer_config, scorer_params = (
    (config, params) if args.scorer is None else checkpoints.load_params(args.scorer, "ema")
  )
  scorer = scoring.Scorer(scorer_params, scorer_config.model, scorer_config.mesh)

  def tokens(steps, dtype, temperature):
    records = generate.sample_texts(
      params,
      config.model,
      tokenizer,
      num_samples=args.num_samples,
      batch_size=args.batch_size,
      seed=args.seed,
      steps=steps,
      temperature=temperature,
      dtype=dtype,
    )
    return np.asarray([r["tokens"] for r in records])

  limit = min(tokenizer.vocab_size, config.model.vocab_size)
  for steps in [int(s) for s in args.steps.split(",")]:
    greedy = {
      d: parallel.sample(
        params,
        config.model,
        batch_size=args.num_samples,
        steps=steps,
        temperature=0.0,
        seed=args.seed,
        return_logits=True,
        vocab_limit=limit,
        dtype=d,
      )
      for d in ("float32", "bfloat16")
    }
    g32, g16 = greedy["float32"], greedy["bfloat16"]
    top2 = np.sort(g32.logits[..., :limit], axis=-1)[..., -2:]
    first = g32.order[
      :, : schedules.schedule_counts(config.model.block_size, 0, steps, "linear")[1]
    ]
    rows = np.arange(args.num_samples)[:, None]
    picked = g32.tokens[rows, first]
    error = np.abs(g16.logits[rows, first, picked] - g32.logits[rows, first, picked])
    row = {
      "steps": steps,
      "samples": args.num_samples,
      "greedy_agreement_first_16": float(np.mean(g32.tokens[:, :16] == g16.tokens[:, :16])),
      "greedy_agreement_all": float(np.mean(g32.tokens == g16.tokens)),
      "fp32_decisions_with_gap_below_0.1": float(np.mean(top2[..., 1] - top2[..., 0] < 0.1)),
      "first_step_logit_error_median": float(np.median(error)),
      "first_step_logit_error_max": float(np.max(error)),
    }
    for dtype in ("float32", "bfloat16"):
      r = perplexity.generative_perplexity(
        scorer, tokens(steps, dtype, 1.0).tolist(), args.batch_size
      )
      row[dtype] = {"gen_ppl": r["gen_ppl"], "gen_ppl_sem": r["gen_ppl_sem"]}
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
