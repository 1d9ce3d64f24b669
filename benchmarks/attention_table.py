"""Per-chip memory and the roofline step of the paper's train step compiled ahead of time for TPU
topologies with XLA and with splash attention, and with splash at fewer micro-batches: the table
of docs/performance.md ("Splash attention"). Needs libtpu (the [tpu] extra), no TPU.

  python benchmarks/attention_table.py [--names=ao_small,ao_medium] [--topologies=v5e:4x4,v6e:4x4]
"""

import argparse
import contextlib
import io
import os


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--names", default="ao_small,ao_medium")
  parser.add_argument("--topologies", default="v5e:4x4,v6e:4x4")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from ao_mdm import paper, specs
  from ao_mdm.perf import aot

  print(
    "| config | topology | attention | micro-batches | GiB per chip (of HBM) | temps GiB | "
    "step >= ms | HBM upper estimate ms |"
  )
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for name in args.names.split(","):
    base = paper.paper_config(name)
    m = base.train.microbatches
    for topology in args.topologies.split(","):
      for attention, micro in (("xla", m), ("splash", m), ("splash", m // 2), ("splash", m // 4)):
        c = base.copy_and_resolve_references()
        c.model.attention, c.train.microbatches = attention, micro
        try:
          with contextlib.redirect_stdout(io.StringIO()):
            r = aot.compile_for_topology(specs.parse(c), topology, name=name, log=lambda _: None)
          p = r["projection"]
          print(
            f"| {name} | {topology} | {r['attention']} | {micro} | {r['total']:.2f} "
            f"({r['hbm_gib']:.0f}) | {r['temps']:.2f} | {p['step_s_lower_bound'] * 1e3:.0f} | "
            f"{p['hbm_s_at_upper_estimate'] * 1e3:.0f} |",
            flush=True,
          )
        except ValueError as e:
          print(
            f"| {name} | {topology} | {attention} | {micro} | does not fit: "
            f"{str(e).split(': ', 1)[-1][:60]} | | | |",
            flush=True,
          )


if __name__ == "__main__":
  main()
