"""`ao-mdm bench sample|train|data|restart|serve|posttrain|plan`: the benchmarks of ao_mdm/perf/,
figures and ratios measured in one run (docs/performance.md)."""

from absl import flags

from ao_mdm.checkpoint import layout
from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.storage import paths

SUMMARY = (
  "benchmarks: `bench sample --config=configs/bench_sampler.py [--mode=speculative "
  "--checkpoint=DIR]`, `bench train --config=configs/bench_train.py`, "
  "`bench data --config=configs/bench_data.py`, `bench restart --config=configs/demo.py` "
  "(any training config), `bench serve --config=configs/bench_serve.py --checkpoint=DIR`, "
  "`bench posttrain --config=configs/bench_posttrain.py --checkpoint=DIR`, "
  "`bench plan --config=configs/bench_plan.py --checkpoint=DIR [--puzzles=FILE.csv]`"
)
SUBCOMMANDS = ("sample", "train", "data", "restart", "serve", "posttrain", "plan")
CONFIGS = {
  "sample": "configs/bench_sampler.py",
  "train": "configs/bench_train.py",
  "data": "configs/bench_data.py",
  "serve": "configs/bench_serve.py",
  "posttrain": "configs/bench_posttrain.py",
  "plan": "configs/bench_plan.py",
}  # bench restart reads its run's own config


def define(fv: flags.FlagValues) -> None:
  flags_lib.config(fv)
  flags.DEFINE_enum(
    "baseline",
    "none",
    ["none", "torch"],
    "bench train: torch = also train the same model, step and batch in plain "
    "PyTorch (eager, float32, all cores; needs the [torch] extra) and print its "
    "tokens/s and ours over it.",
    flag_values=fv,
  )
  flags.DEFINE_enum(
    "mode",
    "parallel",
    ["parallel", "speculative"],  # the two benchmarks of bench_sample.py
    "bench sample: parallel = the cached sampler at each of the config's step "
    "counts; speculative = speculative against sequential decoding (needs "
    "--checkpoint).",
    flag_values=fv,
  )
  flags_lib.checkpoint(
    fv,
    "bench sample --mode=speculative, bench serve, bench posttrain: the trained model (a "
    "training work dir or an export).",
  )
  flags_lib.weights(
    fv,
    help_text="bench sample --mode=speculative: which params of a training work dir, ema | params.",
  )
  flags_lib.dtype(fv, "bench sample: the decoding dtype, float32 or bfloat16 (default: both).")
  flags.DEFINE_string(
    "draft_head",
    None,
    "bench sample --mode=speculative: a draft head "
    "written by `ao-mdm train-draft`, timed beside self-drafting.",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "puzzles",
    None,
    "bench plan: Sudoku puzzles to score, a CSV in the public form (quizzes,solutions; 81 "
    "characters each, 0 or . empty); default: the config's generated held-out puzzles.",
    flag_values=fv,
  )
  flags_lib.profile(fv, "bench sample's whole run")
  flags_lib.storage_timeout(fv)
  flags_lib.compile_cache(fv)


def check(v: dict, given: set, what: str) -> None:
  del given
  checks.require(v, "config")
  if v["dtype"] and what != "sample":
    raise ValueError(f"--dtype={v['dtype']} applies to `ao-mdm bench sample` only")
  if v["baseline"] != "none" and what != "train":
    raise ValueError(f"--baseline={v['baseline']} applies to `ao-mdm bench train` only")
  paths.directory(v["profile"], "--profile")
  if v["profile"] and what != "sample":
    raise ValueError(
      "--profile applies to `ao-mdm bench sample` only (training: train.profile_steps)"
    )
  if v["mode"] != "parallel" and what != "sample":
    raise ValueError(f"--mode={v['mode']} applies to `ao-mdm bench sample` only")
  if v["mode"] == "speculative" and not v["checkpoint"]:
    raise ValueError(
      "bench sample --mode=speculative needs --checkpoint (a trained model: "
      "acceptance depends on it)"
    )
  if v["puzzles"] and what != "plan":
    raise ValueError(f"--puzzles applies to `ao-mdm bench plan` only, not bench {what}")
  if v["puzzles"]:
    from ao_mdm.data import sudoku

    sudoku.read_csv(v["puzzles"])  # a bad file fails here, before any model loads
  if what in ("serve", "posttrain", "plan") and not v["checkpoint"]:
    raise ValueError(f"bench {what} needs --checkpoint (the trained run or export)")
  if v["draft_head"] and v["mode"] != "speculative":
    raise ValueError("--draft_head applies to `ao-mdm bench sample --mode=speculative`")
  if v["checkpoint"]:
    layout.check_checkpoint(v["checkpoint"])
  if v["draft_head"]:
    layout.check_checkpoint(v["draft_head"], "--draft_head", layout.DRAFT_HEAD)
  bench_config(v["config"], v["bench"], what, v["mode"])


def bench_config(config, bench, what: str, mode: str) -> None:
  """A benchmark's config has its `bench` section, and every value in it can run (all are
  checked before the first is timed)."""
  if what not in CONFIGS:
    return
  if bench is None:
    raise ValueError(
      f"--config has no `bench` section, which `ao-mdm bench {what}` reads; give "
      f"{CONFIGS[what]} (or a copy of it)"
    )
  if what == "sample" and mode == "parallel":
    t = config.model.block_size
    bad = [int(s) for s in bench.steps if not 1 <= int(s) <= t]
    if bad:
      raise ValueError(
        f"config.bench.steps={tuple(bench.steps)}: {bad} outside [1, {t}] "
        "(model.block_size: one token per step at most)"
      )


def run(v: dict, given: set, what: str) -> None:
  del given
  flags_lib.enable_compile_cache(v["compile_cache"])
  config, bench, name = v["config"], v["bench"], v["config_file"]
  if what == "data":
    from ao_mdm.perf import bench_data

    bench_data.bench_data(config, bench, name, log=_print)
  elif what == "restart":
    from ao_mdm.perf import bench_restart

    bench_restart.bench_restart(config, name, log=_print)
  elif what == "posttrain":
    from ao_mdm.perf import bench_posttrain

    bench_posttrain.bench_posttrain(config, bench, v["checkpoint"], log=_print)
  elif what == "plan":
    from ao_mdm.perf import bench_plan

    bench_plan.bench_plan(bench, v["checkpoint"], v["puzzles"], log=_print)
  elif what == "serve":
    from ao_mdm.perf import bench_serve

    bench_serve.bench_serve(v["checkpoint"], bench, log=_print)
  elif what == "train":
    from ao_mdm.perf import bench_train

    bench_train.bench_train(
      config, bench, None if v["baseline"] == "none" else v["baseline"], log=_print
    )
  elif v["mode"] == "speculative":
    from ao_mdm.checkpoint import checkpoints
    from ao_mdm.decode import draft
    from ao_mdm.perf import bench_sample

    saved, params = checkpoints.load_params(v["checkpoint"], v["weights"])
    head = draft.load(v["draft_head"], saved.model, params) if v["draft_head"] else None
    with flags_lib.profiled(v["profile"]):
      bench_sample.bench_speculative(
        bench, params, saved.model, v["dtype"] or "float32", head, log=_print
      )
  else:
    from ao_mdm.perf import bench_sample

    with flags_lib.profiled(v["profile"]):
      bench_sample.bench_sample(
        config, bench, (v["dtype"],) if v["dtype"] else ("float32", "bfloat16"), log=_print
      )


def _print(line: str) -> None:
  print(line, flush=True)
