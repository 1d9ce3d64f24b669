"""`ao-mdm eval`: the perplexities of a run or an export on datasets or a local text file
(L2R, any-order, context-order ensembles, the unigram baseline), or with --generated the
generative perplexity of samples under a scorer."""

import json
import time

from absl import flags

from ao_mdm.checkpoint import layout
from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.eval.infill import SPAN_ORDERS
from ao_mdm.storage import fs, paths

SUMMARY = (
  "perplexities, a table then a JSON line: --checkpoint=DIR [--datasets=sotu,wikitext2 | "
  "--text_file=PATH] [--protocol=paper|custom --ensemble=8,64]; or --generated=FILE.jsonl "
  "--scorer=DIR; or --pairs=FILE.jsonl|arithmetic:N (responses: NLL and exact match)"
)


def define(fv: flags.FlagValues) -> None:
  flags_lib.checkpoint(fv)
  flags_lib.weights(fv)
  flags.DEFINE_string("datasets", "sotu", "Comma-separated dataset registry names.", flag_values=fv)
  flags.DEFINE_string(
    "text_file", None, "A local UTF-8 text file (one document per line).", flag_values=fv
  )
  flags.DEFINE_string(
    "lambada_file",
    None,
    "OpenAI's lambada_test.jsonl (local) for --datasets=lambada.",
    flag_values=fv,
  )
  flags.DEFINE_enum(
    "protocol",
    "paper",
    ["paper", "custom"],
    "paper = the authors' protocol (split per dataset: wikitext2 train, others "
    "test; any-order on 128 shuffled blocks, all of PTB, one order each; L2R and "
    "ensemble on the whole split); custom = --split, --max_blocks, --orders: consecutive "
    "blocks, as the validation during training reads them (its first "
    "train.eval_batches x train.batch_size).",
    flag_values=fv,
  )
  flags.DEFINE_string("split", "validation", "Dataset split (custom protocol).", flag_values=fv)
  flags.DEFINE_integer(
    "orders",
    4,
    "Random orders per sequence for the any-order perplexity (custom protocol).",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "ensemble",
    "",
    "Context-order ensemble sizes M, e.g. 8,64; costs about M/2 full forwards per target token.",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "max_blocks",
    64,
    "At most this many blocks per dataset (custom protocol; 0: all).",
    flag_values=fv,
  )
  flags_lib.batch_size(fv, 4, "Blocks per batch (with --generated: samples per batch).")
  flags_lib.seed(fv, "Seed of the random orders and ensembles.")
  flags.DEFINE_string("generated", None, "Samples (ao-mdm sample --out) to score.", flag_values=fv)
  flags.DEFINE_string(
    "scorer",
    None,
    "Scores --generated samples left to right: an "
    "import-gpt2 export (the paper: GPT-2 Large) or an ao_mdm checkpoint.",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "infill_file",
    None,
    'JSON lines of {"prefix", "span", "suffix"} '
    "texts: the exact log p(span | prefix, suffix) of each, the span's tokens "
    "last in the order.",
    flag_values=fv,
  )
  flags.DEFINE_enum(
    "infill_order",
    "l2r",
    list(SPAN_ORDERS),
    "--infill_file: the order of a span's own tokens (random: seeded by --seed).",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "pairs",
    None,
    "Prompt/response pairs (a JSON-lines file or arithmetic:N, as config data.pairs): each "
    "response's NLL per token given its prompt (left to right and random after it) and the "
    "exact match of greedy completions; --split picks train or validation, --max_blocks caps "
    "the pairs.",
    flag_values=fv,
  )
  flags_lib.storage_timeout(fv)
  flags_lib.compile_cache(fv)


def check(v: dict, given: set) -> None:
  if "infill_order" in given and not v["infill_file"]:
    raise ValueError("--infill_order applies with --infill_file")
  if v["infill_file"]:
    checks.not_with(
      given,
      (
        "datasets",
        "text_file",
        "lambada_file",
        "protocol",
        "split",
        "orders",
        "ensemble",
        "max_blocks",
        "generated",
        "scorer",
      ),
      "with --infill_file (which scores its spans under --checkpoint)",
    )
    checks.require(v, "checkpoint")
    layout.check_checkpoint(v["checkpoint"])
    paths.text_file(v["infill_file"], "--infill_file")
    return
  if v["pairs"]:
    checks.not_with(
      given,
      ("datasets", "text_file", "lambada_file", "protocol", "orders", "ensemble", "generated"),
      "with --pairs (which scores and completes the responses of pairs)",
    )
    checks.require(v, "checkpoint")
    layout.check_checkpoint(v["checkpoint"])
    if v["split"] not in ("train", "validation") or v["max_blocks"] < 0 or v["batch_size"] < 1:
      raise ValueError(
        f"--split={v['split']} must be train or validation, --max_blocks={v['max_blocks']} "
        f">= 0 (0: all), --batch_size={v['batch_size']} >= 1 with --pairs"
      )
    if ":" not in v["pairs"]:
      paths.text_file(v["pairs"], "--pairs")
    return
  if v["generated"]:
    checks.not_with(
      given,
      (
        "checkpoint",
        "datasets",
        "text_file",
        "lambada_file",
        "protocol",
        "split",
        "orders",
        "ensemble",
        "max_blocks",
      ),
      "with --generated (which scores samples under --scorer)",
    )
    checks.require(v, "scorer")
    paths.text_file(v["generated"], "--generated")
    if not fs.isfile(fs.join(v["scorer"], "gpt2_config.json")):  # not import-gpt2's
      layout.check_checkpoint(v["scorer"], "--scorer")
    return
  checks.require(v, "checkpoint")
  layout.check_checkpoint(v["checkpoint"])
  for name in ("text_file", "lambada_file"):
    if v[name]:
      paths.text_file(v[name], f"--{name}")
  if v["text_file"]:
    checks.not_with(
      given,
      ("datasets", "lambada_file", "split", "max_blocks"),
      "with --text_file (which evaluates every block of that one file)",
    )
  elif not checks.names(v["datasets"]):
    raise ValueError("--datasets is empty; give registry names, e.g. --datasets=sotu")
  elif v["lambada_file"] and "lambada" not in checks.names(v["datasets"]):
    raise ValueError("--lambada_file applies with --datasets=...,lambada")
  else:
    from ao_mdm.data import datasets  # the registry (TFDS, not JAX): an unknown name fails fast

    for name in checks.names(v["datasets"]):
      datasets.get_spec(name)
  custom = [f"--{k}" for k in ("split", "max_blocks", "orders") if k in given]
  if v["protocol"] == "paper" and custom:
    raise ValueError(
      f"{', '.join(custom)} apply with --protocol=custom; --protocol=paper fixes "
      "the split, block count and orders per dataset"
    )
  if v["orders"] < 1 or v["batch_size"] < 1 or v["max_blocks"] < 0:
    raise ValueError(
      f"--orders={v['orders']} and --batch_size={v['batch_size']} must be >= 1, "
      f"--max_blocks={v['max_blocks']} >= 0 (0: all)"
    )
  checks.int_list(v["ensemble"], "--ensemble")


def run(v: dict, given: set) -> None:
  del given
  flags_lib.enable_compile_cache(v["compile_cache"])
  if v["infill_file"]:
    _infill(v)
    return
  if v["pairs"]:
    _pairs(v)
    return
  if v["generated"]:
    r = _generated(v["generated"], v["scorer"], v["weights"], v["batch_size"])
    print(
      f"generative perplexity {r['gen_ppl']:.2f} +- {r['gen_ppl_sem']:.2f} (median "
      f"{r['gen_ppl_median']:.2f}), unigram entropy {r['unigram_entropy']:.3f} nats, "
      f"{r['samples']} samples"
    )
    print(json.dumps(r))
    return
  import tqdm

  from ao_mdm import sharding
  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.eval import perplexity, scoring, sets

  ensemble = checks.int_list(v["ensemble"], "--ensemble")
  config, params, tokenizer = checkpoints.load_run(
    v["checkpoint"], v["weights"], shardings=lambda c: sharding.param_shardings(c.model, c.mesh)
  )
  blocks = sets.eval_sets(
    config.data,
    tokenizer,
    config.model.block_size,
    names=checks.names(v["datasets"]),
    text_file=v["text_file"],
    lambada_file=v["lambada_file"],
    protocol=v["protocol"],
    split=v["split"],
    max_blocks=v["max_blocks"] or None,
  )
  scorer = scoring.Scorer(params, config.model, config.mesh)
  counts = perplexity.load_unigram_counts(v["checkpoint"])
  bars = []

  def progress(name, total):
    bars.append(tqdm.tqdm(total=total, desc=f"eval {name}", unit="block"))
    return bars[-1].update

  results = sets.evaluate_sets(
    scorer,
    blocks,
    protocol=v["protocol"],
    orders=v["orders"],
    ensemble=ensemble,
    batch_size=v["batch_size"],
    seed=v["seed"],
    progress=progress,
    unigram_counts=counts,
  )
  for bar in bars:
    bar.close()
  print(format_table(results, ensemble, unigram=counts is not None))
  print(json.dumps(results))


def format_table(results: dict, ensemble: list, unigram: bool) -> str:
  """One row per dataset: tokens, L2R, any-order (+- its standard error), unigram, ensembles."""
  lines = [
    f"{'dataset':<24} {'tokens':>8} {'L2R ppl':>9} {'any-order ppl':>16} "
    + (f"{'unigram ppl':>12} " if unigram else "")
    + " ".join(f"{'ens M=' + str(m):>10}" for m in ensemble)
  ]
  for name, r in results.items():
    lines.append(
      f"{name[-24:]:<24} {r['tokens']:>8} {r['l2r_ppl']:>9.2f} "
      f"{r['any_order_ppl']:>9.2f} +-{r['any_order_se']:<5.2f}"
      + (f"{r['unigram_ppl']:>12.2f} " if unigram else "")
      + " ".join(f"{r['ensemble_ppl'][str(m)]:>10.2f}" for m in ensemble)
    )
  return "\n".join(lines)


def _infill(v: dict) -> None:
  """log p(span | prefix, suffix) of each record of --infill_file, then the mean per token."""
  import math

  from ao_mdm import sharding
  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.eval import infill, scoring

  records = paths.jsonl_records(v["infill_file"], "--infill_file")
  for number, r in enumerate(records, 1):
    if not all(isinstance(r.get(k), str) for k in ("prefix", "span", "suffix")) or not r["span"]:
      raise ValueError(
        f"--infill_file {v['infill_file']} record {number} lacks string fields "
        "'prefix', 'span' (not empty) and 'suffix'"
      )
  config, params, tokenizer = checkpoints.load_run(
    v["checkpoint"], v["weights"], shardings=lambda c: sharding.param_shardings(c.model, c.mesh)
  )
  scorer = scoring.Scorer(params, config.model, config.mesh)
  items = []
  for number, r in enumerate(records):
    span = tokenizer.encode(r["span"])
    items.append(
      (
        tokenizer.encode(r["prefix"]),
        span,
        tokenizer.encode(r["suffix"]),
        infill.span_order(len(span), v["infill_order"], v["seed"] + number),
      )
    )
  cut = sum(len(p) + len(s) + len(u) > scorer.block_size for p, s, u, _ in items)
  if cut:
    print(
      f"{cut} of {len(items)} records are longer than T={scorer.block_size} tokens: the "
      "context farthest from their spans is dropped"
    )
  nlls = infill.infill_nll(scorer, items, batch_size=v["batch_size"])
  logprobs = [-float(n.sum()) for n in nlls]
  tokens = sum(len(n) for n in nlls)
  mean = -sum(logprobs) / tokens
  for number, (r, lp, n) in enumerate(zip(records, logprobs, nlls)):
    print(f"{number}: log p(span) = {lp:.3f} ({len(n)} tokens) {r['span'][:60]!r}")
  print(
    f"{len(records)} spans, {tokens} tokens: {mean:.4f} nats per token (perplexity "
    f"{math.exp(mean):.2f}), {v['infill_order']} order inside each span"
  )
  print(
    json.dumps(
      {
        "logprobs": logprobs,
        "span_tokens": [len(n) for n in nlls],
        "nll_per_token": mean,
        "order": v["infill_order"],
      }
    )
  )


def _pairs(v: dict) -> None:
  """The responses of --pairs: NLL per token given the prompt, and greedy exact match."""
  import math

  from ao_mdm import sharding, specs
  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.data import pairs
  from ao_mdm.eval import responses, scoring

  items = pairs.load(v["pairs"], v["split"])[: v["max_blocks"] or None]
  config, params, tokenizer = checkpoints.load_run(
    v["checkpoint"], v["weights"], shardings=lambda c: sharding.param_shardings(c.model, c.mesh)
  )
  rows = pairs.rows_for(v["pairs"], v["split"], tokenizer, config.model.block_size)
  (rows_NX,) = pairs.narrowed(rows.array[: v["max_blocks"] or None])
  scorer = scoring.Scorer(params, config.model, config.mesh)
  nll = {
    kind: responses.response_nll(
      scorer, rows_NX, specs.OrderSpec(kind=kind), seed=v["seed"], batch_size=v["batch_size"]
    )
    for kind in ("l2r", "random")
  }
  accuracy, _ = responses.exact_match(
    params, config.model, tokenizer, items, batch=max(v["batch_size"], 16)
  )
  print(
    f"{len(items)} {v['split']} pairs: response NLL {nll['l2r']:.4f} nats/token left to right "
    f"(perplexity {math.exp(nll['l2r']):.2f}), {nll['random']:.4f} in random orders; "
    f"greedy exact match {accuracy:.1%}"
  )
  print(
    json.dumps(
      {
        "pairs": len(items),
        "nll_l2r": nll["l2r"],
        "nll_random": nll["random"],
        "exact_match": accuracy,
      }
    )
  )


def _generated(generated: str, scorer_path: str, weights: str, batch_size: int) -> dict:
  """Generative perplexity of samples under a GPT-2 export or an ao_mdm checkpoint, with the
  seconds it took."""
  from ao_mdm import sharding
  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.eval import gpt2_scorer, perplexity, scoring, sets

  records = sets.read_generated(generated)
  scorer: gpt2_scorer.GPT2Scorer | scoring.Scorer
  if gpt2_scorer.is_gpt2_export(scorer_path):
    scorer = gpt2_scorer.load_gpt2_scorer(scorer_path)
  else:
    config, params = checkpoints.load_params(
      scorer_path, weights, shardings=lambda c: sharding.param_shardings(c.model, c.mesh)
    )
    scorer = scoring.Scorer(params, config.model, config.mesh)
  start = time.perf_counter()
  result = perplexity.generative_perplexity(scorer, sets.generated_ids(records, scorer), batch_size)
  result["seconds"] = time.perf_counter() - start
  return result
