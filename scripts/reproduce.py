"""Small-scale reproduction (docs/reproducing.md): train the four repro runs, evaluate, sample.

Usage: .venv/bin/python scripts/reproduce.py --out runs/repro [--skip_train]
Writes docs/results/repro.json, docs/results/curves.png, docs/results/quality_speed.png and
prints the tables. Every command it runs is an `ao-mdm` command, printed before it runs.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("ar", "random", "mixed", "sigma")
SETTINGS = ((1.0, 1.0), (0.95, 0.9), (0.95, 0.7))  # (top_p, temperature), paper Table 2
STEPS = (16, 64, 128)  # S; 128 = T for this model size


def ao_mdm(*args: str) -> str:
  cmd = [os.path.join(os.path.dirname(sys.executable), "ao-mdm"), *args]
  print("$", " ".join(cmd), flush=True)
  out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
  return out


def last_json(text: str) -> dict:
  return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="runs/repro")
  parser.add_argument("--skip_train", action="store_true")
  parser.add_argument("--eval_blocks", type=int, default=16)
  parser.add_argument("--samples", type=int, default=16)
  args = parser.parse_args()
  results = {"runs": {}, "quality_speed": []}
  for run in RUNS:
    workdir = os.path.join(args.out, run)
    start = time.perf_counter()
    if not args.skip_train:
      ao_mdm("train", f"--config=configs/repro.py:{run}", f"--workdir={workdir}")
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    ev = last_json(ao_mdm("eval", f"--checkpoint={workdir}", "--datasets=sotu", "--protocol=custom", "--orders=4",
                          "--ensemble=4,16", f"--max_blocks={args.eval_blocks}"))["sotu"]
    ev["eval_wall_s"] = time.perf_counter() - start
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      curve = [json.loads(line) for line in f]
    results["runs"][run] = {"eval": ev, "train_wall_s": train_s,
                            "curve": [r for r in curve if "eval/l2r_loss" in r]}
  scorer = os.path.join(args.out, "ar")
  for top_p, temperature in SETTINGS:
    for steps in STEPS:
      path = os.path.join(args.out, f"samples_p{top_p}_t{temperature}_s{steps}.jsonl")
      start = time.perf_counter()
      ao_mdm("sample", f"--checkpoint={os.path.join(args.out, 'mixed')}", f"--steps={steps}",
             f"--top_p={top_p}", f"--temperature={temperature}", f"--num_samples={args.samples}",
             f"--batch_size={args.samples}", f"--out={path}")
      wall = time.perf_counter() - start
      gen = last_json(ao_mdm("eval", f"--generated={path}", f"--scorer={scorer}"))
      results["quality_speed"].append({"top_p": top_p, "temperature": temperature,
                                       "steps": steps, "sample_command_wall_s": wall, **gen})
  os.makedirs(os.path.join(ROOT, "docs/results"), exist_ok=True)
  with open(os.path.join(ROOT, "docs/results/repro.json"), "w") as f:
    json.dump(results, f, indent=1)
  plot(results)
  print_tables(results)


def plot(results: dict) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for run, r in results["runs"].items():
    steps = [c["step"] for c in r["curve"]]
    axes[0].plot(steps, [c["eval/l2r_loss"] for c in r["curve"]], label=run)
    axes[1].plot(steps, [c["eval/any_order_loss"] for c in r["curve"]], label=run)
  for ax, title in zip(axes, ("validation L2R loss (EMA)", "validation any-order loss (EMA)")):
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.legend()
  axes[0].set_ylabel("nats / token")
  fig.tight_layout()
  fig.savefig(os.path.join(ROOT, "docs/results/curves.png"), dpi=100)
  fig, ax = plt.subplots(figsize=(5, 4))
  for top_p, temperature in SETTINGS:
    rows = [q for q in results["quality_speed"]
            if (q["top_p"], q["temperature"]) == (top_p, temperature)]
    ax.plot([q["steps"] for q in rows], [q["gen_ppl"] for q in rows], marker="o",
            label=f"top_p={top_p}, T={temperature}")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("decoding steps S")
  ax.set_ylabel("generative perplexity (scored by the AR model)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(ROOT, "docs/results/quality_speed.png"), dpi=100)


def print_tables(results: dict) -> None:
  print("| run | L2R ppl | any-order ppl (+-SE) | ensemble M=4 | ensemble M=16 | train s | eval s |")
  print("|---|---|---|---|---|---|---|")
  for run, r in results["runs"].items():
    e = r["eval"]
    print(f"| {run} | {e['l2r_ppl']:.2f} | {e['any_order_ppl']:.2f} +- {e['any_order_se']:.2f} | "
          f"{e['ensemble_ppl']['4']:.2f} | {e['ensemble_ppl']['16']:.2f} | "
          f"{r['train_wall_s']:.0f} | {e['eval_wall_s']:.0f} |")
  print("\n| top_p | temperature | S | gen ppl | unigram entropy | sample wall s |")
  print("|---|---|---|---|---|---|")
  for q in results["quality_speed"]:
    print(f"| {q['top_p']} | {q['temperature']} | {q['steps']} | {q['gen_ppl']:.1f} | "
          f"{q['unigram_entropy']:.2f} | {q['sample_command_wall_s']:.1f} |")


if __name__ == "__main__":
  main()
