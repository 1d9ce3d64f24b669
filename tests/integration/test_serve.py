"""`ao-mdm serve` in a subprocess on 127.0.0.1, queried with the official `openai` client: its
completions are the engine's exact L2R decoding, its log-probs the scorer's, bad input is a 400
naming the field, and the server goes on after every fault."""

import concurrent.futures
import pathlib
import random
import signal
import socket
import time

import httpx
import numpy as np
import openai
import pytest
from scipy import stats

from ao_mdm.decode import parallel
from ao_mdm.eval import scoring
from ao_mdm.serve.api import token_texts
from helpers import Server, filtered_probs

# They time bounded detections or signal processes after delays: the slow stage runs them one
# at a time (`alone`), never beside another test.
pytestmark = pytest.mark.alone


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
  s = Server(
    export[0], "--max_batch=4", "--max_queue=8", "--prefix_cache=4", "--max_tokens_per_step=2"
  )
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
  # 10 choices can never fit a queue of 8: a 400, not "retry later".
  with pytest.raises(openai.BadRequestError) as e:
    server.complete(prompt=["We", "the"], max_tokens=2, n=5)
  assert e.value.body["param"] == "n" and "at most 8" in e.value.body["message"]
  # 8 choices on 4 rows, 4 of them queued for 28 steps: 5 more overflow the queue, a 429 at once.
  running = server.complete(prompt="We", max_tokens=28, n=8, stream=True, seed=1)
  next(iter(running))
  with pytest.raises(openai.RateLimitError):
    server.complete(prompt="We", max_tokens=2, n=5)
  assert sum(1 for c in running if c.choices and c.choices[0].finish_reason) == 8
  assert server.get("/health").json()["status"] == "ok"
  # Counters as counters; rates over the recent window; the step time; tokens per forward
  # per row (one token per forward at tokens_per_step=1, here).
  page = server.get("/metrics").text
  for name in ("tokens_generated", "forwards", "row_steps", "finished", "cancelled"):
    assert f"# TYPE ao_mdm_{name}_total counter" in page, name
  assert server.metric("ao_mdm_tokens_generated_total") > 0
  forwards = server.metric("ao_mdm_forwards_total")
  assert server.metric("ao_mdm_step_seconds_count") == forwards > 0
  assert server.metric("ao_mdm_tokens_per_second") > 0
  assert server.metric("ao_mdm_tokens_generated_total") <= server.metric("ao_mdm_row_steps_total")
  assert 0 < server.metric("ao_mdm_tokens_per_forward_per_row") <= 1
  # Prompts that share 8 or more leading tokens with an earlier one copy those slots
  # (--prefix_cache): the same texts as decoded alone.
  opening = "We the people of the united states"
  assert len(tok.encode(opening)) >= 9
  for tail in (" and", " in order"):
    got = server.complete(prompt=opening + tail, max_tokens=6, temperature=0).choices[0].text
    assert got == greedy(export, opening + tail, 6)[0]
  assert server.metric("ao_mdm_prefix_tokens_reused_total") >= 8


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


@pytest.mark.slow  # a server of its own, three policies compiled
def test_every_served_policy_through_the_openai_client_alone_and_together(export):
  """`--policies=parallel,margin,confidence,speculative`: a request's `policy` (extra_body)
  picks its decoder. Greedy requests of every policy sent alone, then all at once: the same text
  each; top_k=1 or top_p=1e-9 at temperature 1 give the greedy text; a stream gives the whole
  text."""
  served = ("parallel", "margin", "confidence", "speculative")
  s = Server(
    export[0], "--max_batch=2", "--max_queue=32", "--max_tokens_per_step=2",
    f"--policies={','.join(served)}",
  )  # fmt: skip
  try:

    def ask(policy, prompt, extra=(), **kw):
      body = {"policy": policy, "tokens_per_step": 2, **dict(extra)}
      reply = s.complete(prompt=prompt, max_tokens=12, seed=3, extra_body=body, **kw)
      return reply.choices[0].text

    cases = [(p, prompt) for p in served for prompt in ("We the people", "Congress shall")]
    alone = {c: ask(*c, temperature=0) for c in cases}
    assert len({alone[p, "We the people"] for p in served}) > 1  # the policies differ
    plain = s.complete(
      prompt="We the people", max_tokens=12, seed=3, temperature=0,
      extra_body={"tokens_per_step": 2},
    )  # fmt: skip
    assert plain.choices[0].text == alone["parallel", "We the people"]  # the first served
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
      together = list(pool.map(lambda c: ask(*c, temperature=0), cases))
    assert together == [alone[c] for c in cases]
    for c in cases:
      assert ask(*c, temperature=1.0, extra={"top_k": 1}) == alone[c], c
      assert ask(*c, temperature=1.0, top_p=1e-9) == alone[c], c
    stream = s.complete(
      prompt="We the people", max_tokens=12, temperature=0, stream=True,
      extra_body={"policy": "margin", "tokens_per_step": 2},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in stream) == alone["margin", "We the people"]
    with pytest.raises(openai.BadRequestError) as e:
      ask("nothing", "We")
    assert e.value.body["param"] == "policy" and "margin, confidence" in e.value.body["message"]
  finally:
    code, _, err = s.stop()
  assert code == 0 and "Traceback" not in err, err


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
    while s.metric("ao_mdm_cancelled_total") < 1 and time.time() < deadline:
      time.sleep(0.1)
    assert s.metric("ao_mdm_cancelled_total") >= 1 and s.metric("ao_mdm_active_rows") == 0
    assert s.metric("ao_mdm_queue_depth") == 0  # its 8 choices gone, not decoded for nobody
    assert s.complete(prompt="We", max_tokens=3).choices[0].index == 0
  finally:
    code, out, err = s.stop(signal.SIGINT)  # Ctrl-C drains as SIGTERM does
  assert code == 0 and "SIGINT: draining" in out and "Traceback" not in err, err


def first_token_logits(export, prompt_ids: list) -> np.ndarray:
  """The model's logits for the token after `prompt_ids` (float64)."""
  _, config, params, _ = export
  p = len(prompt_ids)
  out = parallel.sample(
    params, config.model, batch_size=1, steps=1, order="l2r", known_positions=range(p),
    known_tokens=prompt_ids, end=p + 1, return_logits=True,
  )  # fmt: skip
  return out.logits[0, p].astype(np.float64)


@pytest.mark.slow  # about 330 requests (the default stage's 6-minute budget)
def test_top_p_and_top_k_apply_to_each_request_through_the_openai_client(server, export):
  """top_k=1 and a tiny top_p at temperature 1 give the greedy text for every seed, one and two
  tokens per forward; requests of three draw settings sent together (rows mixed in the batch)
  each draw from their own filtered distribution (chi-square on counts)."""
  for prompt in ("We the people", "Fellow citizens"):
    for k in (1, 2):
      ask = lambda **kw: server.complete(
        prompt=prompt, max_tokens=10, extra_body={"tokens_per_step": k, **kw.pop("extra", {})}, **kw
      ).choices[0].text  # fmt: skip
      greedy_text = ask(temperature=0)
      for seed in (1, 2, 3):
        assert ask(temperature=1, seed=seed, extra={"top_k": 1}) == greedy_text, (prompt, k, seed)
        assert ask(temperature=1, seed=seed, top_p=1e-9) == greedy_text, (prompt, k, seed)
  tok = export[3]
  ids = tok.encode("We the")
  logits = first_token_logits(export, ids)
  probs = filtered_probs(logits, 1.0, 1.0, 0)
  top4 = float(np.sort(probs)[::-1][:4].sum()) + 1e-6  # a top-p that keeps the 4 most likely
  settings = [(1.0, 1.0, 3), (1.0, top4, 0), (0.7, 1.0, 0)]  # (temperature, top_p, top_k)
  requests = 100  # each 2 choices: 200 draws per setting

  def draws(setting_and_seed):
    (temperature, top_p, top_k), seed = setting_and_seed
    out = server.complete(
      prompt=ids, max_tokens=1, n=2, seed=seed, temperature=temperature, top_p=top_p,
      logprobs=0, extra_body={"top_k": top_k},
    )  # fmt: skip
    return [c.logprobs.tokens[0] for c in out.choices]

  jobs = [(s, 2 * i) for i in range(requests) for s in settings]  # 3 in flight: 6 choices <= 8
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    drawn = list(pool.map(draws, jobs))
  pieces = {v: token_texts([v], tok)[0][0] for v in range(len(logits))}
  for j, setting in enumerate(settings):
    got = [x for d in drawn[j :: len(settings)] for x in d]
    expected = filtered_probs(logits, *setting)
    support = np.flatnonzero(expected)
    names = [pieces[v] for v in support]
    assert set(got) <= set(names), (setting, set(got) - set(names))
    # The support's tokens, the rarest merged into one bin, against 200 draws.
    order = support[np.argsort(-expected[support])]
    head = order[:4]
    counts = [got.count(pieces[v]) for v in head] + [
      len(got) - sum(got.count(pieces[v]) for v in head)
    ]
    exp = [expected[v] for v in head] + [1 - expected[head].sum()]
    counts, exp = np.asarray(counts), np.asarray(exp) * len(got)
    keep = exp > 0
    assert stats.chisquare(counts[keep], exp[keep]).pvalue > 1e-3, (setting, counts, exp)


def test_best_of_returns_the_draws_most_likely_by_their_exact_log_prob(server, export):
  """best_of=4, n=2: of the four draws (each what seed + c gives alone) the two with the highest
  exact log-prob per token of the completion given the prompt, best first (drawn L2R a token a
  step, a draw's own log-probs are those exact conditionals); best_of below n or streamed is a
  400."""
  prompt = "We the people"
  got = server.complete(prompt=prompt, max_tokens=8, best_of=4, n=2, seed=11, logprobs=0)
  draws = [
    server.complete(prompt=prompt, max_tokens=8, seed=11 + c, logprobs=0).choices[0]
    for c in range(4)
  ]
  mean = [np.mean(d.logprobs.token_logprobs) for d in draws]
  best = np.argsort(mean)[::-1][:2]
  assert [c.text for c in got.choices] == [draws[i].text for i in best]
  assert [c.index for c in got.choices] == [0, 1] and mean[best[0]] > mean[best[1]]
  assert got.usage.completion_tokens == sum(len(d.logprobs.tokens) for d in draws)
  for kwargs in (dict(best_of=2, n=3), dict(best_of=2, stream=True)):
    with pytest.raises(openai.BadRequestError) as e:
      server.complete(prompt=prompt, max_tokens=4, **kwargs)
    assert e.value.body["param"] == "best_of", e.value.body


def test_fields_are_checked_strictly_and_every_error_has_openai_shape(server, export):
  """A bool is not a count, NaN not a temperature; a prompt of the wrong form names the
  accepted ones; a body that is not UTF-8 or too large, an unserved path: OpenAI's error
  shape. The server goes on after each."""
  prompt = "We the people"
  for body, param, words in [
    ({"max_tokens": True}, "max_tokens", "valid integer"),
    ({"n": 2.0}, "n", "valid integer"),
    ({"logprobs": False}, "logprobs", "valid integer"),
    ({"seed": "7"}, "seed", "valid integer"),
    ({"temperature": "0.5"}, "temperature", "valid number"),
    ({"stream": 1}, "stream", "valid boolean"),
    ({"prompt": 5}, "prompt", "a list of token ids"),
    ({"prompt": ["Fellow", [100, 200]]}, "prompt", "a list of lists of token ids"),
    ({"prompt": [1, True]}, "prompt", "a list of token ids"),
    ({"policy": "margin"}, "policy", "'margin' is not served; this server runs parallel"),
    ({"policy": 1}, "policy", "valid string"),
  ]:
    reply = server.post({"prompt": prompt, "max_tokens": 2, **body})
    err = reply.json()["error"]
    assert reply.status_code == 400 and err["param"] == param and words in err["message"], err
  nan = server.post('{"prompt": "We", "max_tokens": 2, "temperature": NaN}')
  err = nan.json()["error"]
  assert nan.status_code == 400 and err["param"] == "temperature"
  assert "finite number" in err["message"], err
  with pytest.raises(openai.BadRequestError) as e:
    server.complete(prompt=prompt, max_tokens=True)
  assert e.value.body["param"] == "max_tokens"
  # Not UTF-8: the same error shape as every other 400.
  raw = httpx.post(
    f"{server.url}/completions", content=b'{"prompt": "\xff\xfe"}',
    headers={"content-type": "application/json"}, timeout=30,
  )  # fmt: skip
  assert raw.status_code == 400 and "UTF-8" in raw.json()["error"]["message"], raw.text
  # Chat is not served: a 404 that says what is.
  with pytest.raises(openai.NotFoundError) as e:
    server.client.chat.completions.create(
      model=server.model, messages=[{"role": "user", "content": "hi"}]
    )
  assert "/v1/completions" in e.value.body["message"] and "chat" in e.value.body["message"]
  missing = server.get("/v2/nothing")
  assert missing.status_code == 404 and "/v1/completions" in missing.json()["error"]["message"]
  # A 50 MB body is refused by its length before it is read; one sent in chunks once past
  # the limit. A small request right after is served at once.
  host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
  with socket.create_connection((host, int(port)), timeout=30) as conn:
    start = time.monotonic()
    conn.sendall(
      b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
      b"content-length: 52428800\r\n\r\n" + b'{"prompt": "' + b"x" * 65536
    )
    head = b""
    while b"at most" not in head and (part := conn.recv(65536)):  # headers, body may split
      head += part
    reply_text = head.decode(errors="replace")
    assert reply_text.startswith("HTTP/1.1 413") and "at most 1048576" in reply_text, reply_text
    assert time.monotonic() - start < 5
  chunks = (b'{"prompt": "' if i == 0 else b"y" * 65536 for i in range(40))
  big = httpx.post(
    f"{server.url}/completions", content=chunks, headers={"content-type": "application/json"},
    timeout=60,
  )  # fmt: skip
  assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
  start = time.monotonic()
  assert server.complete(prompt="We", max_tokens=4, temperature=0).choices[0].text
  assert time.monotonic() - start < 5
  assert server.get("/health").json()["status"] == "ok"


def test_token_offsets_never_run_backwards_and_byte_tokens_show_as_bytes(server, export):
  """A text with characters of several bytes: each token's text starts at its offset in the
  returned text (offsets never decrease), and a token holding part of a character shows its
  bytes (`bytes:\\xe6...`)."""
  text = "é and 日本 ok"
  tok = export[3]
  assert any(
    len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80 for i in tok.encode(text)
  )
  for kwargs in (dict(max_tokens=0), dict(max_tokens=6, temperature=0)):
    choice = server.complete(prompt=text, echo=True, logprobs=0, **kwargs).choices[0]
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert choice.text.startswith(text) and len(tokens) == len(offsets)
    assert offsets == sorted(offsets) and offsets[-1] <= len(choice.text), offsets
    assert any(t.startswith("bytes:\\x") for t in tokens), tokens
    for t, o in zip(tokens, offsets):
      if not t.startswith("bytes:"):
        assert choice.text[o : o + len(t)] == t, (t, o, choice.text)
    joined = b"".join(
      bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
      for t in tokens
    )
    if not kwargs["max_tokens"]:  # drawn tokens may be bytes that make no character
      assert joined.decode() == choice.text
