"""The `ao-mdm` commands, the flags each reads and every flag's help text (free of JAX)."""
from absl import flags
from ml_collections import config_flags

from ao_mdm.config import DTYPES
from ao_mdm.decode.options import (DEFAULT_STEPS, DRAFT_TRAINING, MODE_OPTION_NAMES, MODES,
                                   ORDERS, SCHEDULES, SCORES, TOP_P_RULES)

COMMANDS = {
    "train": "train a model: --config=configs/tiny.py --workdir=DIR [--config.x.y=value ...]",
    "prepare": "tokenize a config's dataset once into token shards that train and eval read: "
               "--config=... [--splits=train,validation --workers=N --workdir=DIR]",
    "train-draft": "train a draft head for --mode=speculative on a run's training data, the "
                   "model frozen: --checkpoint=RUN --workdir=DIR [--steps=600 --batch_size=32]",
    "info": "parameter count and FLOPs per token of a config: --config=...",
    "tokenizer": "train a SentencePiece tokenizer: --corpus=sotu|PATH --vocab_size=N --out=DIR",
    "export": "write the EMA params alone: --workdir=DIR --out=DIR [--weights=ema|params]",
    "sample": "sample texts: --checkpoint=DIR [--prompt=TEXT | --infill='a [MASK] b'] [--steps=64 ...]",
    "eval": "perplexities: --checkpoint=DIR [--datasets=sotu,wikitext2 | --text_file=PATH] "
            "[--protocol=paper|custom --ensemble=8,64]; or --generated=FILE.jsonl --scorer=DIR",
    "import-torch": "convert a reference PyTorch checkpoint: --checkpoint=ckpt.pt --out=DIR "
                    "[--weights=ema|model] [--variant=ao|sigma]",
    "import-gpt2": "convert a local Hugging Face GPT-2 (e.g. gpt2-large) into a scorer for "
                   "eval --generated: --hf_dir=DIR --out=DIR",
    "compile": "ahead-of-time compile for a TPU topology, with memory and a roofline projection: "
               "--config=... --topology=v5e:4x4 [--program=train|sample --batch_size=8 "
               "--steps=64 --dtype=bfloat16]",
    "bench": "benchmarks: `bench sample --config=configs/bench_sampler.py [--mode=speculative "
             "--checkpoint=DIR]`, `bench train --config=configs/bench_train.py`, "
             "`bench data --config=configs/bench_data.py`, "
             "`bench restart --config=configs/demo.py`",
}
# The flags each command reads; any other flag of ours given to it is an error.
SAMPLE_OPTIONS = ("prompt", "infill", "infill_span", "mode", "num_samples",
                  *sorted(MODE_OPTION_NAMES))
COMMAND_FLAGS = {
    "train": ("config", "workdir", "init_from", "start_over", "coordinator", "num_processes",
              "process_id", "init_timeout", "storage_timeout", "compile_cache"),
    "prepare": ("config", "splits", "workers", "workdir", "num_processes", "process_id",
                "verify", "storage_timeout"),
    "train-draft": ("checkpoint", "workdir", "weights", "steps", "batch_size", "seed", "order",
                    "storage_timeout", "compile_cache"),
    "info": ("config",),
    "tokenizer": ("corpus", "vocab_size", "out", "storage_timeout"),
    "export": ("workdir", "out", "weights", "storage_timeout", "compile_cache"),
    "sample": ("checkpoint", "weights", *SAMPLE_OPTIONS, "batch_size", "seed", "out",
               "storage_timeout", "compile_cache"),
    "eval": ("checkpoint", "weights", "datasets", "text_file", "lambada_file", "protocol", "split",
             "orders", "ensemble", "max_blocks", "batch_size", "seed", "generated", "scorer",
             "storage_timeout", "compile_cache"),
    "import-torch": ("checkpoint", "out", "weights", "variant", "storage_timeout"),
    "import-gpt2": ("hf_dir", "out", "storage_timeout"),
    "compile": ("config", "topology", "program", "batch_size", "steps", "schedule", "dtype"),
    "bench": ("config", "baseline", "mode", "checkpoint", "weights", "dtype", "draft_head",
              "storage_timeout", "compile_cache"),
}
# Flags that name a path: each may be local or gs://BUCKET/..., with ~ expanded
# (storage/paths.py checks their form before anything else).
PATH_FLAGS = ("workdir", "out", "checkpoint", "init_from", "draft_head", "text_file",
              "lambada_file", "generated", "scorer", "hf_dir", "compile_cache")
# Defaults of shared flags that mean something else in one command (its --help shows these).
COMMAND_DEFAULTS = {"train-draft": DRAFT_TRAINING}
BENCHES = ("sample", "train", "data", "restart")
PROGRAMS = ("train", "sample")  # of `ao-mdm compile`


def define_flags() -> None:
  """Defines every flag of every command (absl's global FLAGS)."""
  config_flags.DEFINE_config_file("config", None, "ml_collections config file.",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Training work dir (checkpoints, tokenizer, logs); "
                      "train-draft: where the head is written (a new or empty directory).")
  flags.DEFINE_string("out", None, "Output path.")
  flags.DEFINE_string("corpus", "sotu", "Dataset registry name or a local text file.")
  flags.DEFINE_integer("vocab_size", 2048, "Tokenizer vocab size (a multiple of 128).")
  flags.DEFINE_enum("weights", "ema", ["ema", "params", "model"],
                    "Which params: of a training work dir, ema | params (an export or import "
                    "holds one set: ema); import-torch: which of the PyTorch checkpoint's to "
                    "import, ema | model.")
  flags.DEFINE_enum("variant", None, ["ao", "sigma"], "import-torch: model variant (default: "
                    "detected from the keys).")
  flags.DEFINE_string("checkpoint", None, "A training work dir or an export (import-torch: "
                      "the authors' PyTorch ckpt.pt file).")
  flags.DEFINE_string("prompt", "", "sample: text the samples start with.")
  flags.DEFINE_string("infill", "", "sample: text with [MASK] spans to fill in.")
  flags.DEFINE_integer("infill_span", 8, "sample: tokens generated per [MASK].")
  flags.DEFINE_enum("mode", "parallel", list(MODES),
                    "sample: parallel = S steps in a random (or L2R) order; speculative = exact "
                    "samples of one-token-per-step decoding in an L2R (or random) order, --draft "
                    "tokens drafted and verified per forward; confidence = "
                    "S steps, the most confident positions first.")
  flags.DEFINE_integer("steps", DEFAULT_STEPS, "sample: decoding steps S (parallel, confidence); "
                       "train-draft: training steps.")
  flags.DEFINE_integer("draft", 4, "sample: tokens drafted per forward (speculative).")
  flags.DEFINE_string("draft_head", None, "sample, bench sample (speculative): a draft head "
                      "written by `ao-mdm train-draft` (default: the model drafts for itself, "
                      "one token early).")
  flags.DEFINE_enum("score", "max_prob", list(SCORES),
                    "sample: confidence of a prediction (confidence mode): its largest "
                    "probability, or minus its entropy.")
  flags.DEFINE_enum("schedule", "linear", list(SCHEDULES), "sample: unmasking schedule.")
  flags.DEFINE_float("temperature", 1.0, "sample: softmax temperature; 0 is greedy.")
  flags.DEFINE_float("top_p", 1.0, "sample: top-p mass in (0, 1]; 1 filters nothing.")
  flags.DEFINE_enum("top_p_rule", "authors", list(TOP_P_RULES),
                    "sample: authors = drop every token whose inclusive cumulative probability "
                    "exceeds top_p, keeping the most likely (the authors' catsample.py); nucleus = "
                    "keep the smallest set whose probability reaches top_p.")
  flags.DEFINE_integer("top_k", 0, "sample: keep the k most likely tokens; 0 is off.")
  flags.DEFINE_enum("order", None, list(ORDERS),
                    "sample: order of the unknown tokens; default (parallel): l2r after --prompt "
                    "or --infill (as the authors' cond_generate), random without; "
                    "(speculative): l2r. train-draft: the order the head is trained for "
                    "(default: both, half the sequences each).")
  flags.DEFINE_integer("num_samples", 4, "sample: how many samples.")
  flags.DEFINE_integer("batch_size", 4, "sample: samples per batch; eval: blocks per batch; "
                       "train-draft: sequences per step.")
  flags.DEFINE_integer("seed", 0, "Random seed.")
  flags.DEFINE_string("datasets", "sotu", "eval: comma-separated dataset registry names.")
  flags.DEFINE_string("text_file", None, "eval: a local UTF-8 text file (one document per line).")
  flags.DEFINE_enum("protocol", "paper", ["paper", "custom"],
                    "eval: paper = the authors' protocol (split per dataset: wikitext2 train, "
                    "others test; any-order on 128 shuffled blocks, all of PTB, one order each; "
                    "L2R and ensemble on the whole split); custom = --split, --max_blocks, "
                    "--orders.")
  flags.DEFINE_string("split", "validation", "eval (custom protocol): dataset split.")
  flags.DEFINE_integer("orders", 4, "eval (custom protocol): random orders per sequence for the "
                       "any-order perplexity.")
  flags.DEFINE_string("ensemble", "", "eval: context-order ensemble sizes M, e.g. 8,64; costs "
                      "about M/2 full forwards per target token.")
  flags.DEFINE_integer("max_blocks", 64, "eval (custom protocol): at most this many blocks per "
                       "dataset (0: all).")
  flags.DEFINE_string("lambada_file", None, "eval: OpenAI's lambada_test.jsonl (local) for "
                      "--datasets=lambada.")
  flags.DEFINE_string("hf_dir", None, "import-gpt2: a local Hugging Face GPT-2 directory.")
  flags.DEFINE_string("generated", None, "eval: samples (ao-mdm sample --out) to score.")
  flags.DEFINE_string("scorer", None, "eval: scores --generated samples left to right: an "
                      "import-gpt2 export (the paper: GPT-2 Large) or an ao_mdm checkpoint.")
  flags.DEFINE_enum("dtype", None, list(DTYPES),
                    "sample, bench sample, compile --program=sample: decode in float32 (the "
                    "default; exact) or bfloat16 (params and K/V cache; logits and the draw stay "
                    "float32). bench sample without it times both.")
  flags.DEFINE_string("topology", None, "compile: a TPU topology such as v5e:4x4.")
  flags.DEFINE_enum("program", "train", list(PROGRAMS),
                    "compile: the sharded train step, or the cached sampler (one generation of "
                    "--batch_size samples in --steps steps, every cache bucket).")
  flags.DEFINE_enum("baseline", "none", ["none", "torch"],
                    "bench train: torch = also train the same model, step and batch in plain "
                    "PyTorch (eager, float32, all cores; needs the [torch] extra) and print its "
                    "tokens/s and ours over it.")
  flags.DEFINE_string("splits", "train,validation", "prepare: comma-separated splits.")
  flags.DEFINE_boolean("verify", False, "prepare: hash every shard of a split prepared before "
                       "(otherwise its sizes and versions are checked against the manifest).")
  flags.DEFINE_string("compile_cache", None, "Where compiled programs are kept for the next "
                      "run (a directory or gs:// path; `off`: nowhere); default: "
                      "WORKDIR/xla_cache for train, else $XDG_CACHE_HOME/ao_mdm/xla "
                      "(~/.cache/ao_mdm/xla); also AO_MDM_COMPILE_CACHE. Remove the directory "
                      "to clear it.")
  flags.DEFINE_integer("storage_timeout", 60, "Seconds a Cloud Storage (gs://) call may retry "
                       "before the command fails with one error line (an unreachable server, a "
                       "network outage); also AO_MDM_STORAGE_TIMEOUT.")
  flags.DEFINE_integer("workers", None, "prepare: worker processes (default: every core).")
  flags.DEFINE_string("init_from", None, "train: start from the params of an export or import.")
  flags.DEFINE_boolean("start_over", False, "train: when no checkpoint of --workdir can be "
                       "read, move them aside and train from step 0 (otherwise an error).")
  flags.DEFINE_string("coordinator", None, "Multi-process: coordinator HOST:PORT (process 0).")
  flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
  flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")
  flags.DEFINE_integer("init_timeout", 180, "Multi-process: seconds to wait for the other "
                       "processes and the coordinator before giving up.")
