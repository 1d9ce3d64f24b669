"""`ao-mdm bench plan --config=configs/bench_plan.py --checkpoint=RUN [--puzzles=FILE.csv]`: does
choosing the order pay? Sudoku puzzles (generated held-out ones, or a CSV in the public form)
solved by one model under every decoding policy: in reading order with the givens in place (as
a left-to-right model meets them), and, one cell a forward, givens first then left to right, a
random order, the most confident cell first, the largest top-1 minus top-2 margin first (Kim et
al. 2025), greedy and sampled; and likelihood-ranked sampling, n margin draws of which the one with
the highest exact log-probability is kept (an any-order model scores any finished grid exactly:
one forward in a fixed order). Prints each policy's solve rate with its standard error, the share
of empty cells given the solution's digit, forwards and seconds per puzzle, optionally left to
right on a baseline run (bench.baseline) and the runs' training curves (bench.plot, an SVG); one
JSON line last."""

from collections.abc import Callable
import json
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import model as model_lib
from ao_mdm.checkpoint import checkpoints, layout
from ao_mdm.data import sudoku
from ao_mdm.decode import batching, common, driver
from ao_mdm.perf import svg
from ao_mdm.storage import fs

# Label -> (policy, its options): every policy the table compares, one cell a forward.
POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
  "l2r": ("parallel", {"order": "l2r"}),
  "random": ("parallel", {"order": "random"}),
  "confidence": ("confidence", {}),
  "margin": ("margin", {}),
}


class Solved:
  """One policy's outcome: solve rate and its standard error, the share of empty cells given
  the unique solution's digit, forwards and seconds per puzzle."""

  def __init__(self, grids: np.ndarray, quiz: np.ndarray, solution: np.ndarray, forwards, seconds):
    solved_N = sudoku.solves(grids, quiz)
    self.rate = float(solved_N.mean())
    self.stderr = math.sqrt(self.rate * (1 - self.rate) / len(solved_N))
    empty = quiz == 0
    self.cells = float((grids == solution)[empty].mean())
    self.forwards, self.seconds = float(forwards), float(seconds)

  def line(self, label: str) -> str:
    return (
      f"  {label:<22} solved {self.rate:6.1%} +- {self.stderr:.1%}  cells {self.cells:6.1%}  "
      f"{self.forwards:5.1f} forwards, {1e3 * self.seconds:6.1f} ms a puzzle"
    )


def requests(quiz_N81: np.ndarray, seed: int, temperature: float) -> list:
  """One request per puzzle: its givens known, every empty cell drawn one per step."""
  out = []
  for i, quiz in enumerate(quiz_N81):
    given = np.flatnonzero(quiz)
    out.append(
      batching.Request(
        tuple(given.tolist()),
        tuple(int(quiz[p]) for p in given),
        steps=sudoku.CELLS - len(given),
        seed=seed + i,
        temperature=temperature,
      )
    )
  return out


def _decode(
  batcher: batching.Batcher, quiz_N81: np.ndarray, seed: int, temperature: float, warm: bool
):
  """(grids [N, 81], forwards per puzzle, seconds per puzzle) of the batcher's policy; unless
  `warm`, timed after the same decode untimed (rows joining as others finish compile inserts of
  many sizes)."""
  if not warm:
    driver.decode_all(batcher, requests(quiz_N81, seed, temperature))
  start = time.perf_counter()
  done = driver.decode_all(batcher, requests(quiz_N81, seed, temperature))
  seconds = (time.perf_counter() - start) / len(quiz_N81)
  grids = np.stack([f.tokens[: sudoku.CELLS] for f in done])
  return grids, float(np.mean([f.forwards for f in done])), seconds


def reading_order(params: Any, cfg: Any, quiz_N81: np.ndarray, vocab_limit: int) -> tuple:
  """(grids, forwards, seconds) a puzzle of greedy decoding in reading order with each given in
  place as it comes: how a left-to-right model meets a puzzle (no given ahead of a cell is seen);
  a full forward per cell (81, no cache: the model is small)."""
  model = model_lib.make_model(cfg)
  quiz = jnp.asarray(quiz_N81, jnp.int32)
  order = jnp.broadcast_to(jnp.arange(sudoku.CELLS, dtype=jnp.int32), quiz.shape)

  @jax.jit
  def fill(grids, i):  # slot i predicts cell i from cells 0..i-1
    logits = model.apply({"params": params}, grids, order)[:, i, :vocab_limit]
    drawn = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return grids.at[:, i].set(jnp.where(quiz[:, i] > 0, quiz[:, i], drawn))

  fill(quiz, 0)  # its compile, untimed
  start, grids = time.perf_counter(), quiz
  for i in range(sudoku.CELLS):
    grids = fill(grids, i)
  seconds = (time.perf_counter() - start) / len(quiz_N81)
  return np.asarray(grids), float(sudoku.CELLS), seconds


def _score_run(
  run: str,
  bench: Any,
  quiz: np.ndarray,
  solution: np.ndarray,
  labels: tuple,
  ranked: tuple,
  log: Callable,
) -> dict:
  """Every policy of `labels` greedy and sampled, and likelihood-ranked margin draws for each n
  of `ranked`, on the run's EMA params."""
  config, params, tokenizer = checkpoints.load_run(run, "ema", log=lambda _: None)
  sudoku.check_run(config)
  cfg = config.model
  vocab_limit = min(tokenizer.vocab_size, cfg.vocab_size)
  batcher = lambda label: batching.Batcher.continuing(
    params, cfg, batch=bench.batch, policy=POLICIES[label][0], tokens_per_step=1,
    vocab_limit=vocab_limit, **POLICIES[label][1],
  )  # fmt: skip
  out: dict[str, Solved] = {}
  grids, forwards, seconds = reading_order(params, cfg, quiz, vocab_limit)
  out["reading order greedy"] = Solved(grids, quiz, solution, forwards, seconds)
  log(out["reading order greedy"].line("reading order greedy"))
  decoders = {label: batcher(label) for label in {*labels, *(("margin",) if ranked else ())}}
  for label in labels:
    for temperature, kind in ((0.0, "greedy"), (bench.temperature, "sampled")):
      grids, forwards, seconds = _decode(
        decoders[label], quiz, bench.seed, temperature, warm=kind == "sampled"
      )
      out[f"{label} {kind}"] = Solved(grids, quiz, solution, forwards, seconds)
      log(out[f"{label} {kind}"].line(f"{label} {kind}"))
  if ranked:
    draws, logp, seconds, forwards = [], [], 0.0, 0.0
    for j in range(max(ranked)):  # draw j of puzzle i: seed `seed + (j + 1) N + i`
      seed = bench.seed + (j + 1) * len(quiz)
      grids, f, s = _decode(
        decoders["margin"], quiz, seed, bench.temperature, warm="margin" in labels or j > 0
      )
      start = time.perf_counter()
      logp.append(common.drawn_logprob(params, cfg, grids, quiz != 0, quiz == 0))
      draws.append(grids)
      seconds += s + (time.perf_counter() - start) / len(quiz)
      forwards += f + 1  # and its scoring forward
      if j + 1 in ranked:
        chosen = np.stack(draws)[np.argmax(np.stack(logp), axis=0), np.arange(len(quiz))]
        name = f"margin ranked, n={j + 1}"
        out[name] = Solved(chosen, quiz, solution, forwards, seconds)
        any_of = np.any([sudoku.solves(g, quiz) for g in draws], axis=0).mean()
        log(f"{out[name].line(name)}   (any of the {j + 1} solves: {any_of:.1%})")
  return {k: vars(v) for k, v in out.items()}


def _loss_curve(run: str) -> list[tuple[float, float]]:
  """(step, training loss) of each logged step of a training work dir ([] for an export)."""
  path = fs.join(run, layout.METRICS)
  if not fs.exists(path):
    return []
  rows = [json.loads(x) for x in fs.read_text(path).splitlines()]
  return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def bench_plan(bench: Any, checkpoint: str, puzzles_csv: str | None, log=print) -> dict:
  """The table of docs/reproducing.md's "Planning the order"; one JSON line last."""
  if puzzles_csv:
    quiz, solution = sudoku.read_csv(puzzles_csv)
    source = puzzles_csv
  else:
    quiz, solution = sudoku.puzzles(
      range(bench.puzzles), bench.seed, "heldout", tuple(bench.givens)
    )
    source = f"{bench.puzzles} held-out puzzles, {bench.givens[0]}-{bench.givens[1]} givens"
  log(f"{len(quiz)} puzzles ({source}); {checkpoint}:")
  result: dict = {"puzzles": len(quiz), "source": source}
  result["policies"] = _score_run(
    checkpoint, bench, quiz, solution, tuple(bench.policies), tuple(bench.ranked), log
  )
  if bench.baseline:
    log(f"baseline {bench.baseline}:")
    result["baseline"] = _score_run(bench.baseline, bench, quiz, solution, ("l2r",), (), log)
  if bench.plot:
    curves = {run: _loss_curve(run) for run in (checkpoint, bench.baseline) if run}
    fs.write_text(bench.plot, svg.line_plot(curves, "training step", "training loss"))
    log(f"training curves plotted to {bench.plot}")
  result["solve_rate"] = {k: v["rate"] for k, v in result["policies"].items()}
  log(json.dumps(result))
  return result
