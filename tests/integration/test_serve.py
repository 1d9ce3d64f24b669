"""`ao-mdm serve` in a subprocess on 127.0.0.1, queried with the official `openai` client: its
completions are the engine's exact L2R decoding, its log-probs the scorer's, bad input is a 400
naming the field, and the server goes on after every fault."""

import concurrent.futures
import json
import os
import pathlib
import random
import select
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from ao_mdm.decode import parallel
from ao_mdm.eval import scoring
from helpers import ROOT

# They time bounded detections or signal processes after delays: the slow stage runs them one
# at a time (`alone`), never beside another test.
pytestmark = pytest.mark.alone


class Server:
  """A running `ao-mdm serve` of `path`; its URL read from the line it prints when ready."""

  def __init__(self, path: str, *flags: str):
    self.proc = subprocess.Popen(
      [
        sys.executable,
        "-m",
        "ao_mdm.cli.main",
        "serve",
        f"--checkpoint={path}",
        "--port=0",
        *flags,
      ],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    self.lines = []
    deadline = time.time() + 180
    while time.time() < deadline:
      ready, _, _ = select.select([self.proc.stdout], [], [], 1)
      if ready:
        line = self.proc.stdout.readline()
        self.lines.append(line)
        if line.startswith("serving "):
          self.model, self.url = line.split()[1], line.split(" at ")[1].split()[0]
          self.client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0)
          return
      if self.proc.poll() is not None:
        break
    self.proc.kill()
    raise AssertionError(f"no server: {self.lines} {self.proc.stderr.read()}")

  def complete(self, **kwargs):
    return self.client.completions.create(model=self.model, **kwargs)

  def post(self, body: str | dict) -> httpx.Response:
    data = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(f"{self.url}/completions", content=data, headers=headers, timeout=120)

  def get(self, path: str) -> httpx.Response:
    return httpx.get(self.url.removesuffix("/v1") + path, timeout=30)

  def metric(self, name: str) -> float:
    for line in self.get("/metrics").text.splitlines():
      if line.startswith(name + " "):
        return float(line.split()[1])
    raise KeyError(name)

  def stop(self, sig: int = signal.SIGTERM) -> tuple:
    self.proc.send_signal(sig)
    out, err = self.proc.communicate(timeout=60)
    return self.proc.returncode, "".join(self.lines) + out, err


@pytest.fixture(scope="module")
def export(eos_export, tmp_path_factory):
  """eos_export's model with EOS made rare (greedy text runs its whole length), written with its
  tokenizer: (path, spec, params, tokenizer)."""
  from ao_mdm.checkpoint import checkpoints
  from helpers import eos_model

  path, config, _, tok = eos_export
  _, params = eos_model(v=384, t=32, eos_logit=-5.0)
  tokenizer_dir = str(pathlib.Path(path).parent / "tokenizer")
  out = str(tmp_path_factory.mktemp("serve") / "export")
  return (
    checkpoints.write_params_export(out, config.to_dict(), params, tokenizer_dir),
    config,
    params,
    tok,
  )


@pytest.fixture(scope="module")
def server(export):
  s = Server(export[0], "--max_batch=4", "--max_queue=8", "--prefix_cache=4")
  yield s
  code, out, err = s.stop()
  assert code == 0 and "stopped" in out and "Traceback" not in err, err


def greedy(export, prompt: str, max_tokens: int, suffix: str = "") -> tuple:
  """(text, ids) of the same request decoded alone by parallel.sample (L2R, a token a step)."""
  _, config, params, tok = export
  ids, tail = tok.encode(prompt), tok.encode(suffix) if suffix else []
  p, m = len(ids), max_tokens
  out = parallel.sample(
    params, config.model, batch_size=1, steps=m, temperature=0.0, order="l2r",
    known_positions=list(range(p)) + list(range(p + m, p + m + len(tail))),
    known_tokens=ids + tail, end=p + m + len(tail),
    vocab_limit=min(tok.vocab_size, config.model.vocab_size),
  ).tokens[0, p : p + m].tolist()  # fmt: skip
  out = out[: out.index(tok.eos_id)] if tok.eos_id in out else out
  return tok.decode(out), out


def l2r_logprobs(export, ids: list) -> np.ndarray:
  """Each token's log-prob given those before it, by the scorer `ao-mdm eval` uses."""
  _, config, params, _ = export
  t = config.model.block_size
  tokens = np.zeros((1, t), np.int32)
  tokens[0, : len(ids)] = ids
  return -scoring.Scorer(params, config.model).slot_nll(tokens, np.arange(t)[None])[0, : len(ids)]


def test_completions_streaming_logprobs_and_bad_input_through_the_openai_client(server, export):
  tok = export[3]
  assert [m.id for m in server.client.models.list().data] == ["export"]
  prompt = "We the people of this union"
  done = server.complete(prompt=prompt, max_tokens=10, temperature=0, logprobs=1)
  choice = done.choices[0]
  text, ids = greedy(export, prompt, 10)
  assert choice.text == text and done.usage.prompt_tokens == len(tok.encode(prompt))
  # The drawn tokens' log-probs are those of a forward along them (a token per step: exact).
  p = len(tok.encode(prompt))
  expected = l2r_logprobs(export, tok.encode(prompt) + ids)[p:]
  got = choice.logprobs.token_logprobs
  assert 1 <= len(got) <= len(expected) and choice.finish_reason in ("stop", "length")
  np.testing.assert_allclose(got, expected[: len(got)], atol=1e-4)
  # Streamed: the same text, in pieces that are never taken back.
  pieces = [
    c.choices[0].text
    for c in server.complete(prompt=prompt, max_tokens=10, temperature=0, stream=True)
  ]
  assert "".join(pieces) == choice.text and len(pieces) >= 2
  # With stream_options.include_usage, a last chunk holds the usage and no choice.
  chunks = list(
    server.complete(
      prompt=prompt,
      max_tokens=10,
      temperature=0,
      stream=True,
      stream_options={"include_usage": True},
    )
  )
  assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == p
  assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens and all(
    not c.usage for c in chunks[:-1]
  )
  # A prompt given as token ids: the same completion; ids outside the vocabulary are a 400.
  by_ids = server.complete(prompt=[tok.encode(prompt)] * 2, max_tokens=10, temperature=0)
  assert [c.text for c in by_ids.choices] == [choice.text] * 2
  single = server.complete(prompt=tok.encode(prompt), max_tokens=10, temperature=0)
  assert single.choices[0].text == choice.text
  with pytest.raises(openai.BadRequestError) as e:
    server.complete(prompt=[5, 10**6], max_tokens=1)
  assert e.value.body["param"] == "prompt" and "token ids" in e.value.body["message"]
  # Scoring: echo with max_tokens=0 gives the prompt's exact L2R log-probs.
  scored = server.complete(prompt=prompt, max_tokens=0, echo=True, logprobs=0).choices[0]
  assert scored.text == prompt
  np.testing.assert_allclose(
    scored.logprobs.token_logprobs, l2r_logprobs(export, tok.encode(prompt)), atol=1e-4
  )
  # Infill through the API's suffix; stop strings cut the text.
  infill = server.complete(prompt="We the", suffix=" of this union.", max_tokens=4, temperature=0)
  assert infill.choices[0].text == greedy(export, "We the", 4, " of this union.")[0]
  words = choice.text.split()
  if len(words) > 1:
    cut = server.complete(prompt=prompt, max_tokens=10, temperature=0, stop=[words[1]]).choices[0]
    assert cut.text == choice.text[: choice.text.index(words[1])] and cut.finish_reason == "stop"
  # n choices with a seed: reproducible, and each its own.
  a = server.complete(prompt=prompt, max_tokens=8, n=3, seed=7)
  b = server.complete(prompt=prompt, max_tokens=8, n=3, seed=7)
  assert [c.text for c in a.choices] == [c.text for c in b.choices]
  # Bad input: a 400 naming the field; the server goes on.
  for kwargs, param in [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(n=99), "n"),
    (dict(max_tokens=40), "max_tokens"),
    (dict(top_p=0), "top_p"),
    (dict(extra_body={"bogus": 1}), "bogus"),
    (dict(extra_body={"tokens_per_step": "x"}), "tokens_per_step"),
    (dict(extra_body={"tokens_per_step": 64}), "tokens_per_step"),
    (dict(max_tokens=0), "max_tokens"),
  ]:
    with pytest.raises(openai.BadRequestError) as e:
      server.complete(prompt=prompt, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param, (kwargs, e.value.body)
  bad = server.post("{not json")
  assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
  assert server.post({"prompt": "x" * 4000, "max_tokens": 1}).json()["error"]["param"] == "prompt"
  with pytest.raises(openai.RateLimitError):  # 10 choices for a queue of 8: refused at once
    server.complete(prompt=["We", "the"], max_tokens=2, n=5)
  assert server.get("/health").json()["status"] == "ok"
  assert server.metric("ao_mdm_tokens_generated") > 0 and server.metric("ao_mdm_forwards") > 0
  # Prompts that share 8 or more leading tokens with an earlier one copy those slots
  # (--prefix_cache): the same texts as decoded alone.
  opening = "We the people of the united states"
  assert len(tok.encode(opening)) >= 9
  for tail in (" and", " in order"):
    got = server.complete(prompt=opening + tail, max_tokens=6, temperature=0).choices[0].text
    assert got == greedy(export, opening + tail, 6)[0]
  assert server.metric("ao_mdm_prefix_tokens_reused") >= 8


@pytest.mark.slow  # 64 requests and a server of its own
def test_tokens_do_not_depend_on_what_else_runs(export):
  """32 greedy requests sent one by one, then all at once at scattered times into a batch of 4:
  the same text each (every row's cache is its own)."""
  s = Server(export[0], "--max_batch=4", "--max_queue=64", "--max_tokens_per_step=2")
  words = "the people of this union state congress nation we must our war peace law year".split()
  rng = random.Random(0)
  prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))) for _ in range(32)]
  ask = lambda p, k: (
    s.complete(
      prompt=p, max_tokens=k, temperature=0, extra_body={"tokens_per_step": 1 + k // 2 % 2}
    )
    .choices[0]
    .text
  )
  sizes = [rng.randint(4, 16) for _ in prompts]
  alone = [ask(p, k) for p, k in zip(prompts, sizes)]

  def later(i):
    time.sleep(rng.random() * 0.5)
    return ask(prompts[i], sizes[i])

  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    together = list(pool.map(later, range(32)))
  code, _, err = s.stop()
  assert together == alone and code == 0, err


@pytest.mark.slow  # a server of its own, signalled
def test_sigterm_drains_503s_new_requests_and_exits_0(export):
  """SIGTERM while 16 choices queue for one row: each still finishes, a new request gets 503
  meanwhile, and the server exits 0."""
  s = Server(export[0], "--max_batch=1", "--max_queue=16", "--drain_timeout=300")
  s.complete(prompt="We", max_tokens=4)  # compiled
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    streams = [s.complete(prompt="We", max_tokens=28, n=8, stream=True) for _ in range(2)]
    first = [next(iter(stream)) for stream in streams]  # both are queued, one row decoding
    running = [pool.submit(lambda st: [c.choices[0] for c in st], st) for st in streams]
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # 16 choices of 28 steps on one row: seconds of work left
    with pytest.raises(openai.APIStatusError) as refused:
      s.complete(prompt="We", max_tokens=2)
    assert refused.value.status_code == 503
    chunks = [c for f in running for c in f.result(timeout=300)] + [f.choices[0] for f in first]
  assert sum(c.finish_reason in ("stop", "length") for c in chunks) == 16
  out, err = s.proc.communicate(timeout=60)
  assert s.proc.returncode == 0 and "SIGTERM: draining" in out and "Traceback" not in err, err


@pytest.mark.slow  # a server of its own
def test_a_client_gone_frees_its_row_and_its_queued_choices(export):
  s = Server(export[0], "--max_batch=1")
  try:
    with httpx.stream(
      "POST",
      f"{s.url}/completions",
      json={"prompt": "We", "max_tokens": 28, "n": 8, "stream": True, "seed": 3},
      timeout=60,
    ) as r:
      next(r.iter_lines())  # the first final text, then the client leaves
    deadline = time.time() + 30
    while s.metric("ao_mdm_cancelled") < 1 and time.time() < deadline:
      time.sleep(0.1)
    assert s.metric("ao_mdm_cancelled") >= 1 and s.metric("ao_mdm_active_rows") == 0
    assert s.metric("ao_mdm_queue_depth") == 0  # its 8 choices gone, not decoded for nobody
    assert s.complete(prompt="We", max_tokens=3).choices[0].index == 0
  finally:
    code, out, err = s.stop(signal.SIGINT)  # Ctrl-C drains as SIGTERM does
  assert code == 0 and "SIGINT: draining" in out and "Traceback" not in err, err
