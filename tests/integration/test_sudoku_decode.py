"""A Sudoku grid with [MASK] cells, filled by the margin policy and ranked by exact log-probability
(best_of) through `ao-mdm sample` and through `ao-mdm serve` with the `openai` client: the grids
of the static driver, and the draw that a naive forward per grid scores highest."""

import json

import flax.linen as nn
import jax
import numpy as np
import openai
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.config import base_config
from ao_mdm.data import sudoku
from ao_mdm.decode import policies
from ao_mdm.eval import scoring
from helpers import Server, ao_mdm

QUIZ = sudoku.puzzles([0], 0)[0][0]
GRID = "".join(str(d) if d else "[MASK]" for d in QUIZ)
KNOWN = np.flatnonzero(QUIZ)


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
  """An export of a tiny random AO-GPT on Sudoku grids, its logits x3 (decisive draws) and EOS
  never likely: (path, spec, params)."""
  c = base_config()
  c.data.update(dataset="sudoku", tokenizer="sudoku")
  c.model.update(vocab_size=16, block_size=81, n_layer=1, n_embd=32, n_head=2, cond_dim=32)
  config = specs.parse(c)
  params = nn.unbox(model_lib.init_params(config.model, jax.random.key(4)))
  params = jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, params)
  params["head"]["bias"] = params["head"]["bias"].at[0].set(-30.0)
  out = str(tmp_path_factory.mktemp("grid") / "export")
  return checkpoints.write_params_export(out, config.to_dict(), params), config, params


def margin(run, seed: int, temperature: float) -> np.ndarray:
  """[81] the grid the static driver's margin policy fills, alone."""
  _, config, params = run
  return policies.get("margin").sample(
    params, config.model, batch_size=1, seed=seed, known_positions=KNOWN.tolist(),
    known_tokens=QUIZ[KNOWN].tolist(), steps=81 - len(KNOWN), temperature=temperature,
    vocab_limit=10,
  ).tokens[0]  # fmt: skip


def exact(run, grid: np.ndarray) -> float:
  """log p(the empty cells' digits | the givens): a forward with the givens first, then the
  empty cells left to right, summed over the empty cells' slots."""
  _, config, params = run
  order = np.concatenate([KNOWN, np.flatnonzero(QUIZ == 0)])
  nll = scoring.Scorer(params, config.model).slot_nll(grid[None].astype(np.int32), order[None])
  return -float(nll[0, len(KNOWN) :].sum())


@pytest.mark.slow  # a sampling process and six static decodes (about 40 s)
def test_sample_fills_a_grid_by_margin_and_keeps_the_most_likely_draw(grid_run, tmp_path):
  """--best_of=3 --seed=5, one sample: draws j = 0, 1, 2 are seeds 5 + j alone; the sample is
  the one a naive forward scores highest, and its record holds that log-prob."""
  out = tmp_path / "s.jsonl"
  run = ao_mdm(
    "sample", f"--checkpoint={grid_run[0]}", f"--infill={GRID}", "--infill_span=1",
    "--mode=margin", "--temperature=1", "--num_samples=1", "--best_of=3", "--seed=5",
    f"--out={out}",
  )  # fmt: skip
  assert run.returncode == 0, run.stderr[-3000:]
  record = json.loads(out.read_text())
  draws = [margin(grid_run, 5 + j, 1.0) for j in range(3)]
  assert len({d.tobytes() for d in draws}) > 1  # the ranking has a choice to make
  scores = [exact(grid_run, d) for d in draws]
  best = int(np.argmax(scores))
  assert record["tokens"] == draws[best].tolist() and record["best_of"] == 3
  np.testing.assert_allclose(record["logprob"], scores[best], rtol=1e-5)
  assert "best of 3" in run.stdout


@pytest.mark.slow  # a server of its own (about 40 s)
def test_serve_fills_a_grid_by_margin_and_ranks_draws_through_the_openai_client(grid_run):
  """A prompt with [MASK] cells (infill_span=1): greedy, the static driver's grid from the
  first [MASK] on; best_of=3 the draw a naive forward scores highest among seeds s, s+1, s+2;
  what does not apply to an infill is a 400."""
  server = Server(grid_run[0], "--policies=margin", "--max_batch=2")
  try:
    ask = lambda **kw: server.complete(prompt=GRID, extra_body={"infill_span": 1}, **kw)
    first = int(np.flatnonzero(QUIZ == 0)[0])
    digits = lambda grid: "".join(map(str, grid[first:]))
    greedy = ask(temperature=0).choices[0]
    assert greedy.text == digits(margin(grid_run, 0, 0.0)) and greedy.finish_reason == "length"
    prefix = "".join(map(str, QUIZ[:first]))
    assert ask(temperature=0, echo=True).choices[0].text == prefix + greedy.text
    texts = [ask(temperature=1, seed=9 + c).choices[0].text for c in range(3)]
    grids = [np.concatenate([QUIZ[:first], [int(x) for x in t]]) for t in texts]
    assert len(set(texts)) > 1 and all((g[KNOWN] == QUIZ[KNOWN]).all() for g in grids)
    best = int(np.argmax([exact(grid_run, g) for g in grids]))
    assert ask(temperature=1, seed=9, best_of=3).choices[0].text == texts[best]
    for kwargs, param in [(dict(max_tokens=4), "max_tokens"), (dict(stream=True), "stream")]:
      with pytest.raises(openai.BadRequestError) as e:
        ask(**kwargs)
      assert e.value.body["param"] == param, e.value.body
  finally:
    code, _, err = server.stop()
  assert code == 0 and "Traceback" not in err, err
