"""Run by tests/test_eval_cli.py with 8 simulated CPU devices: mesh errors and sharded eval."""

import dataclasses
import json
import os
import sys

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

from ao_mdm import sharding
from ao_mdm.checkpoint import checkpoints
from ao_mdm.eval import perplexity, scoring
from ao_mdm.train import loop


def error_of(fn):
  try:
    fn()
  except ValueError as e:
    return str(e)
  return None


def main(checkpoint: str, blocks_path: str, out: str) -> None:
  config, params = checkpoints.load_params(checkpoint)
  errors = {
    "mesh": error_of(lambda: sharding.make_mesh(dataclasses.replace(config.mesh, ici=(3, 1, 1))))
  }
  bad = config.replace(
    mesh=dataclasses.replace(config.mesh, ici=(8, 1, 1)),
    train=dataclasses.replace(config.train, batch_size=4, microbatches=1),
  )
  errors["batch"] = error_of(lambda: loop.train_and_evaluate(bad, os.path.dirname(out)))
  mesh_cfg = dataclasses.replace(config.mesh, ici=(2, 2, 2))
  scorer = scoring.Scorer(params, config.model, mesh_cfg)
  result = perplexity.evaluate_blocks(
    scorer, np.load(blocks_path), orders=2, ensemble=(2,), batch_size=4, seed=3
  )
  with open(out, "w") as f:
    json.dump({"errors": errors, "result": result}, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
