"""`ao-mdm bench posttrain --config=configs/bench_posttrain.py --checkpoint=DIR`: fine-tuning
then GRPO on each of the config's tasks (bench.tasks), from a trained model, in one run
(docs/posttraining.md).

Prints per task the exact match on the validation pairs (greedy, and of draws at GRPO's
temperature) of the model, after fine-tuning and after GRPO; GRPO's sampled reward per window of
steps (its curve; bench.plot: an SVG of every task's); GRPO's step time split into rollout, reward
function, scoring and update, and its rollout tokens/s against `parallel.sample` drawing as many
answers to one prompt (and against GRPO's continuous batch drawing those: the engine's own cost;
both timed before and after the GRPO run);
and how far d1's mean-field estimate of an answer's log-probability (each token given the prompt
alone) lies from the exact one. One JSON line last.
"""

from collections.abc import Callable
import json
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints, layout
from ao_mdm.data import pairs
from ao_mdm.decode import policies
from ao_mdm.eval import responses
from ao_mdm.perf import svg
from ao_mdm.storage import fs


def _accuracy(
  run: str, items: list, samples: int, temperature: float, say: Callable[[str], None], what: str
) -> tuple:
  """({greedy, sampled} exact match of the run's EMA params on `items`, config, params,
  tokenizer); sampled: `samples` draws per pair at GRPO's temperature, its own policy."""
  config, params, tokenizer = checkpoints.load_run(run, "ema", log=lambda _: None)
  match = lambda **kw: responses.exact_match(
    params, config.model, tokenizer, items, batch=32, **kw
  )[0]
  accuracy = {
    "greedy": match(),
    "sampled": match(temperature=temperature, samples=samples),
  }
  say(
    f"{what}: exact match on {len(items)} validation pairs: greedy {accuracy['greedy']:.1%}, "
    f"sampled {accuracy['sampled']:.1%} ({samples} draws each at temperature {temperature})"
  )
  return accuracy, config, params, tokenizer


def _mean_field_gap(config: specs.Spec, params: Any, tokenizer: Any, items: list) -> dict:
  """Answers drawn (temperature 1, L2R) to the prompts; per answer token |mean-field - exact|
  log-prob, and per answer the gap of their sums."""
  cfg, t = config.model, config.model.block_size
  ids = [tokenizer.encode(p) for p, _ in items]
  done = responses.complete(
    params, cfg, ids, eos_id=tokenizer.eos_id, batch=32, temperature=1.0, seed=1
  )
  tokens = np.stack([f.tokens for f in done])
  order = np.stack([f.order for f in done])
  prompt = np.asarray([len(x) for x in ids])[:, None]
  drawn = np.take_along_axis(np.stack([f.steps for f in done]), order, 1) >= 0
  slot = np.arange(t)[None, :]
  alone = np.where(drawn, prompt, slot)  # every answer slot sees the prompt only
  model = model_lib.make_model(cfg)
  score = jax.jit(lambda tok, o, f: responses.answer_logprobs(model, params, tok, o, f))
  exact = np.asarray(score(jnp.asarray(tokens), jnp.asarray(order), None))
  field = np.asarray(score(jnp.asarray(tokens), jnp.asarray(order), jnp.asarray(alone)))
  gap = np.abs(field - exact) * drawn
  return {
    "mae_per_token": float(gap.sum() / drawn.sum()),
    "mae_per_answer": float(np.abs(((field - exact) * drawn).sum(1)).mean()),
    "exact_logprob_per_answer": float((exact * drawn).sum(1).mean()),
  }


def _grpo_rows(workdir: str) -> list[dict]:
  """The GRPO run's logged steps (one a step in the bench), in order."""
  rows = [json.loads(x) for x in fs.read_text(fs.join(workdir, layout.METRICS)).splitlines()]
  return [r for r in rows if r.get("rollout_s") is not None and r.get("step_s")]


def grpo_costs(rows: list[dict]) -> dict:
  """Mean seconds per GRPO step in rollout, reward, scoring and update (the rest of the step),
  and the median step's rollout tokens/s, from the run's logged steps. A logged interval ends
  once the next step's rollout ran (the loop reads a step's metrics after starting the next),
  so the last one holds no rollout and is left out: step and update NaN with under 3 steps."""
  step_s = float(np.mean([r["step_s"] for r in rows[:-1]])) if len(rows) > 1 else np.nan
  rollout, reward, scoring = (  # NaN: not in the log
    float(np.mean([r.get(k, np.nan) for r in rows])) for k in ("rollout_s", "reward_s", "scoring_s")
  )
  return {
    "step_s": step_s,
    "rollout_s": rollout,
    "reward_s": reward,
    "scoring_s": scoring,
    "update_s": step_s - rollout - np.nan_to_num(reward) - scoring,
    # The median: the first steps also compile the batch's programs.
    "rollout_tokens_per_s": float(np.median([r["rollout_tokens_per_s"] for r in rows])),
  }


def _seconds(x: float) -> str:
  return "n/a (too few steps)" if np.isnan(x) else f"{x:.2f} s"


def reward_curve(rows: list[dict], window: int) -> list[float]:
  """The mean logged reward of each `window` steps (the last window may be shorter)."""
  by_window: dict[int, list[float]] = {}
  for r in rows:
    by_window.setdefault((r["step"] - 1) // window, []).append(r["reward"])
  return [float(np.mean(v)) for _, v in sorted(by_window.items())]


def _draws(config: specs.Spec, params: Any, tokenizer: Any, items: list) -> dict:
  """The rollout's baselines, each seed -> the answer tokens it drew: the batch's answers to one
  prompt (items[0]'s), L2R one token a step until EOS, by parallel.sample (what `ao-mdm bench
  sample` times) and by GRPO's continuous batch (Rollouts.draw, no redraws): the engine on the
  baseline's own work, apart from what the rollout adds (answers of other lengths, redraws)."""
  from ao_mdm.train import grpo

  b, t = config.train.batch_size, config.model.block_size
  ids = tokenizer.encode(items[0][0])
  kw = dict(
    batch_size=b,
    steps=t - len(ids),
    order="l2r",
    known_positions=range(len(ids)),
    known_tokens=ids,
    eos_id=tokenizer.eos_id,
    vocab_limit=min(tokenizer.vocab_size, config.model.vocab_size),
  )
  sample = policies.get("parallel").sample

  def sampled(seed: int) -> int:
    out = sample(params, config.model, seed=seed, **kw)
    assert out.stats is not None  # with eos_id: each row's length, its EOS included
    return int((out.stats["length"] - len(ids)).sum())

  rollouts = grpo.Rollouts(
    config, tokenizer, params, jax.sharding.SingleDeviceSharding(jax.devices()[0])
  )
  p = b // config.grpo.group
  prompt_PT = np.tile(np.asarray(ids, np.int32), (p, 1))

  def batched(seed: int) -> int:
    rollouts.drawn_tokens = 0
    rollouts.draw(params, prompt_PT, np.full(p, len(ids)), seed + config.grpo.group * np.arange(p))
    return rollouts.drawn_tokens

  return {"sampler_tokens_per_s": sampled, "batcher_same_work_tokens_per_s": batched}


def timed_rates(draws: dict, seeds: range) -> dict[str, list[float]]:
  """Tokens/s of each draw(seed) (returning the tokens it drew) at each seed, the draws taking
  turns so that each sees the machine as the others do (one timed call moved by up to 1.6x
  between runs); seed 0, where given, untimed: the call that compiles."""
  rates: dict[str, list[float]] = {name: [] for name in draws}
  for seed in seeds:
    for name, draw in draws.items():
      start = time.perf_counter()
      tokens = draw(seed)
      if seed:
        rates[name].append(tokens / (time.perf_counter() - start))
  return rates


def _task(config: specs.Spec, bench: Any, checkpoint: str, log: Callable) -> dict:
  """Fine-tuning then GRPO on config.data.pairs's task from `checkpoint`: the exact matches
  before, after fine-tuning and after GRPO, the GRPO step's split and its reward curve."""
  from ao_mdm.train import loop

  items = pairs.load(config.data.pairs, "validation")[: bench.eval_pairs]
  result: dict = {"eval_pairs": len(items)}
  drawn = (int(bench.samples), float(config.grpo.temperature))  # the sampled exact match's
  result["start_accuracy"] = _accuracy(checkpoint, items, *drawn, log, "start")[0]
  quiet = lambda _: None
  with tempfile.TemporaryDirectory() as root:
    sft_dir, grpo_dir = f"{root}/sft", f"{root}/grpo"
    sft = config.replace(
      grpo=config.grpo.replace(reward=""),
      order=config.order.replace(kind=bench.sft_order, random_ratio=0.5),
      train=config.train.replace(
        num_steps=bench.sft_steps,
        batch_size=bench.sft_batch_size,
        learning_rate=bench.sft_learning_rate,
        min_lr=bench.sft_learning_rate / 10,
        warmup_steps=bench.sft_steps // 20,
        ema_decay=0.99,  # configs/finetune.py's (GRPO's 0.9 is the bench config's)
        checkpoint_every=bench.sft_steps,
        eval_every=0,
        log_every=bench.sft_steps,
      ),
    )
    start = time.perf_counter()
    loop.train_and_evaluate(sft, sft_dir, init_from=checkpoint, log=quiet)
    result["sft_s"] = time.perf_counter() - start
    accuracy, _, params, tokenizer = _accuracy(sft_dir, items, *drawn, log, "fine-tuned")
    result["sft_accuracy"] = accuracy
    result["mean_field"] = _mean_field_gap(config, params, tokenizer, items)
    grpo = config.replace(
      train=config.train.replace(
        num_steps=bench.grpo_steps, checkpoint_every=bench.grpo_steps, eval_every=0, log_every=1
      )
    )
    # The baselines are timed (seeds 1-3, then 4-6) before and after the GRPO run, whose
    # rollouts they are set against: the machine's speed moves over a run.
    draws = _draws(grpo, params, tokenizer, items)
    rates = timed_rates(draws, range(4))
    loop.train_and_evaluate(grpo, grpo_dir, init_from=sft_dir, log=quiet)
    result["grpo_accuracy"] = _accuracy(grpo_dir, items, *drawn, log, "after GRPO")[0]
    rows = _grpo_rows(grpo_dir)
    result["grpo"] = grpo_costs(rows)
    after = timed_rates(draws, range(4, 7))
    result["grpo"].update({k: float(np.median(v + after[k])) for k, v in rates.items()})
    result["reward_curve"] = reward_curve(rows, bench.window)
  g, m = result["grpo"], result["mean_field"]
  log(
    f"GRPO step {_seconds(g['step_s'])}: rollout {g['rollout_s']:.2f} s, reward "
    f"{g['reward_s']:.3f} s, scoring {g['scoring_s']:.2f} s, update {_seconds(g['update_s'])}; "
    f"rollout {g['rollout_tokens_per_s']:.0f} tokens/s against {g['sampler_tokens_per_s']:.0f} "
    f"for parallel.sample (GRPO's continuous batch on its work, {config.train.batch_size} answers "
    f"to one prompt: {g['batcher_same_work_tokens_per_s']:.0f})"
  )
  curve = result["reward_curve"]
  gain = f" (last - first: {curve[-1] - curve[0]:+.3f})" if curve else ""
  log(f"sampled reward per {bench.window} GRPO steps: {', '.join(f'{r:.3f}' for r in curve)}{gain}")
  log(
    f"d1's mean-field log-prob against the exact one: {m['mae_per_token']:.3f} nats per token, "
    f"{m['mae_per_answer']:.3f} per answer (exact: {m['exact_logprob_per_answer']:.3f} per answer)"
  )
  return result


def bench_posttrain(config: specs.Spec, bench: Any, checkpoint: str, log=print) -> dict:
  """Each of bench.tasks (data.pairs values) in turn, its reward curve plotted to bench.plot
  (an SVG; empty: none); one JSON line last."""
  result: dict = {"tasks": {}}
  for task in bench.tasks:
    log(f"task {task}, reward {config.grpo.reward}:")
    task_config = config.replace(data=config.data.replace(pairs=task))
    result["tasks"][task] = _task(task_config, bench, checkpoint, log)
  if bench.plot:
    curves = {
      task: [((i + 1) * bench.window, r) for i, r in enumerate(t["reward_curve"])]
      for task, t in result["tasks"].items()
    }
    x_label = f"GRPO steps ({bench.window} a point)"
    fs.write_text(bench.plot, svg.line_plot(curves, x_label, "sampled reward"))
    log(f"reward curves plotted to {bench.plot}")
  log(json.dumps(result))
  return result
