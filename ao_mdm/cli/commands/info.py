"""`ao-mdm info`: the parameter count and training FLOPs per token of a config's model."""

from typing import Any

from absl import flags

from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib

SUMMARY = (
  "parameter count, training FLOPs per token (6N plus attention) and clu's parameter "
  "table of a config: --config=..."
)


def define(fv: flags.FlagValues) -> None:
  flags_lib.config(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "config")


def run(v: dict, given: set) -> None:
  del given
  print(describe(v["config"].model))


def describe(cfg: Any) -> str:
  """The model's shape, parameter count, training FLOPs per token and the table of its
  parameters."""
  import flax.linen as nn
  import jax

  from ao_mdm import model, sharding

  shapes = nn.unbox(jax.eval_shape(lambda k: model.init_params(cfg, k), jax.random.key(0)))
  n = model.count_params(shapes)
  fpt = model.flops_per_token(cfg, n)
  return (
    f"variant={cfg.variant} L={cfg.n_layer} D={cfg.n_embd} H={cfg.n_head} "
    f"T={cfg.block_size} V={cfg.vocab_size}\nparameters: {n:,}\n"
    f"training FLOPs per token: {fpt:,.0f} ({fpt / 1e9:.3f} GFLOP)\n"
    f"{sharding.parameter_table(shapes)}"
  )
