"""The lm-evaluation-harness model "ao_mdm": tasks over local JSON-lines files run through
lm_eval.simple_evaluate, their numbers equal to our own L2R scorer; rolling windows, infill
requests, greedy generation against a naive loop, the `ao-mdm harness` command."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval import tasks as lm_tasks  # pylint: disable=g-import-not-at-top,wrong-import-position
from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top,wrong-import-position

from ao_mdm.checkpoint import checkpoints  # pylint: disable=wrong-import-position
from ao_mdm.config import base_config  # pylint: disable=wrong-import-position
from ao_mdm.eval import infill  # pylint: disable=wrong-import-position
from ao_mdm.eval import scoring  # pylint: disable=wrong-import-position
from ao_mdm.interop import harness  # pylint: disable=wrong-import-position
from ao_mdm import model as model_lib  # pylint: disable=wrong-import-position
from ao_mdm import specs  # pylint: disable=wrong-import-position
from ao_mdm.train import loop  # pylint: disable=wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 32
QUESTIONS = [  # the harness puts a space (its target_delimiter) between question and choice
    {"question": "We hold these truths to be", "choices": ["self-evident", "blue", "taxes"],
     "answer": 0},
    {"question": "The state of the Union", "choices": ["is strong.", "of the", "and"],
     "answer": 1},
    {"question": "Fellow citizens of the Senate and House of Representatives: it is my duty "
                 "to give you information on the state of the",
     "choices": ["Union", "weather for the coming year and the one after it", "Congress"],
     "answer": 0},
]
DOCUMENT = ("Fellow citizens of the Senate and House of Representatives. " * 12).strip()
INFILL = [{"prefix": "We hold these truths to be", "suffix": ", that all men are created equal.",
           "choices": [" self-evident", " blue", " uncertain"], "answer": 0}]


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
  files = {"mc": QUESTIONS, "docs": [{"text": DOCUMENT}, {"text": "Thank you."}],
           "infill": INFILL}
  for name, records in files.items():
    (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
  (d / "mc.yaml").write_text(
      "task: local_mc\n" + common.format(d / "mc.jsonl") + "output_type: multiple_choice\n"
      "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
      "metric_list:\n  - metric: acc\n")
  (d / "docs.yaml").write_text(
      "task: local_docs\n" + common.format(d / "docs.jsonl") +
      "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
      "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
  (d / "infill.yaml").write_text(
      "task: local_infill\n" + common.format(d / "infill.jsonl") +
      "output_type: multiple_choice\ndoc_to_text: '{{prefix}}[MASK]{{suffix}}'\n"
      "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
      "target_delimiter: ''\nmetric_list:\n  - metric: acc\n")
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
  return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, bootstrap_iters=0,
                                 log_samples=True)


def _l2r_logprob(scorer, ids: list, n: int) -> float:
  """log p of the last n of `ids` (at most T) under our own L2R scorer, the block padded."""
  row = np.zeros((1, T), np.int32)
  row[0, :len(ids)] = ids
  return -float(scoring.l2r_nll(scorer, row)[0, len(ids) - n:len(ids)].sum())


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
      want += _l2r_logprob(scorer, seq[max(0, end + 1 - T):end + 1], end - start)
    np.testing.assert_allclose(sample["resps"][0][0], want, rtol=1e-5)
  assert len(tok.encode(DOCUMENT)) > 3 * T
  words = sum(len(t.split()) for t in [DOCUMENT, "Thank you."])
  total = sum(s["resps"][0][0] for s in samples)
  assert out["results"]["local_docs"]["word_perplexity,none"] == pytest.approx(
      np.exp(-total / words), rel=1e-6)


def test_an_infill_context_is_scored_given_both_sides(lm, tasks, run):
  scorer, tok, _, _ = run
  out = _evaluate(lm, tasks, ["local_infill"])
  sample = out["samples"]["local_infill"][0]
  r = INFILL[0]
  want = [-float(n.sum()) for n in infill.infill_nll(scorer, [
      (tok.encode(r["prefix"]), tok.encode(c), tok.encode(r["suffix"])) for c in r["choices"]])]
  np.testing.assert_allclose([x[0][0] for x in sample["resps"]], want, rtol=1e-5)
  l2r = [lm.loglikelihood([Instance("loglikelihood", {}, (r["prefix"], c), 0)])[0][0]
         for c in r["choices"]]
  assert not np.allclose(l2r, want)  # the suffix is seen


def test_greedy_generation_equals_a_naive_argmax_loop(lm, run):
  scorer, tok, params, config = run
  model = model_lib.make_model(config.model)
  for context, new in (("We hold these truths", 8), ("", 5)):
    got = lm.generate_until([Instance("generate_until", {}, (context, {"max_gen_toks": new}),
                                      0)])[0]
    ids = tok.encode(context) or [tok.eos_id]
    start = len(ids)
    while len(ids) < start + new:
      row = np.zeros((1, T), np.int32)
      row[0, :len(ids)] = ids
      logits = model.apply({"params": params}, jnp.asarray(row), jnp.arange(T)[None])
      ids.append(int(np.argmax(np.asarray(logits)[0, len(ids), :tok.vocab_size])))
      if ids[-1] == tok.eos_id:
        ids.pop()
        break
    assert got == lm.tok_decode(ids[start:]), (context, got)
    stop = got[len(got) // 2:][:2]
    if stop:  # a stop string cuts the text before it
      cut = lm.generate_until([Instance("generate_until", {}, (context, {
          "max_gen_toks": new, "until": [stop]}), 0)])[0]
      assert cut == got[:got.index(stop)]
  del scorer


def test_parallel_generation_and_errors(checkpoint, lm):
  par = harness.AoMdm(checkpoint, mode="parallel", steps=4)
  out = par.generate_until([Instance("generate_until", {}, ("We hold", {"max_gen_toks": 6}), 0)])
  assert isinstance(out[0], str) and len(par.tok_encode(out[0])) <= 8
  with pytest.raises(ValueError, match=r"mode='beam'; accepted: l2r, parallel"):
    harness.AoMdm(checkpoint, mode="beam")
  with pytest.raises(ValueError, match=r"max_gen_toks=32 must be in \[1, 31\]"):
    lm.generate_until([Instance("generate_until", {}, ("a", {"max_gen_toks": 32}), 0)])
  with pytest.raises(ValueError, match="continuation of 40 tokens is longer than the model's"):
    lm._loglikelihood_tokens([(("a", "b"), [1], [5] * 40)])  # pylint: disable=protected-access


@pytest.mark.slow  # two harness processes (about 25 s)
def test_the_harness_command(checkpoint, tasks, tmp_path, lm):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1"}
  out = tmp_path / "results.json"
  proc = subprocess.run([sys.executable, "-m", "ao_mdm.cli.main", "harness",
                         f"--checkpoint={checkpoint}", "--tasks=local_mc,local_docs",
                         f"--include_path={tasks}", "--bootstrap_iters=0", f"--out={out}"],
                        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  want = _evaluate(lm, tasks, ["local_mc", "local_docs"])["results"]
  for task, metric in (("local_mc", "acc,none"), ("local_docs", "word_perplexity,none")):
    assert summary["results"][task][metric] == pytest.approx(want[task][metric], rel=1e-6)
  assert json.loads(out.read_text())["results"]["local_mc"]["acc,none"] == pytest.approx(
      want["local_mc"]["acc,none"])
  assert "|local_mc" in proc.stdout and "Traceback" not in proc.stderr
  bad = subprocess.run([sys.executable, "-m", "ao_mdm.cli.main", "harness",
                        f"--checkpoint={checkpoint}", "--tasks=no_such_task",
                        f"--include_path={tasks}"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=env)
  assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
      "error: --tasks: unknown task(s) no_such_task;"), bad.stderr[-2000:]


@pytest.mark.slow
def test_lm_eval_command_line_finds_the_model(checkpoint, tasks, tmp_path):
  """`python -m ao_mdm.interop.harness` is lm_eval's own command line with "ao_mdm" known."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1"}
  proc = subprocess.run([sys.executable, "-m", "ao_mdm.interop.harness", "run", "--model",
                         "ao_mdm", "--model_args", f"checkpoint={checkpoint}", "--batch_size=4",
                         "--tasks", "local_mc", "--include_path", tasks, "--output_path",
                         str(tmp_path / "out")], capture_output=True,
                        text=True, timeout=300, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "local_mc" in proc.stdout and "acc" in proc.stdout
