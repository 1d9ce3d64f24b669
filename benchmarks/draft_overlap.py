"""How well a model predicts a token without the token just before it (docs/sampling.md).

Usage: .venv/bin/python benchmarks/draft_overlap.py --checkpoint RUN [--samples 64] [--ahead 1]

Any exact decoder that emits x_n and x_{n+1} from one forward must have guessed x_n before that
forward, from what the model knows without it. This measures that guess on the model's own L2R
samples (temperature 1): decode left to right with S = T / (ahead + 1) parallel steps, so that
every (ahead + 1)-th position is predicted `ahead` tokens early (q, an any-order phantom), then
score the same sequences with the L2R conditionals p. Prints the mean of sum_x min(p, q) (the
chance that a draft drawn from q is accepted) and the mass p puts on the m most likely tokens
under q (the chance that a tree of m guesses holds the token), and under p itself.
"""

import argparse
from typing import Any

import numpy as np

TOP_M = (1, 4, 8, 16, 32)


def early_predictions(params: Any, cfg: Any, samples: int, ahead: int, seed: int) -> dict:
  """L2R samples and, at the positions predicted `ahead` tokens early: those positions, the
  early predictions q and the L2R conditionals p ([samples, positions, V] float64)."""
  import jax
  import jax.numpy as jnp

  from ao_mdm import model as model_lib
  from ao_mdm.decode import parallel, schedules

  t = cfg.block_size
  steps = t // (ahead + 1)
  out = parallel.sample(
    params, cfg, batch_size=samples, steps=steps, order="l2r", return_logits=True, seed=seed
  )
  # Step i predicts positions counts[i] .. counts[i+1]-1; the one `ahead` after the first is q.
  counts = schedules.schedule_counts(t, 0, steps, "linear")
  pos = np.asarray([n + ahead for n, n_next in zip(counts[:-1], counts[1:]) if n + ahead < n_next])
  order = jnp.broadcast_to(jnp.arange(t), out.tokens.shape)
  logits = model_lib.make_model(cfg).apply({"params": params}, jnp.asarray(out.tokens), order)
  return {
    "tokens": out.tokens,
    "positions": pos,
    "p": np.asarray(jax.nn.softmax(logits[:, pos], -1), np.float64),
    "q": np.asarray(jax.nn.softmax(jnp.asarray(out.logits[:, pos]), -1), np.float64),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="the model to measure")
  parser.add_argument("--samples", type=int, default=64)
  parser.add_argument("--ahead", type=int, default=1, help="tokens skipped before the target")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  from ao_mdm.checkpoint import checkpoints

  config, params = checkpoints.load_params(args.checkpoint, log=lambda _: None)
  t = config.model.block_size
  if not 1 <= args.ahead < t - 1 or args.samples < 1:
    raise SystemExit(f"error: --ahead={args.ahead} must be in [1, {t - 2}] and --samples >= 1")
  got = early_predictions(params, config.model, args.samples, args.ahead, args.seed)
  p, q = got["p"], got["q"]
  by_q, by_p = np.argsort(-q, -1)[..., : max(TOP_M)], np.argsort(-p, -1)[..., : max(TOP_M)]
  print(
    f"{args.checkpoint}: {args.samples} samples x {len(got['positions'])} positions, q "
    f"predicts {args.ahead} token(s) early"
  )
  print(f"sum_x min(p, q) (draft acceptance): {np.minimum(p, q).sum(-1).mean():.3f}")
  for m in TOP_M:
    cover_q = np.take_along_axis(p, by_q[..., :m], -1).sum(-1).mean()
    cover_p = np.take_along_axis(p, by_p[..., :m], -1).sum(-1).mean()
    print(f"p-mass of the top {m:>2} under q: {cover_q:.3f}   under p: {cover_p:.3f}")


if __name__ == "__main__":
  main()
