"""Small-scale reproduction of the paper's findings on a CPU (docs/reproducing.md).

Usage: .venv/bin/python benchmarks/reproduce.py [--out runs/repro] [--seeds 0,1]

Trains configs/repro.py's runs (ar, random, mixed, sigma) for each seed, evaluates them on the
same validation sequences with the same orders (so differences are paired), and writes one JSON
per finished run or evaluation under docs/results/repro/: a finished one is never redone, so
the script resumes where it stopped (commit those files: a later session may start on a fresh
machine). Then it prints the findings table, the ensemble table and the Table 2-shaped table,
and draws docs/results/repro_curves.png and docs/results/repro_quality.png.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results", "repro")
FIGURES = os.path.join(ROOT, "docs", "results")
RUNS = ("ar", "random", "mixed", "sigma")
EVAL_BLOCKS = 64  # validation blocks for the paired comparisons
ORDERS = 4  # random orders per block for the any-order perplexity
ENSEMBLE = (1, 4, 16, 64)  # context-order ensemble sizes M (paper eq. 7)
ENSEMBLE_BLOCKS = 8
TEMPERATURES = (1.0, 0.9, 0.7)  # Table 2 shape: generative perplexity vs S and temperature
SAMPLES = 16


def cached(name: str, compute) -> dict:
  """The result stored as docs/results/repro/<name>.json, computed and written once."""
  path = os.path.join(RESULTS, f"{name}.json")
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  start = time.perf_counter()
  result = compute()
  result["wall_s"] = time.perf_counter() - start
  os.makedirs(RESULTS, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
  os.replace(path + ".tmp", path)
  print(f"wrote {os.path.relpath(path, ROOT)} ({result['wall_s']:.0f} s)", flush=True)
  return result


SMOKE = (
  "--config.train.num_steps=4",
  "--config.train.eval_every=2",
  "--config.train.log_every=2",
  "--config.model.block_size=32",
  "--config.model.vocab_size=384",
  "--config.train.batch_size=8",
  "--config.train.eval_batches=1",
)  # --smoke: the plumbing


def train(run: str, seed: int, workdir: str, extra: tuple = ()) -> dict:
  cmd = [
    os.path.join(os.path.dirname(sys.executable), "ao-mdm"),
    "train",
    f"--config=configs/repro.py:{run}",
    f"--workdir={workdir}",
    f"--config.seed={seed}",
    *extra,
  ]
  print("$", " ".join(cmd), flush=True)
  subprocess.run(cmd, check=True, cwd=ROOT)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    curve = [json.loads(line) for line in f]
  return {"run": run, "seed": seed, "curve": [r for r in curve if "eval/l2r_loss" in r]}


def load(workdir: str) -> tuple:
  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.data import pipeline, prepare, tokenizer
  from ao_mdm.eval import scoring

  config, params = checkpoints.load_params(workdir)
  tok = tokenizer.load_saved_tokenizer(config.data, config.model.vocab_size, workdir)
  blocks = pipeline.eval_blocks(
    prepare.ensure(config.data, tok, "validation"), config.model.block_size, max_blocks=EVAL_BLOCKS
  )
  return config, scoring.Scorer(params, config.model), tok, blocks


def evaluate(workdir: str) -> dict:
  """L2R and any-order NLL per validation sequence (seeded orders: paired across runs)."""
  from ao_mdm.eval import perplexity

  _, scorer, _, blocks = load(workdir)
  r = perplexity.evaluate_blocks(
    scorer, blocks, orders=ORDERS, batch_size=16, seed=0, per_sequence=True
  )
  counts = perplexity.load_unigram_counts(workdir)
  r["unigram_ppl"] = math.exp(perplexity.unigram_nll(counts, blocks))
  return r


def ensemble(workdir: str) -> dict:
  from ao_mdm.eval import perplexity

  _, scorer, _, blocks = load(workdir)
  r = perplexity.evaluate_blocks(
    scorer, blocks[:ENSEMBLE_BLOCKS], orders=1, batch_size=4, seed=0, ensemble=ENSEMBLE
  )
  return {
    "ensemble_ppl": r["ensemble_ppl"],
    "any_order_ppl": r["any_order_ppl"],
    "cost": r["ensemble_cost_full_forwards_per_target"],
    "blocks": ENSEMBLE_BLOCKS,
  }


def quality(sampler_dir: str, scorer_dir: str) -> dict:
  """Generative perplexity (scored by the L2R run) and unigram entropy vs S and temperature."""
  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.decode import generate
  from ao_mdm.eval import perplexity

  config, _, tok, _ = load(sampler_dir)
  _, params = checkpoints.load_params(sampler_dir)
  _, scorer, _, _ = load(scorer_dir)
  t = config.model.block_size
  rows = []
  for temperature in TEMPERATURES:
    for steps in (t // 16, t // 4, t):
      start = time.perf_counter()
      records = list(
        generate.sample_texts(
          params,
          config.model,
          tok,
          num_samples=SAMPLES,
          batch_size=SAMPLES,
          steps=steps,
          temperature=temperature,
        )
      )
      wall = time.perf_counter() - start
      gen = perplexity.generative_perplexity(scorer, [r["tokens"] for r in records])
      rows.append({"steps": steps, "temperature": temperature, "sample_wall_s": wall, **gen})
      print(
        f"S={steps} temperature={temperature}: gen ppl {gen['gen_ppl']:.1f}, entropy "
        f"{gen['unigram_entropy']:.2f}",
        flush=True,
      )
  return {"rows": rows}


def paired(x: list, y: list) -> dict:
  """Mean of x - y over sequences (nats) with its standard error; exp(mean) is a ppl ratio."""
  d = np.asarray(x) - np.asarray(y)
  se = float(d.std(ddof=1) / math.sqrt(len(d)))
  return {
    "diff_nll": float(d.mean()),
    "se": se,
    "ppl_ratio": math.exp(d.mean()),
    "sigmas": float(d.mean() / se) if se > 0 else float("inf"),
  }


def findings(runs: dict) -> list:
  """The paper's findings (a)-(c) as paired differences; a finding holds beyond 2 SE."""
  out = []
  for seed in sorted({r["seed"] for r in runs.values()}):
    ev = {name.split("_s")[0]: r["eval"] for name, r in runs.items() if r["seed"] == seed}
    if not all(k in ev for k in RUNS):
      continue
    a = paired(ev["random"]["any_order_nll_seq"], ev["ar"]["l2r_nll_seq"])
    out.append(
      {
        "seed": seed,
        "finding": "(a) any-order (random run) is worse than L2R (ar run) at the same budget",
        **a,
        "holds": a["sigmas"] > 2,
      }
    )
    b1 = paired(ev["random"]["l2r_nll_seq"], ev["mixed"]["l2r_nll_seq"])
    b2 = paired(ev["mixed"]["any_order_nll_seq"], ev["random"]["any_order_nll_seq"])
    out.append(
      {
        "seed": seed,
        "finding": "(b) mixed(0.9) L2R ppl <= 0.8x pure any-order's",
        **b1,
        "holds": b1["sigmas"] > 2 and 1 / b1["ppl_ratio"] <= 0.8,
      }
    )
    out.append(
      {
        "seed": seed,
        "finding": "(b') mixed(0.9) any-order ppl <= 1.1x pure any-order's",
        **b2,
        "holds": b2["ppl_ratio"] <= 1.1,
      }
    )
    c = paired(ev["sigma"]["any_order_nll_seq"], ev["mixed"]["any_order_nll_seq"])
    out.append(
      {
        "seed": seed,
        "finding": "(c) AO-GPT beats sigma-GPT on any-order ppl",
        **c,
        "holds": c["sigmas"] > 2,
      }
    )
  return out


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="runs/repro", help="work dirs of the runs")
  parser.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1")
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="a few steps of a tiny model, results "
    "under OUT/results instead of docs/results (checks the script only)",
  )
  args = parser.parse_args()
  global RESULTS, EVAL_BLOCKS, ENSEMBLE, SAMPLES, FIGURES
  extra = ()
  if args.smoke:
    RESULTS = FIGURES = os.path.join(os.path.abspath(args.out), "results")
    EVAL_BLOCKS, ENSEMBLE, SAMPLES, extra = 4, (1, 2), 2, SMOKE
  seeds = [int(s) for s in args.seeds.split(",")]
  start = time.perf_counter()
  runs = {}
  for seed in seeds:
    for run in RUNS:
      name = f"{run}_s{seed}"
      workdir = os.path.join(args.out, name)
      trained = cached(f"{name}_train", lambda: train(run, seed, workdir, extra))
      ev = cached(f"{name}_eval", lambda: evaluate(workdir))
      runs[name] = {**trained, "eval": ev}
  first = seeds[0]
  ens = cached(
    f"mixed_s{first}_ensemble", lambda: ensemble(os.path.join(args.out, f"mixed_s{first}"))
  )
  table2 = cached(
    f"mixed_s{first}_quality",
    lambda: quality(
      os.path.join(args.out, f"mixed_s{first}"), os.path.join(args.out, f"ar_s{first}")
    ),
  )
  found = findings(runs)
  with open(os.path.join(RESULTS, "findings.json"), "w") as f:
    json.dump(found, f, indent=1)
  plot(runs, table2)
  print_tables(runs, found, ens, table2)
  print(f"reproduce.py: {time.perf_counter() - start:.0f} s this invocation")


def plot(runs: dict, table2: dict) -> None:
  try:
    import matplotlib
  except ImportError:
    print("matplotlib is not installed (pip install -e '.[repro]'): no plots")
    return
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for name, r in runs.items():
    steps = [c["step"] for c in r["curve"]]
    axes[0].plot(steps, [c["eval/l2r_loss"] for c in r["curve"]], label=name)
    axes[1].plot(steps, [c["eval/any_order_loss"] for c in r["curve"]], label=name)
  for ax, title in zip(axes, ("validation L2R loss (EMA)", "validation any-order loss (EMA)")):
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.legend()
  axes[0].set_ylabel("nats / token")
  fig.tight_layout()
  fig.savefig(os.path.join(FIGURES, "repro_curves.png"), dpi=100)
  fig, ax = plt.subplots(figsize=(5, 4))
  for temperature in TEMPERATURES:
    rows = [q for q in table2["rows"] if q["temperature"] == temperature]
    ax.plot(
      [q["steps"] for q in rows],
      [q["gen_ppl"] for q in rows],
      marker="o",
      label=f"temperature {temperature}",
    )
  ax.set_xscale("log", base=2)
  ax.set_xlabel("decoding steps S")
  ax.set_ylabel("generative perplexity (scored by the L2R run)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(FIGURES, "repro_quality.png"), dpi=100)


def print_tables(runs: dict, found: list, ens: dict, table2: dict) -> None:
  print("\n| run | L2R ppl | any-order ppl (+-SE) | unigram ppl | any-order / unigram | train s |")
  print("|---|---|---|---|---|---|")
  for name, r in runs.items():
    e = r["eval"]
    print(
      f"| {name} | {e['l2r_ppl']:.2f} | {e['any_order_ppl']:.2f} +- {e['any_order_se']:.2f} | "
      f"{e['unigram_ppl']:.2f} | {e['any_order_ppl'] / e['unigram_ppl']:.2f} | "
      f"{r['wall_s']:.0f} |"
    )
  print("\n| seed | finding | ppl ratio | diff (nats) +- SE | sigmas | holds |")
  print("|---|---|---|---|---|---|")
  for f in found:
    print(
      f"| {f['seed']} | {f['finding']} | {f['ppl_ratio']:.3f} | {f['diff_nll']:.4f} +- "
      f"{f['se']:.4f} | {f['sigmas']:.1f} | {'yes' if f['holds'] else 'no'} |"
    )
  print(
    f"\n| M | ensemble any-order ppl ({ens['blocks']} blocks) | cost (full forwards per target) |"
  )
  print("|---|---|---|")
  for m in ENSEMBLE:
    print(f"| {m} | {ens['ensemble_ppl'][str(m)]:.2f} | {ens['cost'][str(m)]:.2f} |")
  print("\n| S | temperature | gen ppl | unigram entropy | sample wall s |")
  print("|---|---|---|---|---|")
  for q in table2["rows"]:
    print(
      f"| {q['steps']} | {q['temperature']} | {q['gen_ppl']:.1f} | "
      f"{q['unigram_entropy']:.2f} | {q['sample_wall_s']:.1f} |"
    )


if __name__ == "__main__":
  main()
