"""An ao_mdm checkpoint as a model of lm-evaluation-harness, "ao_mdm" (docs/evaluation.md, "The
harness"), scored exactly: AO-GPT is a causal model in every order, so a likelihood is one
forward, never an estimate.

- loglikelihood: left to right, a batch of requests per forward, each (context, continuation)
  in the T slots with the context cut on the left to fit. A context holding one [MASK] is an
  infill: the continuation is scored given the text on both sides (eval/infill.py).
- loglikelihood_rolling: the harness's windows with one token of context each (EOS before the
  first), T - 1 new tokens per window of T slots.
- generate_until: the cached decoders, L2R (exact sequential samples; greedy unless the task
  samples) or the parallel sampler in `steps` steps; the decoder stops at an EOS, the text
  also at the task's `until`.

Needs the `[harness]` extra. `register()` makes the name known to the harness (the `ao-mdm
harness` command and `python -m ao_mdm.interop.harness`, the harness's own command line, do);
`load_tasks` builds and checks tasks before a model loads.
"""

from collections.abc import Callable, Sequence
import difflib
import logging
import multiprocessing
import os
import sys
import time

import jinja2.meta
from lm_eval import utils as lm_utils
from lm_eval.api import registry
from lm_eval.api.model import TemplateLM
import numpy as np

from ao_mdm import model as model_lib
from ao_mdm import sharding
from ao_mdm.checkpoint import checkpoints
from ao_mdm.decode import common, policies, text
from ao_mdm.decode import options as options_lib
from ao_mdm.eval import infill, scoring
from ao_mdm.runtime import quiet
from ao_mdm.storage import fs, paths

NAME = "ao_mdm"
MODES = ("l2r", "parallel")  # generate_until's decoder: speculative in L2R order, or parallel
TEMPLATES = ("doc_to_text", "doc_to_target", "doc_to_choice")  # a task's, naming documents' fields


class AoMdm(TemplateLM):
  """lm-evaluation-harness model of an ao_mdm training work dir or export (`checkpoint`).

  weights: ema | params (of a work dir); dtype: float32 (default) | bfloat16; batch_size:
  requests per forward; mode, steps, draft, seed, max_gen_toks: generation (steps=0: the
  decode/options default). The harness's `device` and `max_batch_size` are accepted and unused
  (JAX places the model on every local device). `log` gets a line per batch of requests.
  """

  def __init__(
    self,
    checkpoint: str,
    weights: str = "ema",
    dtype: str = "float32",
    batch_size: int | str = 8,
    mode: str = "l2r",
    steps: int = 0,
    draft: int = 4,
    seed: int = 0,
    max_gen_toks: int = 256,
    device: str | None = None,
    max_batch_size: int | None = None,
    log: Callable[[str], None] = lambda line: None,
  ):
    super().__init__()
    del device, max_batch_size
    options_lib.check_choice("mode", mode, MODES)
    if dtype not in model_lib.DTYPES:
      raise ValueError(f"dtype={dtype!r}; accepted: {', '.join(model_lib.DTYPES)}")
    batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
    for name, value, low in (
      ("batch_size", batch_size, 1),
      ("steps", int(steps), 0),
      ("draft", int(draft), 1),
      ("max_gen_toks", int(max_gen_toks), 1),
    ):
      if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    config, params, self.tokenizer_ = checkpoints.load_run(
      checkpoint, weights, log=log, shardings=lambda c: sharding.param_shardings(c.model, c.mesh)
    )
    self.scorer = scoring.Scorer(params, config.model, config.mesh, dtype=dtype)
    self._params, self._cfg = common.with_dtype(params, config.model, dtype)
    self._dtype, self._batch_size, self._mode = dtype, batch_size, mode
    self._steps, self._draft, self._seed = int(steps), int(draft), int(seed)
    self._max_gen_toks, self._log = int(max_gen_toks), log

  @property
  def eot_token_id(self) -> int:
    return int(self.tokenizer_.eos_id)

  @property
  def max_length(self) -> int:
    return self.scorer.block_size

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    del add_special_tokens, kwargs  # our tokenizers add no special tokens
    return list(self.tokenizer_.encode(string))

  def tok_decode(self, ids: Sequence[int]) -> str:
    return text.decode_text(
      self.tokenizer_.decode, ids, self.eot_token_id, self.tokenizer_.vocab_size
    )

  def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    del disable_tqdm  # tokenizing takes no time worth a progress bar
    return super().loglikelihood(requests, disable_tqdm=True)

  def _loglikelihood_tokens(
    self, requests: list, disable_tqdm: bool = False, **kwargs
  ) -> list[tuple[float, bool]]:
    """(log p(continuation | context), greedy) per request ((context, continuation), context
    ids, continuation ids); a context with one [MASK] is scored as an infill."""
    del disable_tqdm, kwargs
    items = []
    for (context, continuation), context_ids, continuation_ids in requests:
      if context.count(text.MASK) == 1:
        prefix, suffix = context.split(text.MASK)
        span = self.tok_encode(continuation)
        if not span:
          raise ValueError(f"an infill request has an empty continuation: {continuation!r}")
        items.append((self.tok_encode(prefix), span, self.tok_encode(suffix)))
      else:
        items.append((context_ids, continuation_ids, []))
    return [(-float(nll.sum()), bool(greedy.all())) for nll, greedy in self._scores(items)]

  def _scores(self, items: list) -> list:
    for number, (_, span, _) in enumerate(items, 1):
      if len(span) > self.max_length:
        raise ValueError(
          f"request {number}: its continuation of {len(span)} tokens is longer "
          f"than the model's T={self.max_length}"
        )
    start = time.monotonic()
    out = infill.span_scores(self.scorer, items, batch_size=self._batch_size)
    self._log(
      f"scored {len(items)} requests ({sum(len(s) for _, s, _ in items):,} tokens) in "
      f"{time.monotonic() - start:.1f} s"
    )
    return out

  def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
    """log p(document) of each request's text, summed over the harness's rolling windows."""
    del disable_tqdm
    windows: list[tuple] = []
    owner: list[int] = []
    for number, (string,) in enumerate(req.args for req in requests):
      for context, continuation in map(
        lm_utils.make_disjoint_window,
        lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string),
          prefix_token=self.eot_token_id,
          max_seq_len=self.max_length - 1,
          context_len=1,
        ),
      ):
        windows.append((context, continuation, []))
        owner.append(number)
    totals = np.zeros(len(requests))
    for number, (nll, _) in zip(owner, self._scores(windows)):
      totals[number] -= nll.sum()
    return totals.tolist()

  def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
    """Each request's continuation of its context, up to EOS, a string of `until` (cut off) or
    `max_gen_toks` tokens; greedy unless `do_sample` (temperature, top_p, top_k honoured)."""
    del disable_tqdm
    start = time.monotonic()
    out = [
      self._generate(context, dict(gen_kwargs), self._seed + number)
      for number, (context, gen_kwargs) in enumerate(req.args for req in requests)
    ]
    self._log(f"generated {len(out)} continuations in {time.monotonic() - start:.1f} s")
    return out

  def _generate(self, context: str, kwargs: dict, seed: int) -> str:
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    new = int(kwargs.get("max_gen_toks", self._max_gen_toks))
    t = self.max_length
    if not 1 <= new < t:
      raise ValueError(
        f"max_gen_toks={new} must be in [1, {t - 1}] (T - 1: one slot for the context)"
      )
    sampled = kwargs.get("do_sample", False)
    draw = dict(
      temperature=float(kwargs.get("temperature", 1.0)) if sampled else 0.0,
      top_p=float(kwargs.get("top_p", 1.0)) if sampled else 1.0,
      top_k=int(kwargs.get("top_k", 0) or 0) if sampled else 0,
    )
    ids = (self.tok_encode(context) or [self.eot_token_id])[-(t - new) :]
    known = dict(
      batch_size=1,
      seed=seed,
      known_positions=np.arange(len(ids)),
      known_tokens=ids,
      dtype=self._dtype,
      eos_id=self.eot_token_id,
      vocab_limit=min(self.tokenizer_.vocab_size, self._cfg.vocab_size),
      **draw,
    )
    if self._mode == "l2r":
      out = policies.get("speculative").sample(
        self._params, self._cfg, draft=min(self._draft, t - 1), order="l2r", **known
      )
    else:
      steps = self._steps or options_lib.DEFAULT_STEPS
      out = policies.get("parallel").sample(
        self._params, self._cfg, steps=min(steps, t - len(ids)), **known
      )
    row = out.tokens[0, len(ids) : len(ids) + new].tolist()  # the decoder stopped at an EOS
    row = row[: row.index(self.eot_token_id)] if self.eot_token_id in row else row
    generated = self.tok_decode(row)
    for stop in until:
      if stop and stop in generated:
        generated = generated[: generated.index(stop)]
    return generated


def load_tasks(names: Sequence[str], include_path: str | None = None) -> tuple:
  """(TaskManager, tasks for simple_evaluate) of the harness's tasks `names`, yours in the
  directory `include_path` too, built before a model loads. An unknown name, a JSON-lines data
  file missing, empty or not JSON, or a document without a field a template names is one error
  naming the task, the file and the line."""
  from lm_eval.tasks import TaskManager

  manager = None
  if include_path:  # the harness's own 14,000 task files not read when yours are all it needs
    manager = TaskManager(include_path=include_path, include_defaults=False)
    if not all(n in manager.all_subtasks or n in manager.all_tags for n in names):
      manager = None
  manager = manager or TaskManager(include_path=include_path)
  unknown = [n for n in names if n not in manager.all_tasks]
  if unknown:
    close = {c for n in unknown for c in difflib.get_close_matches(n, manager.all_tasks, 1)}
    raise ValueError(
      f"--tasks: unknown task(s) {', '.join(unknown)}; "
      + (f"did you mean {', '.join(sorted(close))}? " if close else "")
      + "`python -m ao_mdm.interop.harness ls tasks` lists them (with "
      "--include_path DIR: yours too)"
    )
  tasks = []
  for name in names:
    entry = manager.task_index[name]
    members = sorted(entry.tags) if name in manager.all_tags else [name]
    for member in members:  # a group's members are the harness's to check as it builds them
      if member in manager.all_subtasks:
        _check_documents(member, manager.task_index[member].cfg or {})
    try:
      loaded = manager.load(name)
    except Exception as e:  # its data, from a file or the Hub
      cause = e.__cause__ or e
      raise ValueError(
        f"task {name}: its data cannot be loaded ({type(cause).__name__}: {cause})"
      ) from e
    groups = loaded.get("groups") or {}
    tasks += [groups[name]] if name in groups else list(loaded["tasks"].values())
  return manager, tasks


def _check_documents(task: str, config: dict) -> None:
  """The JSON-lines files of a `dataset_path: json` task: present, JSON, not empty, and (unless
  `process_docs` rewrites the documents) every document holding the fields its templates name:
  the harness would render a missing one as "None"."""
  if config.get("dataset_path") != "json":
    return
  files = (config.get("dataset_kwargs") or {}).get("data_files") or []
  files = list(files.values()) if isinstance(files, dict) else [files]
  for path in [p for f in files for p in ([f] if isinstance(f, str) else f)]:
    if not path.endswith(".jsonl") or any(c in path for c in "*?["):
      continue  # other files and patterns: the harness's own reading
    if not fs.isfile(path):
      where = (
        ""
        if fs.is_gcs(path) or path.startswith("/")
        else (f" (a relative path is read from the directory this runs in, {os.getcwd()})")
      )
      raise FileNotFoundError(f"task {task}: data file {path!r} not found{where}")
    records = paths.jsonl_records(path, f"task {task}:", numbered=True)
    if config.get("process_docs"):
      continue
    keys = set().union(*(record for _, record in records))
    fields = {name: _fields(task, name, config.get(name), keys) for name in TEMPLATES}
    for number, record in records:
      for name, wanted in fields.items():
        if missing := sorted(wanted - set(record)):
          raise ValueError(
            f"task {task}: {path} line {number} has no field {missing[0]!r}, "
            f"which its {name} names ({config[name]!r})"
          )


def _fields(task: str, name: str, template, keys: set) -> set:
  """The document fields a template names: a Jinja template's variables, or a bare field name
  (the harness takes a template that is one of the documents' keys as that field)."""
  if not isinstance(template, str):
    return set()
  if "{{" not in template and "{%" not in template:
    return {template} & keys
  try:
    variables = jinja2.meta.find_undeclared_variables(lm_utils.env.parse(template))
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(
      f"task {task}: its {name} {template!r} is not a Jinja template ({e.message})"
    ) from None
  return variables - set(lm_utils.env.globals)


def quiet_workers() -> None:
  """The harness's bootstrap pool (its metrics' standard errors) started from a fork server, not
  by forking this process: a fork of a process running JAX's threads can deadlock (JAX warns),
  and the workers would inherit our signal handlers, a line each when the pool ends them."""
  multiprocessing.set_start_method("forkserver", force=True)
  # what the workers run, imported once; not __main__, which under `python -m` would import JAX
  multiprocessing.set_forkserver_preload(["lm_eval.api.metrics"])


def register() -> None:
  """Makes "ao_mdm" a model name of the harness (its own models stay available)."""
  import lm_eval.models  # noqa: F401  (registers the harness's own models first)

  if NAME not in registry.model_registry:
    registry.register_model(NAME)(AoMdm)


def main() -> None:
  """The harness's command line with "ao_mdm" registered: `python -m ao_mdm.interop.harness
  run --model ao_mdm --model_args checkpoint=DIR --tasks ...`, quiet as our commands are."""
  import jax
  from lm_eval import __main__ as lm_eval_main

  quiet.environment()  # JAX is imported already: its platforms set again from the environment
  jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or None)
  logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes as it restores
  quiet_workers()
  register()
  sys.argv[0] = "lm_eval"
  lm_eval_main.cli_evaluate()


if __name__ == "__main__":
  main()
