"""`ao-mdm sample`: texts from a run or an export in any decoding mode (docs/sampling.md), each
shown as it finishes and, with --out, written as a JSON line; after an error or an interrupt
the finished samples are kept."""

from collections.abc import Callable, Iterator
import json

from absl import flags

from ao_mdm.checkpoint import layout
from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.decode import policies, text
from ao_mdm.decode.options import (
  DEFAULT_BLOCK_LEN,
  DEFAULT_STEPS,
  ORDERS,
  SCHEDULES,
  SCORES,
  TOP_P_RULES,
  check_best_of,
  check_block_len,
  check_counts,
  check_sampling,
)
from ao_mdm.runtime import interrupts
from ao_mdm.storage import fs, paths

SUMMARY = "sample texts: --checkpoint=DIR [--prompt=TEXT | --infill='a [MASK] b'] [--steps=64 ...]"
TEXT_OPTIONS = ("prompt", "infill", "infill_span", "mode", "num_samples", "until_eos", "best_of")


def define(fv: flags.FlagValues) -> None:
  flags_lib.checkpoint(fv)
  flags_lib.weights(fv)
  flags.DEFINE_string("prompt", "", "Text the samples start with.", flag_values=fv)
  flags.DEFINE_string("infill", "", "Text with [MASK] spans to fill in.", flag_values=fv)
  flags.DEFINE_integer("infill_span", 8, "Tokens generated per [MASK].", flag_values=fv)
  flags.DEFINE_enum(
    "mode",
    "parallel",
    list(policies.POLICIES),
    "parallel = S steps in a random (or L2R) order; speculative = exact samples "
    "of one-token-per-step decoding in an L2R (or random) order, --draft tokens "
    "drafted and verified per forward; confidence = S steps, the most confident "
    "positions first; margin = S steps, the largest top-1 minus top-2 probability first.",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "steps", DEFAULT_STEPS, "Decoding steps S (parallel, confidence, margin).", flag_values=fv
  )
  flags.DEFINE_boolean(
    "until_eos",
    False,
    "Stop each sample at its first end-of-text token "
    "after the prompt (parallel: after the --block_len block that holds it; "
    "speculative: L2R order); the text after it is not generated.",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "block_len",
    DEFAULT_BLOCK_LEN,
    "Positions per block (parallel): blocks "
    "decoded left to right, --order inside each, the steps spread over them; "
    "applies with --until_eos unless given (without: one block).",
    flag_values=fv,
  )
  flags.DEFINE_integer("draft", 4, "Tokens drafted per forward (speculative).", flag_values=fv)
  flags.DEFINE_string(
    "draft_head",
    None,
    "A draft head written by `ao-mdm train-draft` "
    "(speculative; default: the model drafts for itself, one token early).",
    flag_values=fv,
  )
  flags.DEFINE_enum(
    "score",
    "max_prob",
    list(SCORES),
    "Confidence of a prediction (confidence mode): its largest probability, or minus its entropy.",
    flag_values=fv,
  )
  flags.DEFINE_enum("schedule", "linear", list(SCHEDULES), "Unmasking schedule.", flag_values=fv)
  flags.DEFINE_float("temperature", 1.0, "Softmax temperature; 0 is greedy.", flag_values=fv)
  flags.DEFINE_float("top_p", 1.0, "Top-p mass in (0, 1]; 1 filters nothing.", flag_values=fv)
  flags.DEFINE_enum(
    "top_p_rule",
    "authors",
    list(TOP_P_RULES),
    "authors = drop every token whose inclusive cumulative probability exceeds "
    "top_p, keeping the most likely (the authors' catsample.py); nucleus = keep "
    "the smallest set whose probability reaches top_p.",
    flag_values=fv,
  )
  flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 is off.", flag_values=fv)
  flags.DEFINE_enum(
    "order",
    None,
    list(ORDERS),
    "Order of the unknown tokens; default "
    "(parallel): l2r after --prompt or --infill (as the authors' cond_generate), "
    "random without; (speculative): l2r.",
    flag_values=fv,
  )
  flags.DEFINE_integer("num_samples", 4, "How many samples.", flag_values=fv)
  flags.DEFINE_integer(
    "best_of",
    1,
    "Likelihood-ranked sampling: each sample is the best of this many draws by the exact "
    "log-probability per drawn token given the known ones (one more forward a draw).",
    flag_values=fv,
  )
  flags_lib.batch_size(fv, 4, "Samples per batch.")
  flags_lib.seed(fv)
  flags_lib.out(fv, "A new JSON-lines file: one object per sample (text, tokens, settings).")
  flags_lib.dtype(
    fv,
    "Decode in float32 (the default; exact) or bfloat16 (params and K/V "
    "cache; logits and the draw stay float32).",
  )
  flags_lib.profile(fv, "the sampling (after the checkpoint is loaded)")
  flags_lib.storage_timeout(fv)
  flags_lib.compile_cache(fv)


def check(v: dict, given: set) -> None:
  checks.require(v, "checkpoint")
  layout.check_checkpoint(v["checkpoint"])
  if v["out"]:
    paths.new_output_file(v["out"])
  if "infill_span" in given and not v["infill"]:
    raise ValueError("--infill_span applies with --infill")
  text.check_text(v["prompt"], v["infill"], v["infill_span"])
  policies.check_options(v["mode"], given & policies.option_names())
  check_counts(v["num_samples"], v["batch_size"])
  check_best_of(v["best_of"])
  # Before JAX loads: the values that do not depend on the model (the rest are checked on it).
  check_sampling(
    v["steps"], v["temperature"], v["top_p"], v["top_k"], v["order"], v["top_p_rule"],
    v["schedule"],
  )  # fmt: skip
  if v["until_eos"]:
    policies.check_until_eos(v["mode"], v["order"], v["infill"])
  check_block_len(v["block_len"])
  if v["draft_head"]:
    layout.check_checkpoint(v["draft_head"], "--draft_head", layout.DRAFT_HEAD)
  paths.directory(v["profile"], "--profile")


def describe(record: dict, mode: str, settings: dict) -> str:
  """How a sample was made, as it is printed above the text."""
  length = f", {record['length']} tokens" if "length" in record else ""
  if "best_of" in record:
    length += f", best of {record['best_of']} (log p {record['logprob']:.2f})"
  if mode == "speculative":
    drafter = "learned head" if settings.get("draft_head") else "self-drafted"
    return (
      f"speculative, {record['order']} order, draft {settings['draft']} ({drafter}): "
      f"{record['forwards']} forwards, {record['accepted']} drafts accepted{length}"
    )
  blocks = f", blocks of {record['block_len']}" if "block_len" in record else ""
  steps = f": {record['forwards']} steps{length}" if "length" in record else length
  return f"steps={record['steps']}, {record.get('order', mode)} order{blocks}{steps}"


def run(v: dict, given: set) -> None:
  flags_lib.enable_compile_cache(v["compile_cache"])
  import tqdm

  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.decode import draft, generate

  options = {k: v[k] for k in policies.get(v["mode"]).options}
  if "steps" in options and "steps" not in given:
    options["steps"] = None  # DEFAULT_STEPS, or fewer if fewer positions are unknown
  if "block_len" in options and "block_len" not in given and not v["until_eos"]:
    del options["block_len"]  # one block
  options["dtype"] = v["dtype"] or "float32"
  checkpoint, out = v["checkpoint"], v["out"]
  config, params, tokenizer = checkpoints.load_run(checkpoint, v["weights"])
  settings = {
    "checkpoint": checkpoint,
    "prompt": v["prompt"],
    "infill": v["infill"],
    "seed": v["seed"],
    "mode": v["mode"],
    "until_eos": v["until_eos"],
    "best_of": v["best_of"],
    **options,
  }
  if options.get("draft_head"):  # the path is recorded; the sampler takes the params
    options["draft_head"] = draft.load(options["draft_head"], config.model, params)
  batches = -(-v["num_samples"] // min(v["batch_size"], v["num_samples"]))
  bar = tqdm.tqdm(total=batches, desc="sampling", unit="batch", disable=batches < 2)
  records = generate.sample_texts(
    params,
    config.model,
    tokenizer,
    num_samples=v["num_samples"],
    batch_size=v["batch_size"],
    seed=v["seed"],
    progress=bar.update,
    **{k: v[k] for k in TEXT_OPTIONS if k != "num_samples"},
    **options,
  )
  extra = {"tokenizer": config.data.tokenizer, **settings}

  def show(i: int, record: dict) -> None:
    tqdm.tqdm.write(
      f"--- sample {i} ({describe(record, v['mode'], settings)}) ---\n"
      f"{record.get('marked', record['text'])}\n"
    )

  with flags_lib.profiled(v["profile"]):
    written = write_samples(records, out, v["num_samples"], extra, show, tqdm.tqdm.write)
  bar.close()
  if out:
    print(f"wrote {written} samples to {out}")


def write_samples(
  records: Iterator[dict],
  out: str | None,
  expected: int,
  extra: dict,
  show: Callable[[int, dict], None],
  say: Callable[[str], None],
) -> int:
  """Shows each record as it finishes and, with `out`, appends it with `extra` as a JSON line
  to `out.partial`, renamed to `out` at the end; after an interrupt or an error the finished
  ones are kept in `out` (and `say` tells how many, unless all `expected` were). Returns how
  many were written."""
  partial = f"{out}.partial" if out else None
  written = [0]

  def keep_finished(signalled: bool = False) -> str | None:
    """The finished samples go to `out`; says how many unless all of them were written (after a
    signal, counted in the file: the signal may fall between a write and its count)."""
    if not out or not partial:
      return None
    kept = written[0]
    if signalled and fs.exists(partial):
      kept = fs.read_bytes(partial).count(b"\n")
    if not kept:
      return None
    fs.move(partial, out)
    return f"kept the {kept} finished samples in {out}" if kept < expected else None

  if partial:  # a partial file of an earlier, killed call
    fs.remove(partial)
  with interrupts.on_interrupt(lambda: keep_finished(signalled=True)):
    try:
      for i, r in enumerate(records):
        show(i, r)
        if partial:  # an error before the first sample leaves nothing
          fs.append(
            partial,
            (
              json.dumps({**r, **extra, "steps": r.get("steps"), "order": r.get("order")}) + "\n"
            ).encode(),
          )
        written[0] += 1
    except Exception:
      said = keep_finished()
      if said:
        say(said)
      raise
  keep_finished()
  return written[0]
