"""Writes a synthetic corpus of about N GPT-2 tokens: the embedded corpus's sentences in a
seeded shuffle, joined into documents (one per line) of OpenWebText-like length.

Usage: python scripts/make_synthetic_corpus.py --tokens 20000000 --out synthetic_20M.txt [--seed 0]
`ao-mdm bench data` makes its corpora the same way (ao_mdm/data/bench_data.py).
"""

import argparse

from ao_mdm.perf import bench_data


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, required=True, help="about this many GPT-2 tokens")
  p.add_argument("--out", required=True, help="the text file to write (one document per line)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  docs = bench_data.write_synthetic_corpus(args.out, args.tokens, args.seed)
  print(f"wrote {docs:,} documents to {args.out}")


if __name__ == "__main__":
  main()
