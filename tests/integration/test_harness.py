"""The lm-evaluation-harness model "ao_mdm": tasks over local JSON-lines files run through
lm_eval.simple_evaluate, their numbers equal to our own L2R scorer; rolling windows, infill
requests, greedy generation against a naive loop, the `ao-mdm harness` command; bad task data
and values refused before a model loads; both command lines quiet."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval import tasks as lm_tasks
from lm_eval.api.instance import Instance

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.checkpoint import checkpoints
from ao_mdm.config import base_config
from ao_mdm.eval import infill, scoring
from ao_mdm.interop import harness
from ao_mdm.train import loop
from helpers import ROOT

T = 32
QUESTIONS = [  # the harness puts a space (its target_delimiter) between question and choice
  {
    "question": "We hold these truths to be",
    "choices": ["self-evident", "blue", "taxes"],
    "answer": 0,
  },
  {"question": "The state of the Union", "choices": ["is strong.", "of the", "and"], "answer": 1},
  {
    "question": "Fellow citizens of the Senate and House of Representatives: it is my duty "
    "to give you information on the state of the",
    "choices": ["Union", "weather for the coming year and the one after it", "Congress"],
    "answer": 0,
  },
]
DOCUMENT = ("Fellow citizens of the Senate and House of Representatives. " * 12).strip()
INFILL = [
  {
    "prefix": "We hold these truths to be",
    "suffix": ", that all men are created equal.",
    "choices": [" self-evident", " blue", " uncertain"],
    "answer": 0,
  }
]


@pytest.fixture(scope="module")
def checkpoint(data_dir, tmp_path_factory):
  c = base_config()
  c.model.update(vocab_size=512, block_size=T, n_layer=2, n_embd=32, n_head=2)
  c.train.update(batch_size=8, num_steps=2, warmup_steps=1, eval_batches=1, eval_every=0)
  c.data.tfds_dir = data_dir
  workdir = str(tmp_path_factory.mktemp("harness_run"))
  loop.train_and_evaluate(specs.parse(c), workdir)
  return workdir


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
  """A task directory: multiple choice, rolling perplexity and infill, each over a local file."""
  d = tmp_path_factory.mktemp("tasks")
  files = {"mc": QUESTIONS, "docs": [{"text": DOCUMENT}, {"text": "Thank you."}], "infill": INFILL}
  for name, records in files.items():
    (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
  acc = "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
  (d / "mc.yaml").write_text(
    "task: local_mc\n" + common.format(d / "mc.jsonl") + "output_type: multiple_choice\n"
    "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n" + acc
  )
  (d / "last.yaml").write_text(  # a metric whose standard error the harness bootstraps
    "task: local_last\n" + common.format(d / "mc.jsonl") + "output_type: loglikelihood\n"
    "doc_to_text: '{{question}}'\ndoc_to_target: ' {{choices[answer]}}'\nmetric_list:\n"
    "  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
  )
  (d / "docs.yaml").write_text(
    "task: local_docs\n"
    + common.format(d / "docs.jsonl")
    + "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
    "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
  )
  (d / "infill.yaml").write_text(
    "task: local_infill\n"
    + common.format(d / "infill.jsonl")
    + "output_type: multiple_choice\ndoc_to_text: '{{prefix}}[MASK]{{suffix}}'\n"
    "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
    "target_delimiter: ''\n" + acc
  )
  return str(d)


@pytest.fixture(scope="module")
def run(checkpoint):
  config, params, tokenizer = checkpoints.load_run(checkpoint)
  return scoring.Scorer(params, config.model), tokenizer, params, config


@pytest.fixture(scope="module")
def lm(checkpoint):
  return harness.AoMdm(checkpoint, batch_size=2)


def _evaluate(lm, tasks: str, names: list) -> dict:
  manager = lm_tasks.TaskManager(include_path=tasks, include_defaults=False)
  return lm_eval.simple_evaluate(
    model=lm, tasks=names, task_manager=manager, bootstrap_iters=0, log_samples=True
  )


def _l2r_logprob(scorer, ids: list, n: int) -> float:
  """log p of the last n of `ids` (at most T) under our own L2R scorer, the block padded."""
  row = np.zeros((1, T), np.int32)
  row[0, : len(ids)] = ids
  return -float(scoring.l2r_nll(scorer, row)[0, len(ids) - n : len(ids)].sum())


@pytest.mark.slow  # reads the module's trained run
def test_multiple_choice_equals_our_l2r_scorer(lm, tasks, run):
  scorer, tok, _, _ = run
  out = _evaluate(lm, tasks, ["local_mc"])
  expected_acc = []
  for sample in sorted(out["samples"]["local_mc"], key=lambda s: s["doc_id"]):
    q = QUESTIONS[sample["doc_id"]]
    want = []
    for choice in q["choices"]:
      whole, context = tok.encode(q["question"] + " " + choice), tok.encode(q["question"])
      n = len(whole) - len(context)
      want.append(_l2r_logprob(scorer, whole[-T:], n))  # the context cut on the left
    got = [r[0][0] for r in sample["resps"]]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    expected_acc.append(float(np.argmax(want) == q["answer"]))
  assert len(tok.encode(QUESTIONS[2]["question"] + " " + QUESTIONS[2]["choices"][1])) > T
  assert out["results"]["local_mc"]["acc,none"] == pytest.approx(np.mean(expected_acc))


@pytest.mark.slow  # reads the module's trained run
def test_rolling_loglikelihood_is_the_sum_over_independent_windows(lm, tasks, run):
  scorer, tok, _, _ = run
  out = _evaluate(lm, tasks, ["local_docs"])
  samples = sorted(out["samples"]["local_docs"], key=lambda s: s["doc_id"])
  for sample, text in zip(samples, [DOCUMENT, "Thank you."]):
    ids = tok.encode(text)
    seq = [tok.eos_id] + ids  # token i is seq[i + 1]; EOS before the first
    want = 0.0
    for start in range(0, len(ids), T - 1):  # T - 1 new tokens per window of T slots
      end = min(start + T - 1, len(ids))
      want += _l2r_logprob(scorer, seq[max(0, end + 1 - T) : end + 1], end - start)
    np.testing.assert_allclose(sample["resps"][0][0], want, rtol=1e-5)
  assert len(tok.encode(DOCUMENT)) > 3 * T
  words = sum(len(t.split()) for t in [DOCUMENT, "Thank you."])
  total = sum(s["resps"][0][0] for s in samples)
  assert out["results"]["local_docs"]["word_perplexity,none"] == pytest.approx(
    np.exp(-total / words), rel=1e-6
  )


@pytest.mark.slow  # reads the module's trained run
def test_an_infill_context_is_scored_given_both_sides(lm, tasks, run):
  scorer, tok, _, _ = run
  out = _evaluate(lm, tasks, ["local_infill"])
  sample = out["samples"]["local_infill"][0]
  r = INFILL[0]
  want = [
    -float(n.sum())
    for n in infill.infill_nll(
      scorer,
      [(tok.encode(r["prefix"]), tok.encode(c), tok.encode(r["suffix"])) for c in r["choices"]],
    )
  ]
  np.testing.assert_allclose([x[0][0] for x in sample["resps"]], want, rtol=1e-5)
  l2r = [
    lm.loglikelihood([Instance("loglikelihood", {}, (r["prefix"], c), 0)])[0][0]
    for c in r["choices"]
  ]
  assert not np.allclose(l2r, want)  # the suffix is seen


@pytest.mark.slow  # reads the module's trained run
def test_greedy_generation_equals_a_naive_argmax_loop(lm, run):
  scorer, tok, params, config = run
  model = model_lib.make_model(config.model)
  for context, new in (("We hold these truths", 8), ("", 5)):
    got = lm.generate_until([Instance("generate_until", {}, (context, {"max_gen_toks": new}), 0)])[
      0
    ]
    ids = tok.encode(context) or [tok.eos_id]
    start = len(ids)
    while len(ids) < start + new:
      row = np.zeros((1, T), np.int32)
      row[0, : len(ids)] = ids
      logits = model.apply({"params": params}, jnp.asarray(row), jnp.arange(T)[None])
      ids.append(int(np.argmax(np.asarray(logits)[0, len(ids), : tok.vocab_size])))
      if ids[-1] == tok.eos_id:
        ids.pop()
        break
    assert got == lm.tok_decode(ids[start:]), (context, got)
    stop = got[len(got) // 2 :][:2]
    if stop:  # a stop string cuts the text before it
      cut = lm.generate_until(
        [Instance("generate_until", {}, (context, {"max_gen_toks": new, "until": [stop]}), 0)]
      )[0]
      assert cut == got[: got.index(stop)]
  del scorer


@pytest.mark.slow  # reads the module's trained run
def test_parallel_generation_and_errors(checkpoint, lm):
  par = harness.AoMdm(checkpoint, mode="parallel", steps=4)
  out = par.generate_until([Instance("generate_until", {}, ("We hold", {"max_gen_toks": 6}), 0)])
  assert isinstance(out[0], str) and len(par.tok_encode(out[0])) <= 8
  with pytest.raises(ValueError, match=r"mode='beam'; accepted: l2r, parallel"):
    harness.AoMdm(checkpoint, mode="beam")
  with pytest.raises(ValueError, match=r"max_gen_toks=32 must be in \[1, 31\]"):
    lm.generate_until([Instance("generate_until", {}, ("a", {"max_gen_toks": 32}), 0)])
  with pytest.raises(ValueError, match="continuation of 40 tokens is longer than the model's"):
    lm._loglikelihood_tokens([(("a", "b"), [1], [5] * 40)])


@pytest.fixture(scope="module")
def bad_tasks(tmp_path_factory):
  """Tasks over bad JSON-lines files (before: a 98-line traceback, a StopIteration, and a
  document without its question scored as the text "None"), and one over a good file."""
  d = tmp_path_factory.mktemp("bad_tasks")
  good = [json.dumps(q) + "\n" for q in QUESTIONS]
  files = {
    "good": "".join(good),
    "bad_json": good[0] + "\n" + '{"question": "a", \n' + good[1],
    "empty": "",
    "no_field": "".join(good[:2]) + json.dumps({"choices": ["a"], "answer": 0}) + "\n",
  }
  for name, text in {**files, "relative": None}.items():
    data = "nowhere/relative.jsonl" if text is None else d / f"{name}.jsonl"
    if text is not None:
      data.write_text(text)
    (d / f"{name}.yaml").write_text(
      f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
      "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
      "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
    )
  return d


def test_bad_task_data_is_one_error_naming_the_task_file_and_line(bad_tasks):
  d = bad_tasks
  for task, error, message in (
    ("bad_json", ValueError, f"task bad_json: {d}/bad_json.jsonl line 3 is not JSON \\(Expect"),
    ("empty", ValueError, f"task empty: {d}/empty.jsonl holds no records"),
    (
      "no_field",
      ValueError,
      f"task no_field: {d}/no_field.jsonl line 3 has no field "
      "'question', which its doc_to_text names \\('{{question}}'\\)",
    ),
    (
      "relative",
      FileNotFoundError,
      "task relative: data file 'nowhere/relative.jsonl' not "
      "found \\(a relative path is read from the directory",
    ),
  ):
    with pytest.raises(error, match=message):
      harness.load_tasks([task], str(d))
  _, built = harness.load_tasks(["good"], str(d))
  assert [t.task_name for t in built] == ["good"] and len(built[0].eval_docs) == len(QUESTIONS)


def test_bad_values_and_task_data_are_refused_before_the_model_loads(bad_tasks, tmp_path):
  """One `error:` line, exit 2, nothing on stdout: the checkpoint is a step directory without a
  model, so reaching the model would end otherwise."""
  (tmp_path / "run" / "checkpoints" / "1").mkdir(parents=True)
  for flags, line in (
    (["--tasks=good", "--num_fewshot=-1"], "error: --num_fewshot=-1 must be >= 0"),
    (
      ["--tasks=good", "--limit=2.5"],
      "error: --limit=2.5: give a number of documents (an "
      "integer >= 1) or a fraction of each task (0 < limit < 1)",
    ),
    (
      [f"--include_path={bad_tasks}/good.yaml"],
      f"error: --include_path "
      f"'{bad_tasks}/good.yaml' is a file; give the "
      "directory of your task YAML files",
    ),
    (
      ["--tasks=no_field"],
      f"error: task no_field: {bad_tasks}/no_field.jsonl line 3 has no field 'question'",
    ),
  ):
    proc = subprocess.run(
      [
        sys.executable,
        "-m",
        "ao_mdm.cli.main",
        "harness",
        f"--checkpoint={tmp_path / 'run'}",
        "--tasks=good",
        f"--include_path={bad_tasks}",
        *flags,
      ],
      capture_output=True,
      text=True,
      timeout=300,
      cwd=tmp_path,
    )
    assert proc.returncode == 2 and proc.stdout == "", (flags, proc.stdout, proc.stderr[-2000:])
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(line), proc.stderr


def _quiet_env() -> dict:
  """The user's environment: no JAX_PLATFORMS (libtpu installed, no TPU: our choice of platform
  is tested), offline."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  return {**env, "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.slow  # two harness processes (about 50 s)
def test_the_harness_command(checkpoint, tasks, tmp_path, lm):
  """Run outside the checkout, with a metric the harness bootstraps: nothing on stderr (before:
  JAX's fork warning, "terminated (SIGTERM)" of a worker, git's "fatal: not a git repository",
  libtpu's errors)."""
  out = tmp_path / "results.json"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "ao_mdm.cli.main",
      "harness",
      f"--checkpoint={checkpoint}",
      "--tasks=local_mc,local_docs,local_last",
      f"--include_path={tasks}",
      f"--out={out}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=tmp_path,
    env=_quiet_env(),
  )
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary["results"]["local_last"]["perplexity_stderr,none"] > 0  # the pool's work
  want = _evaluate(lm, tasks, ["local_mc", "local_docs"])["results"]
  for task, metric in (("local_mc", "acc,none"), ("local_docs", "word_perplexity,none")):
    assert summary["results"][task][metric] == pytest.approx(want[task][metric], rel=1e-6)
  assert json.loads(out.read_text())["results"]["local_mc"]["acc,none"] == pytest.approx(
    want["local_mc"]["acc,none"]
  )
  assert "|local_mc" in proc.stdout
  bad = subprocess.run(
    [
      sys.executable,
      "-m",
      "ao_mdm.cli.main",
      "harness",
      f"--checkpoint={checkpoint}",
      "--tasks=local_mx",
      f"--include_path={tasks}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env=_quiet_env(),
  )
  assert bad.returncode == 2 and bad.stdout == "", bad.stdout  # before the model loads
  assert bad.stderr.splitlines() == [
    "error: --tasks: unknown task(s) local_mx; did you mean "
    "local_mc? `python -m ao_mdm.interop.harness ls tasks` lists "
    "them (with --include_path DIR: yours too)"
  ], bad.stderr


@pytest.mark.slow
def test_lm_eval_command_line_finds_the_model(checkpoint, tasks, tmp_path):
  """`python -m ao_mdm.interop.harness` is lm_eval's own command line with "ao_mdm" known; with
  its own lines turned down (its log level, its progress bars), run outside the checkout with a
  metric it bootstraps and --log_samples, only git's line stays on stderr (before: libtpu's
  errors, Orbax's absl warnings, JAX's fork warning)."""
  env = {**_quiet_env(), "LMEVAL_LOG_LEVEL": "WARNING", "TQDM_DISABLE": "1"}
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "ao_mdm.interop.harness",
      "run",
      "--model",
      "ao_mdm",
      "--model_args",
      f"checkpoint={checkpoint}",
      "--batch_size=4",
      "--tasks",
      "local_mc,local_last",
      "--include_path",
      tasks,
      "--log_samples",
      "--output_path",
      str(tmp_path / "out"),
    ],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=tmp_path,
    env=env,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "local_mc" in proc.stdout and "perplexity" in proc.stdout
  assert [
    line for line in proc.stderr.splitlines() if not line.startswith("fatal: not a git repository")
  ] == [], proc.stderr[-3000:]
