"""Quality vs wall time of the three decoding modes on one trained model (docs/sampling.md).

Usage: .venv/bin/python benchmarks/compare_modes.py --checkpoint RUN --scorer L2R_RUN [--samples 32]

Samples unconditionally at temperature 1 and top-p 1 with: parallel (random order) and
confidence-ordered unmasking at S = T/8, T/4, T/2, T; self-speculative L2R at k = 2, 4, 8; plain
cached L2R (S = T). Each setting: one call to compile, then the timed call (the sampler only).
Generative perplexity under the L2R scorer run and the samples' unigram entropy; writes
docs/results/decoding_modes.json and docs/results/decoding_modes.png.
"""

import argparse
import json
import os
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="the model to sample from")
  parser.add_argument("--scorer", required=True, help="an L2R-trained run of the same tokenizer")
  parser.add_argument("--samples", type=int, default=32)
  parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results"))
  args = parser.parse_args()
  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.decode import confidence, parallel, speculative
  from ao_mdm.eval import perplexity, scoring

  config, params = checkpoints.load_params(args.checkpoint)
  scorer_config, scorer_params = checkpoints.load_params(args.scorer)
  scorer = scoring.Scorer(scorer_params, scorer_config.model)
  cfg, t, b = config.model, config.model.block_size, args.samples
  settings = [("L2R (cached)", {"steps": t}, lambda **kw: parallel.sample(order="l2r", **kw))]
  for s in (t // 8, t // 4, t // 2, t):
    settings.append((f"parallel S={s}", {"steps": s}, parallel.sample))
  for s in (t // 8, t // 4, t // 2, t):
    settings.append((f"confidence S={s}", {"steps": s}, confidence.sample))
  for k in (2, 4, 8):
    settings.append((f"speculative k={k}", {"draft": k}, speculative.sample))
  rows = []
  for name, options, fn in settings:
    run = lambda: fn(params=params, cfg=cfg, batch_size=b, seed=1, **options)
    run()  # compile
    start = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - start
    gen = perplexity.generative_perplexity(scorer, out.tokens.tolist())
    row = {"setting": name, "seconds": seconds, **gen}
    if out.stats:
      row["forwards_per_sequence"] = float(np.mean(out.stats["forwards"]))
    rows.append(row)
    print(
      f"{name:20s} {seconds:7.3f} s  gen ppl {gen['gen_ppl']:8.1f}  unigram entropy "
      f"{gen['unigram_entropy']:.2f}"
      + (f"  {row['forwards_per_sequence']:.1f} forwards" if out.stats else ""),
      flush=True,
    )
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "decoding_modes.json"), "w") as f:
    json.dump(
      {"checkpoint": args.checkpoint, "scorer": args.scorer, "samples": b, "rows": rows},
      f,
      indent=1,
    )
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for mode, marker in (("parallel", "o"), ("confidence", "s"), ("speculative", "^"), ("L2R", "x")):
    pts = [r for r in rows if r["setting"].startswith(mode)]
    ax.plot([r["seconds"] for r in pts], [r["gen_ppl"] for r in pts], marker=marker, label=mode)
    for r in pts:
      ax.annotate(r["setting"].split(" ")[-1], (r["seconds"], r["gen_ppl"]), fontsize=7)
  ax.set_xlabel(f"wall time for {b} samples (s)")
  ax.set_ylabel("generative perplexity (L2R scorer)")
  ax.set_xscale("log")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "decoding_modes.png"), dpi=120)
  print(f"wrote {os.path.join(args.out, 'decoding_modes.json')} and decoding_modes.png")


if __name__ == "__main__":
  main()
