"""The CLI contract: per-command --help; one `error:` line, no traceback and no file changed per
bad input; the newest readable checkpoint when the latest is corrupt."""

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.train import loop
from helpers import ROOT, ao_mdm, printed_time, tiny_config


@pytest.mark.parametrize(
  "command", ["train", "sample", "eval", "import-gpt2", "compile", "import-torch"]
)
def test_command_help_lists_its_own_flags(command):
  out = ao_mdm(command, "--help")
  assert out.returncode == 0 and out.stderr == ""
  assert out.stdout.startswith(f"usage: ao-mdm {command}")
  listed = {
    line.split(":")[0].strip() for line in out.stdout.splitlines() if line.startswith("  --")
  }
  assert ("--top_p_rule" in listed) == (command == "sample")
  assert ("--protocol" in listed) == (command == "eval")
  others = [c for c in ("train", "sample", "eval", "import-torch", "train-draft") if c != command]
  assert not any(f"{other}:" in out.stdout for other in others)  # no flag speaks of another
  if command == "eval":  # each flag's help speaks of this command
    assert "--batch_size: Blocks per batch" in out.stdout
  if command == "import-torch":
    assert "--checkpoint: The authors' PyTorch ckpt.pt file" in out.stdout
    assert (
      "--weights: <ema|model>: Which of the PyTorch checkpoint's params to import" in out.stdout
    )


@pytest.fixture(scope="module")
def files(data_dir, tmp_path_factory):
  """A run with checkpoints at steps 1 and 2, its export, and assorted bad inputs."""
  root = tmp_path_factory.mktemp("cli")
  run = str(root / "run")
  loop.train_and_evaluate(specs.parse(tiny_config(data_dir)), run)
  export = checkpoints.export(run, str(root / "export"))
  no_tokenizer = str(root / "no_tokenizer")
  shutil.copytree(export, no_tokenizer)
  shutil.rmtree(os.path.join(no_tokenizer, "tokenizer"))
  (root / "empty").mkdir()
  (root / "full").mkdir()
  (root / "full" / "keep.txt").write_text("do not touch\n")
  (root / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
  (root / "a_file").write_text("not a directory\n")
  (root / "not_json.jsonl").write_text('{"tokens": [1, 2]\n')
  (root / "no_tokens.jsonl").write_text('{"text": "hello"}\n')
  (root / "blank.jsonl").write_text("\n")
  (root / "big_ids.jsonl").write_text(json.dumps({"text": "x", "tokens": [1, 99999, 3]}) + "\n")
  no_role = {"messages": [{"content": "hi"}, {"role": "assistant", "content": "hello"}]}
  (root / "no_role.jsonl").write_text(json.dumps(no_role) + "\n" + json.dumps(no_role) + "\n")
  (root / "bad_syntax.py").write_text("def get_config(:\n")
  (root / "no_get_config.py").write_text("x = 1\n")
  (root / "list_config.py").write_text("def get_config():\n  return [1]\n")
  (root / "misspelt.py").write_text(
    "from ao_mdm.config import base_config\n\n\n"
    "def get_config():\n  c = base_config()\n"
    "  c.train.num_step = 10\n  return c\n"
  )
  for name, inside in (("ckfile", "checkpoints"), ("tokfile", "tokenizer")):
    (root / name).mkdir()
    (root / name / inside).write_text("a file where a run keeps a directory\n")
  from ao_mdm.decode import draft

  cfg = specs.parse(tiny_config(data_dir)).model
  head = checkpoints.write_params_export(
    str(root / "head"),
    {"model": dataclasses.asdict(cfg), "draft_head": {"base_fingerprint": "0"}},
    draft.init_head(cfg, jax.random.key(0)),
  )
  return {
    "root": str(root),
    "run": run,
    "export": export,
    "no_tokenizer": no_tokenizer,
    "head": head,
  }


TINY = "--config=configs/tiny.py"
# (arguments, a part of the expected error line); {name} is a path from the `files` fixture.
BAD_INPUTS = [
  # commands and flags
  (
    ["no-such-command"],
    "unknown command 'no-such-command'; accepted: train, prepare, train-draft, info",
  ),
  (["info", TINY, "stray"], "unexpected argument(s) 'stray'"),
  (["info", TINY, "--steps=3"], "--steps not accepted by `ao-mdm info`"),
  (["info", TINY, "--bogus=1"], "Unknown command line flag 'bogus'"),
  (["sample", "--checkpoint={run}", "--steps=abc"], "--steps=abc"),
  (["sample", "--checkpoint={run}", "--schedule=square"], "--schedule=square"),
  (
    ["bench"],
    "ao-mdm bench takes one of sample, train, data, restart, serve, posttrain, plan first, "
    "got nothing",
  ),
  (["bench", "fast", TINY], "got 'fast'"),
  (
    ["bench", "sample", TINY, "--baseline=torch"],
    "--baseline=torch applies to `ao-mdm bench train` only",
  ),
  (["bench", "train", TINY, "--baseline=tf"], "--baseline=tf: value should be one of <none|torch>"),
  (
    [
      "bench",
      "train",
      "--config=configs/bench_train.py",
      "--baseline=torch",
      "--config.model.variant=sigma",
    ],
    "model.variant='sigma': the PyTorch training step is written for AO-GPT (ao) only",
  ),
  (["info"], "missing --config"),
  # configs
  (["info", "--config=configs/nope.py"], "--config 'configs/nope.py': no such file"),
  (["info", "--config={root}/bad_syntax.py"], "cannot be loaded (SyntaxError"),
  (["info", "--config={root}/no_get_config.py"], "defines get_config()"),
  (["info", "--config={root}/list_config.py"], "get_config() returned a list, not an"),
  (["info", "--config=configs/paper.py:bogus"], "unknown paper config 'bogus'; accepted: ao_small"),
  (["info", TINY, "--config.train.bogus=1"], "config.train has no key 'bogus'; its keys: b1"),
  (["info", TINY, "--config.trian.steps=1"], "the config has no key 'trian'"),
  (["info", TINY, "--config.model.n_embed=64"], "did you mean --config.model.n_embd?"),
  (["info", TINY, "--config.train.num_steps=abc"], "--config.train.num_steps=abc"),
  (["info", TINY, "--config.model.n_layer=0"], "model.n_layer=0 must be >= 1"),
  (["info", TINY, "--config.model.n_embd=130"], "model.n_embd=130 is not divisible"),
  (["info", TINY, "--config.model.dtype=fp8"], "model.dtype='fp8'; accepted"),
  # train
  (["train", TINY], "missing --workdir"),
  (["train", TINY, "--workdir={root}/a_file"], "is a file; give a directory"),
  (
    ["train", TINY, "--workdir={root}/w", "--config.train.learning_rate=0"],
    "train.learning_rate=0.0 must be > 0",
  ),
  (
    ["train", TINY, "--workdir={root}/w", "--config.train.microbatches=3"],
    "train.batch_size=16 is not divisible by train.microbatches=3",
  ),
  (["train", TINY, "--workdir={root}/w", "--config.order.kind=zigzag"], "order.kind='zigzag'"),
  (
    ["train", TINY, "--workdir={root}/w", "--config.order.random_ratio=2"],
    "order.random_ratio=2.0 must be in [0, 1]",
  ),
  (
    ["train", TINY, "--workdir={root}/w", "--config.train.ema_decay=1"],
    "train.ema_decay=1.0 must be in [0, 1)",
  ),
  (
    ["train", TINY, "--workdir={root}/w", "--init_from={root}/nowhere"],
    "--init_from '{root}/nowhere' is not a directory",
  ),
  (["train", TINY, "--workdir={run}", "--init_from={export}"], "already holds checkpoints"),
  (
    ["train", TINY, "--workdir={root}/w", "--coordinator=localhost"],
    "--coordinator='localhost': expected HOST:PORT",
  ),
  (
    ["train", TINY, "--workdir={root}/w", "--coordinator=10.0.0.2:8476", "--num_processes=2"],
    "--coordinator needs --num_processes and --process_id",
  ),
  (
    ["train", TINY, "--workdir={root}/w", "--num_processes=2", "--process_id=0"],
    "--num_processes=2 needs --coordinator=HOST:PORT",
  ),
  (["train", TINY, "--workdir={root}/w", "--init_timeout=0"], "--init_timeout=0 must be >= 1"),
  (
    [
      "train",
      TINY,
      "--workdir={root}/w",
      "--config.data.dataset=wikitext103",
      "--config.data.tfds_dir={root}/empty",
    ],
    "dataset 'wikitext103' is not prepared",
  ),
  (
    ["train", TINY, "--workdir={root}/big", "--config.model.n_layer=1000000"],
    "GiB on this host (297,",
  ),
  (
    ["train", TINY, "--workdir={root}/w", "--init_from={export}"],
    "holds a different model: model.vocab_size",
  ),
  # prepare
  (["prepare", TINY, "--workers=0"], "--workers=0 must be >= 1"),
  (["prepare", TINY, "--splits=,"], "--splits is empty"),
  (["prepare", TINY], "data.tokenizer='sentencepiece' is trained for each run: give --workdir"),
  (
    ["prepare", TINY, "--workdir={run}", "--config.model.vocab_size=512", "--splits=test"],
    "dataset 'sotu' has no split 'test'; splits: train, validation",
  ),
  (["prepare", TINY, "--process_id=2", "--num_processes=2"], "--process_id=2 must be in [0, 2)"),
  (["prepare", TINY, "--num_processes=2"], "give --process_id and --num_processes together"),
  # sample
  (["sample", "--checkpoint={root}/nowhere"], "--checkpoint '{root}/nowhere' is not a directory"),
  (["sample", "--checkpoint={root}/empty"], "holds no checkpoint"),
  (["sample", "--checkpoint={run}", "--steps=0"], "steps=0 must be >= 1"),
  (["sample", "--checkpoint={run}", "--temperature=-1"], "temperature=-1.0 must be >= 0"),
  (["sample", "--checkpoint={run}", "--top_p=0"], "top_p=0.0 must be in (0, 1]"),
  (["sample", "--checkpoint={run}", "--num_samples=0"], "--num_samples=0"),
  (["sample", "--checkpoint={run}", "--prompt=a", "--infill=b [MASK]"], "not both"),
  (["sample", "--checkpoint={run}", "--out={root}/full"], "is a directory; give a file name"),
  (["sample", "--checkpoint={run}", "--out={root}/a_file/s.jsonl"], "cannot be written"),
  (
    ["sample", "--checkpoint={run}", "--weights=model"],
    "--weights=model: value should be one of <ema|params>",
  ),
  (
    ["sample", "--checkpoint={run}", "--infill=a [MASK] b", "--infill_span=1000"],
    "use a smaller --infill_span or a shorter text",
  ),
  (["sample", "--checkpoint={export}", "--weights=params"], "is an export"),
  (["sample", "--checkpoint={no_tokenizer}"], "needs exactly one SentencePiece tokenizer"),
  (["sample", "--checkpoint={run}", "--prompt=" + "many words here " * 40], "too long"),
  (["sample", "--checkpoint={run}", "--mode=speculative", "--draft=0"], "draft=0 must be in [1,"),
  (["sample", "--checkpoint={run}", "--mode=fast"], "--mode"),
  (
    ["sample", "--checkpoint={run}", "--score=entropy"],
    "--score applies to --mode=confidence, not --mode=parallel",
  ),
  (
    ["sample", "--checkpoint={run}", "--mode=speculative", "--steps=8"],
    "--steps applies to --mode=parallel or --mode=confidence or --mode=margin, "
    "not --mode=speculative",
  ),
  (
    ["sample", "--checkpoint={run}", "--mode=confidence", "--order=l2r"],
    "--order applies to --mode=parallel or --mode=speculative, not --mode=confidence",
  ),
  (["sample", "--checkpoint={run}", "--infill=no mask here"], "has no [MASK] to fill in"),
  (["sample", "--checkpoint={run}", "--infill_span=4"], "--infill_span applies with --infill"),
  (["sample", "--checkpoint={run}", "--out={root}/a_file"], "exists; give a new path"),
  (["bench", "sample", TINY, "--mode=speculative"], "needs --checkpoint"),
  (["bench", "train", TINY, "--mode=speculative"], "applies to `ao-mdm bench sample` only"),
  # eval
  (["eval", "--checkpoint={run}", "--text_file={root}/nowhere.txt"], "no such file"),
  (["eval", "--checkpoint={run}", "--text_file={root}/latin1.txt"], "is not UTF-8 text"),
  (["eval", "--checkpoint={run}", "--text_file={root}/full"], "is a directory; give a text file"),
  (["eval", "--checkpoint={run}", "--ensemble=8,x"], "--ensemble=8,x: expected positive"),
  (["eval", "--checkpoint={run}", "--orders=2"], "--orders apply with --protocol=custom"),
  (["eval", "--checkpoint={run}", "--protocol=custom", "--orders=0"], "--orders=0"),
  (["eval", "--checkpoint={run}", "--datasets=imagenet"], "unknown dataset 'imagenet'"),
  (["eval", "--checkpoint={run}", "--datasets=lambada"], "needs --lambada_file"),
  (["eval", "--checkpoint={run}", "--datasets="], "--datasets is empty"),
  (
    ["eval", "--checkpoint={run}", "--datasets=sotu", "--text_file={root}/a_file"],
    "--datasets do not apply with --text_file",
  ),
  (
    [
      "eval",
      "--checkpoint={run}",
      "--text_file={root}/a_file",
      "--protocol=custom",
      "--split=train",
      "--max_blocks=2",
    ],
    "--split, --max_blocks do not apply with --text_file",
  ),
  (
    ["eval", "--checkpoint={run}", "--lambada_file={root}/a_file"],
    "--lambada_file applies with --datasets=...,lambada",
  ),
  (
    ["eval", "--generated={root}/no_tokens.jsonl", "--scorer={run}", "--datasets=sotu"],
    "--datasets do not apply with --generated",
  ),
  (["eval", "--generated={root}/not_json.jsonl"], "missing --scorer"),
  (["eval", "--generated={root}/not_json.jsonl", "--scorer={run}"], "line 1 is not JSON"),
  (["eval", "--generated={root}/no_tokens.jsonl", "--scorer={run}"], "lacks a 'tokens' list"),
  (["eval", "--generated={root}/blank.jsonl", "--scorer={run}"], "holds no records"),
  (
    ["eval", "--generated={root}/big_ids.jsonl", "--scorer={run}"],
    "sample token id 99999 is outside the scorer's vocab [0, 512)",
  ),
  # export, imports, tokenizer, compile
  (["export", "--checkpoint={run}"], "missing --out"),
  (["export", "--checkpoint={run}", "--out={root}/full"], "exists and is not an empty directory"),
  (
    ["export", "--checkpoint={run}", "--out={root}/e", "--weights=model"],
    "--weights=model: value should be one of <ema|params>",
  ),
  (["export", "--checkpoint={root}/empty", "--out={root}/e"], "holds no checkpoint"),
  (
    ["export", "--workdir={run}", "--out={root}/e"],
    "--workdir is now --checkpoint in `ao-mdm export`, as in every command that reads a run",
  ),
  (["import-torch", "--checkpoint={root}/nowhere.pt", "--out={root}/t"], "no such file"),
  (
    ["import-torch", "--checkpoint={root}/a_file", "--out={root}/t", "--weights=params"],
    "--weights=params: value should be one of <ema|model>",
  ),
  (["import-torch", "--checkpoint={root}/a_file", "--out={root}/t"], "is not a PyTorch checkpoint"),
  (["import-gpt2", "--hf_dir={root}/empty", "--out={root}/g"], "config.json' not found"),
  (["tokenizer", "--out={root}/tok", "--vocab_size=100"], "multiple of 128"),
  (["tokenizer", "--out={root}/tok", "--corpus={root}/nowhere.txt"], "no such file"),
  (["tokenizer", "--out={root}/tok", "--corpus=nocorpus"], "neither a dataset name"),
  (["tokenizer", "--out={root}/full"], "exists and is not an empty directory"),
  (["compile", TINY], "missing --topology"),
  (["compile", TINY, "--topology=bogus"], "--topology='bogus': expected GENERATION:SHAPE"),
  (["compile", TINY, "--topology=v5e:1", "--steps=8"], "--steps do not apply to --program=train"),
  (
    ["compile", TINY, "--topology=v5e:1", "--program=sample", "--steps=0"],
    "--steps=0 and --batch_size=4 must be >= 1",
  ),
  (["compile", TINY, "--topology=v5e:1", "--program=sample", "--dtype=float16"], "--dtype"),
  (["bench", "train", TINY, "--dtype=bfloat16"], "applies to `ao-mdm bench sample` only"),
  (["sample", "--checkpoint={run}", "--dtype=int8"], "--dtype"),
  # issue 43: --batch_size below 1 named with its range before the model loads, every command
  (
    ["eval", "--checkpoint={run}", "--infill_file={root}/blank.jsonl", "--batch_size=0"],
    "flag --batch_size=0: 0 is not a positive integer",
  ),
  (
    ["eval", "--checkpoint={run}", "--infill_file={root}/blank.jsonl", "--batch_size=-2"],
    "flag --batch_size=-2: -2 is not a positive integer",
  ),
  (["sample", "--checkpoint={run}", "--batch_size=0"], "flag --batch_size=0"),
  (
    ["train", TINY, "--workdir={root}/w", "--profile={root}/p"],
    "--profile not accepted by `ao-mdm train`: a jax.profiler trace of train steps is "
    "--config.train.profile_steps=N",
  ),
  # what a new user met (issue 33): each one line, nothing written
  (
    ["compile", TINY, "--topology=v5e:2x2", "--program=sample"],
    "--topology=v5e:2x2 has 4 chips; --program=sample compiles the sampler for one chip",
  ),
  (["train", TINY, "--workdir={root}/ckfile"], "checkpoints is a file, where a run keeps"),
  (["train", TINY, "--workdir={root}/tokfile"], "tokenizer is a file, where a run keeps"),
  (
    ["train", "--config={root}/misspelt.py", "--workdir={root}/w"],
    "sets train.num_step, which is no config key; did you mean train.num_steps?",
  ),
  (["sample", "--checkpoint={head}"], "is a draft head (written by `ao-mdm train-draft`)"),
  (["eval", "--checkpoint={head}"], "pass it as --draft_head="),
  (
    ["prepare", TINY, "--workdir={root}/w", "--splits=train,valid"],
    "dataset 'sotu' has no split 'valid'",
  ),
  (["info", "--config={root}/a_file"], "is not a Python config file"),
  (["import-torch", "--checkpoint={root}/empty", "--out={root}/t"], "is a directory; give"),
  (["sample", "--checkpoint={run}/checkpoints/2"], "is inside a training work dir; give the work"),
  (["export", "--checkpoint={run}/checkpoints", "--out={root}/e"], "give the work dir itself"),
  (
    ["train", TINY, "--workdir={root}/w", "--config.data.prepared_dir={root}/a_file/prep"],
    "cannot be made: '{root}/a_file' is a file",
  ),
  (["bench", "sample", TINY], "has no `bench` section, which `ao-mdm bench sample` reads"),
  (
    ["bench", "sample", "--config=configs/bench_sampler.py", "--config.bench.steps=(16,4096)"],
    "[4096] outside [1, 1024]",
  ),
  (["sample", "--checkpoint=gs:/bucket/run"], "did you mean gs://BUCKET/PATH?"),
  # what a new user met (issue 58): pairs and the reward checked before anything is written
  (
    [
      "train",
      TINY,
      "--workdir={root}/w",
      "--init_from={export}",
      "--config.data.pairs={root}/not_json.jsonl",
    ],
    "not_json.jsonl, line 1: ",
  ),
  (
    ["train", TINY, "--workdir={root}/w", "--config.data.pairs={root}/latin1.txt"],
    "latin1.txt' is not UTF-8 text",
  ),
  (
    ["train", TINY, "--workdir={root}/w", "--config.data.pairs={root}/no_role.jsonl"],
    "no_role.jsonl, line 1: messages[0] has no role",
  ),
  (
    [
      "train",
      "--config=configs/grpo.py",
      "--workdir={root}/w",
      "--init_from={export}",
      "--config.grpo.reward=notamodulepath",
    ],
    "grpo.reward='notamodulepath'",
  ),
]


def _snapshot(root: str) -> dict:
  """Every directory and file under root with each file's hash: what a refused command must keep."""
  out = {}
  for d, dirs, names in os.walk(root):
    out.update({os.path.join(d, name): "dir" for name in dirs})
    for name in names:
      path = os.path.join(d, name)
      with open(path, "rb") as f:
        out[path] = hashlib.sha1(f.read()).hexdigest()
  return out


@pytest.mark.slow  # about 55 processes (two minutes here)
def test_every_bad_input_gives_one_error_line_and_changes_nothing(files):
  assert len(BAD_INPUTS) >= 40
  before = _snapshot(files["root"])
  cases = [
    ([a.format(**files) for a in args], message.format(**files)) for args, message in BAD_INPUTS
  ]

  def timed(case):
    with printed_time(" ".join(case[0])):
      return ao_mdm(*case[0])

  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    outs = list(pool.map(timed, cases))
  failures = []
  for (args, message), out in zip(cases, outs):
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    if (
      out.returncode == 0
      or "Traceback" in out.stderr
      or len(errors) != 1
      or message not in errors[0]
    ):
      failures.append(f"{' '.join(args)}\n  rc={out.returncode} stderr={out.stderr[-600:]!r}")
  assert not failures, "\n".join(failures)
  after = _snapshot(files["root"])
  assert after == before, sorted(set(after.items()) ^ set(before.items()))


@pytest.mark.slow  # reads the module's trained run
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_step(files, tmp_path):
  run = str(tmp_path / "run")
  shutil.copytree(files["run"], run)
  for d, _, names in os.walk(os.path.join(run, "checkpoints", "2", "ema")):  # what export reads
    for name in names:
      with open(os.path.join(d, name), "wb") as f:
        f.write(b"garbage")
  out = ao_mdm("export", f"--checkpoint={run}", f"--out={tmp_path / 'export'}")
  assert out.returncode == 0, out.stderr
  assert "skipped checkpoint step 2" in out.stdout and "cannot be restored" in out.stdout
  _, exported = checkpoints.load_params(str(tmp_path / "export"))
  shutil.rmtree(os.path.join(run, "checkpoints", "2"))
  _, step1 = checkpoints.load_params(run)
  for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(step1), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # reads the module's trained run
def test_sample_reads_the_run_quietly_and_writes_nothing_into_it(files, tmp_path):
  before = _snapshot(files["run"])
  path = tmp_path / "new" / "dir" / "samples.jsonl"  # missing directories are made
  out = ao_mdm(
    "sample",
    f"--checkpoint={files['run']}",
    "--steps=8",
    "--num_samples=2",
    "--batch_size=1",
    "--prompt=The Congress",
    f"--out={path}",
    f"--profile={tmp_path / 'profile'}",
  )
  assert out.returncode == 0, out.stderr
  assert len(list((tmp_path / "profile").glob("plugins/profile/*/*_0.xplane.pb"))) == 1
  assert f"wrote a profile to {tmp_path / 'profile'}" in out.stdout
  assert _snapshot(files["run"]) == before
  assert "WARNING" not in out.stderr and "Traceback" not in out.stderr, out.stderr
  records = [json.loads(line) for line in path.read_text().splitlines()]
  assert len(records) == 2 and all(r["text"].startswith("The Congress") for r in records)
  assert all(r["marked"].startswith("The Congress[[") for r in records)
  assert "--- sample 1" in out.stdout and "The Congress[[" in out.stdout
  # The unknown positions after a prompt go left to right unless --order says otherwise.
  assert all(r["order"] == "l2r" for r in records) and "l2r order" in out.stdout
  assert os.listdir(path.parent) == ["samples.jsonl"]  # no .partial left


@pytest.mark.slow  # reads the module's trained run
def test_sample_texts_library_call(files):
  """The library function behind `ao-mdm sample`: batches, prompt kept, ids within the vocab."""
  from ao_mdm.data import tokenizer as tok_lib
  from ao_mdm.decode import generate

  config, params = checkpoints.load_params(files["export"])
  tokenizer = tok_lib.load_saved_tokenizer(config.data, config.model.vocab_size, files["export"])
  prompt_ids = tokenizer.encode("We the people")
  calls = []
  records = list(
    generate.sample_texts(
      params,
      config.model,
      tokenizer,
      num_samples=3,
      batch_size=2,
      prompt="We the people",
      steps=4,
      progress=calls.append,
    )
  )
  assert len(records) == 3 and calls == [1, 1]
  for r in records:
    assert r["tokens"][: len(prompt_ids)] == prompt_ids
    assert r["order"] == "l2r"  # the default after a prompt (the authors' cond_generate)
    assert len(r["tokens"]) == config.model.block_size and max(r["tokens"]) < tokenizer.vocab_size


@pytest.mark.slow  # reads the module's trained run
@pytest.mark.parametrize("mode", ["parallel", "speculative", "confidence"])
def test_an_infill_ends_at_its_text(files, mode):
  """Only the [MASK] spans are drawn: the record ends where the text ends (a text ending in
  [MASK] is continued by --infill_span tokens), the known tokens where the text puts them."""
  from ao_mdm.data import tokenizer as tok_lib
  from ao_mdm.decode import generate

  config, params = checkpoints.load_params(files["export"])
  tokenizer = tok_lib.load_saved_tokenizer(config.data, config.model.vocab_size, files["export"])
  head, tail = tokenizer.encode("We the "), tokenizer.encode(" of the Union.")
  steps = {} if mode == "speculative" else {"steps": 3}
  for infill, span, length in [
    ("We the [MASK] of the Union.", 4, len(head) + 4 + len(tail)),
    ("We the [MASK]", 5, len(head) + 5),
  ]:
    records = list(
      generate.sample_texts(
        params,
        config.model,
        tokenizer,
        num_samples=2,
        batch_size=2,
        infill=infill,
        infill_span=span,
        mode=mode,
        temperature=0,
        **steps,
      )
    )
    assert length < config.model.block_size
    for r in records:
      assert len(r["tokens"]) == length and r["tokens"][: len(head)] == head
      if infill.endswith("Union."):
        assert r["tokens"][-len(tail) :] == tail and r["marked"].endswith("]] of the Union."), r[
          "marked"
        ]
      else:
        assert r["marked"].startswith("We the [[") and r["marked"].endswith("]]")


def test_a_missing_extra_is_refused_before_anything_is_written(tmp_path):
  """train.wandb_project without wandb installed (hidden here) fails at once, no file written."""
  workdir = tmp_path / "w"
  code = (
    "import sys; sys.modules['wandb'] = None; from ao_mdm.cli import main; "
    f"sys.argv = ['ao-mdm', 'train', '{TINY}', '--workdir={workdir}', "
    "'--config.train.wandb_project=p']; main.run()"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 2 and out.stderr.splitlines() == [
    "error: config.train.wandb_project='p' needs wandb, which is not installed: pip install -e "
    "'.[wandb]'"
  ], out.stderr
  assert not workdir.exists()
  helped = ao_mdm("train", "--help")
  assert (
    "no --profile: a jax.profiler trace of train steps is --config.train.profile_steps=N"
    in helped.stdout
  )


def test_serve_refuses_a_missing_extra_a_taken_port_and_a_bad_host_before_loading(eos_export):
  """Each in about a second, before the model loads: one error line, exit 2."""
  import socket

  path = eos_export[0]
  hidden = (
    "import sys; sys.modules['uvicorn'] = None; from ao_mdm.cli import main; "
    f"sys.argv = ['ao-mdm', 'serve', '--checkpoint={path}']; main.run()"
  )
  out = subprocess.run(
    [sys.executable, "-c", hidden], capture_output=True, text=True, timeout=120, cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  assert out.returncode == 2 and out.stderr.splitlines() == [
    "error: ao-mdm serve needs uvicorn, which is not installed: pip install -e '.[serve]'"
  ], out.stderr
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    for flags, message in [
      ([f"--port={port}"], f"cannot listen at --host=127.0.0.1 --port={port}: Address already"),
      (["--host=no.such.host.invalid"], "--host='no.such.host.invalid' is not an address"),
    ]:
      start = time.monotonic()
      out = ao_mdm("serve", f"--checkpoint={path}", *flags)
      errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
      assert out.returncode == 2 and len(errors) == 1 and message in errors[0], out.stderr
      assert "Traceback" not in out.stderr and time.monotonic() - start < 30


@pytest.mark.slow  # a short training run (about 30 s here)
def test_a_step_that_is_not_finite_stops_the_run_before_it_is_saved(tmp_path):
  """A learning rate that blows up at step 3: one error line naming it, exit 2, and only the
  finite checkpoint of step 2 on disk."""
  workdir = tmp_path / "w"
  out = ao_mdm(
    "train", TINY, f"--workdir={workdir}", "--config.train.learning_rate=1e12",
    "--config.train.num_steps=6", "--config.train.checkpoint_every=2",
    "--config.train.log_every=4", "--config.train.eval_every=0",
  )  # fmt: skip
  errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
  assert len(errors) == 1 and errors[0].startswith("error: step 3: the loss is nan"), errors
  assert "the last checkpoint is step 2" in errors[0]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
  _, params, _ = checkpoints.load_run(str(workdir), "params", log=lambda _: None)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def _unused_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # about 14 s, most of it waiting on a join that cannot happen
@pytest.mark.alone
def test_unreachable_coordinator_gives_up_in_time_and_ctrl_c_works(tmp_path):
  workdir = tmp_path / "w"
  joining = [
    "train",
    TINY,
    f"--workdir={workdir}",
    "--num_processes=2",
    "--process_id=1",
    f"--coordinator=127.0.0.1:{_unused_port()}",
  ]
  start = time.time()
  out = ao_mdm(*joining, "--init_timeout=3", timeout=120)
  errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
  assert out.returncode == 2 and time.time() - start < 60 and "Traceback" not in out.stderr
  assert len(errors) == 1 and "no answer from 127.0.0.1:" in errors[0] and "within 3 s" in errors[0]
  proc = subprocess.Popen(
    [sys.executable, "-m", "ao_mdm.cli.main", *joining, "--init_timeout=300"],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  time.sleep(8)  # well inside the join
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=30)
  assert proc.returncode == 130 and "Traceback" not in err, err
  assert not workdir.exists()


def test_an_absent_platform_is_one_error_line():
  out = subprocess.run(
    [sys.executable, "-m", "ao_mdm.cli.main", "info", TINY],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "tpu"},
  )
  if os.path.exists("/dev/accel0"):
    pytest.skip("this host has a TPU")
  assert out.returncode == 2 and out.stderr.splitlines() == [
    "error: JAX_PLATFORMS='tpu', but this host has no TPU (no /dev/accel* or /dev/vfio/[0-9]*); "
    "unset it or set JAX_PLATFORMS=cpu"
  ]


def test_help_forms_and_a_closed_pipe():
  out = ao_mdm("help", "sample")
  assert out.returncode == 0 and out.stdout.startswith("usage: ao-mdm sample")
  proc = subprocess.run(
    f"{sys.executable} -m ao_mdm.cli.main --help | head -1",
    shell=True,
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=60,
  )
  assert proc.stdout.startswith("usage: ao-mdm") and "Traceback" not in proc.stderr


def test_tokenizer_errors_leave_nothing_behind(tmp_path):
  tfds_dir = tmp_path / "tfds"
  (tmp_path / "one.txt").write_text("only one line\n")
  (tmp_path / "two.txt").write_text("a first line of text\nand a second one\n")
  (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)) * 4)
  os.mkfifo(tmp_path / "fifo")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TFDS_DATA_DIR": str(tfds_dir)}
  cases = [
    (["--corpus=" + str(tmp_path / "one.txt")], "has 1 document(s); at least 2"),
    (["--corpus=" + str(tmp_path / "binary.txt")], "is not UTF-8 text"),
    (["--corpus=" + str(tmp_path / "fifo")], "is not a regular file"),
    (
      ["--corpus=" + str(tmp_path / "two.txt"), "--vocab_size=1000064"],
      "cannot train a vocab of 1000064 on this corpus: Vocabulary size too high",
    ),
  ]
  for args, message in cases:
    out = subprocess.run(
      [sys.executable, "-m", "ao_mdm.cli.main", "tokenizer", f"--out={tmp_path / 'tok'}", *args],
      capture_output=True,
      text=True,
      timeout=120,
      cwd=ROOT,
      env=env,
    )
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(errors) == 1 and message in errors[0], out.stderr
    assert not (tmp_path / "tok").exists()
  # Only the two-line corpus was converted; the failed conversions left no directory.
  from ao_mdm.data import datasets

  assert os.listdir(tfds_dir / "text_file") == [
    "h" + datasets.text_source_hash(str(tmp_path / "two.txt"))
  ]


@pytest.mark.slow  # two exports in processes of their own (about 17 s)
def test_verbosity_brings_the_libraries_logs_back(files):
  """Quiet by default; absl's --verbosity=0 shows the libraries' INFO and WARNING lines."""
  quiet = ao_mdm("export", f"--checkpoint={files['run']}", f"--out={files['root']}/v1")
  loud = ao_mdm(
    "export", f"--checkpoint={files['run']}", f"--out={files['root']}/v2", "--verbosity=0"
  )
  assert quiet.returncode == 0 and loud.returncode == 0, loud.stderr[-2000:]
  library = lambda out: [s for s in out.stderr.splitlines() if s[:1] in "IW" and ".py:" in s]
  assert not library(quiet) and any("checkpoint_manager.py" in s for s in library(loud))
