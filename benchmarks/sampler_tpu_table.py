"""The cached sampler compiled for one TPU chip, as a table: memory and roofline projection.

  python benchmarks/sampler_tpu_table.py [--models=ao_small,ao_medium] [--topologies=v5e:1,v6e:1]
      [--batches=1,8] [--steps=16,64,256,1024] [--dtypes=float32,bfloat16]

Runs `ao-mdm compile --program=sample` (aot.compile_sampler) for every combination, unconditional
generation of T = 1024 tokens with the linear schedule, and prints one markdown row per compile
(docs/performance.md, "The sampler on TPU"). Needs libtpu (the [tpu] extra); no TPU.
"""

import argparse
import contextlib
import io
import itertools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="ao_small,ao_medium")
  parser.add_argument("--topologies", default="v5e:1,v6e:1")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--steps", default="16,64,256,1024")
  parser.add_argument("--dtypes", default="float32,bfloat16")
  args = parser.parse_args()
  from ao_mdm import specs
  from ao_mdm.paper import paper_config
  from ao_mdm.perf import aot

  split = lambda s: s.split(",")
  print(
    "| model | chip | batch | S | dtype | GiB / chip | bytes read | FLOPs | generation >= "
    "| tokens/s <= | 1 forward >= | generation / forward | compile s |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for name, topology, batch, steps, dtype in itertools.product(
    split(args.models),
    split(args.topologies),
    map(int, split(args.batches)),
    map(int, split(args.steps)),
    split(args.dtypes),
  ):
    with contextlib.redirect_stdout(io.StringIO()):
      r = aot.compile_sampler(
        specs.parse(paper_config(name)), topology, name, batch_size=batch, steps=steps, dtype=dtype
      )
    print(
      f"| {name} | {topology} | {batch} | {steps} | {dtype} | {r['total']:.2f} | "
      f"{r['generation_bytes']:.2e} | {r['generation_flops']:.2e} | "
      f"{r['generation_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | "
      f"{r['forward_s'] * 1e3:.2f} ms | {r['generation_over_forward']:.1f}x | "
      f"{r['compile_seconds']:.0f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
