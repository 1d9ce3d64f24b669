"""What `ao-mdm sample` costs before its first sample: bytes read, peak RSS, seconds.

  python benchmarks/restore_cost.py --checkpoint=RUN [--steps=16]

Loads the EMA params and tokenizer of RUN as `ao-mdm sample` does, then draws one sample, and
prints one JSON line: bytes read by the load (/proc/self/io rchar), the size of the params,
peak RSS, and seconds to loaded and to the first sample. It uses only functions that older
versions of ao_mdm also have, so the same script measures a checkout from before a change.
"""

import argparse
import json
import os
import resource
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _read_bytes() -> int:
  with open("/proc/self/io") as f:
    return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--steps", type=int, default=16)
  args = parser.parse_args()
  import jax

  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.data import tokenizer as tok_lib
  from ao_mdm.decode import generate

  jax.numpy.zeros(1).block_until_ready()  # the backend's start-up is not the restore's
  start, before = time.perf_counter(), _read_bytes()
  config, params = checkpoints.load_params(args.checkpoint, "ema", log=lambda _: None)
  jax.block_until_ready(params)
  loaded, read = time.perf_counter() - start, _read_bytes() - before
  tokenizer = tok_lib.load_saved_tokenizer(config.data, config.model.vocab_size, args.checkpoint)
  next(
    generate.sample_texts(
      params, config.model, tokenizer, num_samples=1, batch_size=1, steps=args.steps
    )
  )
  print(
    json.dumps(
      {
        "checkpoint": args.checkpoint,
        "layout": "split"
        if any(
          os.path.isdir(os.path.join(args.checkpoint, "checkpoints", s, "ema"))
          for s in os.listdir(os.path.join(args.checkpoint, "checkpoints"))
        )
        else "state only",
        "params_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
        "bytes_read_by_load": read,
        "load_s": round(loaded, 2),
        "first_sample_s": round(time.perf_counter() - start, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
      }
    )
  )


if __name__ == "__main__":
  main()
