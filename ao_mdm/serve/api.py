"""The OpenAI completions API over the serving engine (docs/serving.md): POST /v1/completions
(streamed as server-sent events with `stream`), GET /v1/models, /health and /metrics. Bad input
is a 400 naming the field, a body over MAX_BODY_BYTES a 413, a full queue a 429, a draining
server a 503, each in OpenAI's error shape; nothing of one request disturbs another."""

import asyncio
import codecs
import json
import secrets
import time
from typing import Any

import fastapi
from fastapi import responses
import prometheus_client as prom
import pydantic
from starlette import exceptions as starlette_exceptions

from ao_mdm.decode import text as text_lib
from ao_mdm.serve import engine as engine_lib
from ao_mdm.serve import metrics as metrics_lib

MAX_N = 8  # choices per prompt
MAX_BODY_BYTES = 1 << 20  # a larger request body is refused before it is read (413)
SERVED = "POST /v1/completions, GET /v1/models, GET /health and GET /metrics"
PROMPT_FORMS = (
  "a string, a list of strings, a list of token ids (integers) or a list of lists of token ids"
)


class CompletionRequest(pydantic.BaseModel):
  """The fields of OpenAI's completions request that we take; any other field is a 400.
  tokens_per_step, top_k and policy are ours (pass them in the client's extra_body)."""

  # Strict: a bool is not a count, a string not a number (a float field takes an integer).
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)

  model: str | None = None
  prompt: str | list[str] | list[int] | list[list[int]]  # text, or token ids
  suffix: str | None = None
  max_tokens: int | None = pydantic.Field(16, ge=0)  # None: 16
  temperature: float = pydantic.Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
  top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
  n: int = pydantic.Field(1, ge=1, le=MAX_N)
  # Drawn per prompt, of which the n with the highest exact log-prob per token are returned.
  best_of: int | None = pydantic.Field(None, ge=1, le=MAX_N)
  stream: bool = False
  logprobs: int | None = pydantic.Field(None, ge=0, le=5)
  echo: bool = False
  stop: str | list[str] | None = None
  seed: int | None = pydantic.Field(None, ge=0, lt=2**31)
  user: str | None = None
  stream_options: dict | None = None
  # Taken at their neutral values only (the API's defaults), refused otherwise.
  frequency_penalty: float | None = pydantic.Field(None, allow_inf_nan=False)
  presence_penalty: float | None = pydantic.Field(None, allow_inf_nan=False)
  logit_bias: dict | None = None
  tokens_per_step: int = pydantic.Field(1, ge=1)
  top_k: int = pydantic.Field(0, ge=0)
  policy: str | None = None  # one the server runs (--policies); None: the first of them
  infill_span: int = pydantic.Field(8, ge=1)  # tokens drawn per [MASK] of a text prompt


def error(status: int, message: str, param: str | None = None, kind: str = "") -> Any:
  kind = kind or {429: "rate_limit_error", 503: "server_unavailable"}.get(
    status, "invalid_request_error"
  )
  body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
  return responses.JSONResponse(body, status_code=status)


class BodyLimit:
  """ASGI middleware: a request body over `limit` bytes is a 413, by its Content-Length before
  anything is read, or (a body without one) as soon as more has arrived."""

  def __init__(self, app: Any, limit: int):
    self.app, self.limit = app, limit

  async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    length = dict(scope["headers"]).get(b"content-length", b"0")
    if not length.isdigit() or int(length) > self.limit:
      return await too_large(length.decode(errors="replace"), self.limit)(scope, receive, send)
    received = 0

    async def counted() -> dict:
      nonlocal received
      message = await receive()
      received += len(message.get("body", b""))
      if received > self.limit:  # FastAPI passes an HTTPException on to its handler
        raise starlette_exceptions.HTTPException(413, f"more than {received}")
      return message

    await self.app(scope, counted, send)


def too_large(size: str, limit: int) -> Any:
  return error(
    413,
    f"the request body is {size} bytes; this server takes at most {limit} (docs/serving.md)",
    kind="invalid_request_error",
  )


def build(engine: engine_lib.Engine, model_name: str) -> fastapi.FastAPI:
  """The app; `app.state.draining` set makes every new completion a 503."""
  app = fastapi.FastAPI(title="ao-mdm serve", docs_url=None, redoc_url=None)
  app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
  app.state.draining = False
  metrics = metrics_lib.Metrics(engine)
  tok, t = engine.tokenizer, engine.cfg.block_size
  # A text of more bytes than T of the longest tokens holds more than T tokens: refused
  # without tokenizing it.
  max_text_bytes = t * max(len(tok.token_bytes(i)) for i in range(engine.vocab_limit))

  @app.exception_handler(fastapi.exceptions.RequestValidationError)
  async def invalid(request: fastapi.Request, exc: Any) -> Any:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
      return error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    if param == "prompt":  # pydantic names every form it tried; say which ones are taken
      return error(400, f"prompt: must be {PROMPT_FORMS}", param)
    return error(400, f"{'.'.join(loc) or 'body'}: {first.get('msg')}", param)

  @app.exception_handler(starlette_exceptions.HTTPException)
  async def http_error(request: fastapi.Request, exc: Any) -> Any:
    path = f"{request.method} {request.url.path}"
    if exc.status_code in (404, 405):
      chat = request.url.path.rstrip("/").endswith("chat/completions")
      hint = (
        "; chat is not served: send the conversation to /v1/completions as a prompt of "
        "`role: content` lines ending in `assistant: ` (as post-training renders chats)"
      )
      return error(
        exc.status_code,
        f"{path} is not served; this server has {SERVED}{hint if chat else ''}",
        kind="not_found_error",
      )
    if exc.status_code == 413:
      return too_large(str(exc.detail), MAX_BODY_BYTES)
    if exc.status_code == 400:  # FastAPI's body parser: the bytes are not UTF-8 text
      return error(400, "the body is not valid JSON: it is not UTF-8 text")
    return error(exc.status_code, str(exc.detail), kind="server_error")

  @app.get("/health")
  async def health() -> Any:
    if app.state.draining:
      return error(503, "draining: the server is shutting down")
    if engine.warming:  # requests are taken, and wait for the compiles
      return error(503, f"starting: {engine.warming}")
    return {"status": "ok", "queued": len(engine.queue), "active": len(engine.active)}

  @app.get("/metrics")
  async def metrics_page() -> Any:
    return responses.Response(metrics.render(), media_type=prom.CONTENT_TYPE_LATEST)

  @app.get("/v1/models")
  async def models() -> Any:
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "ao-mdm"}
    return {"object": "list", "data": [card]}

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: fastapi.Request) -> Any:
    if app.state.draining:
      return error(503, "draining: the server is shutting down")
    if body.model not in (None, model_name):
      return error(
        404, f"model {body.model!r} is not served; this server has {model_name!r}", "model"
      )
    if body.max_tokens is None:
      body.max_tokens = 16
    for name, neutral in (("frequency_penalty", 0), ("presence_penalty", 0)):
      if getattr(body, name) not in (None, neutral):
        return error(400, f"{name}={getattr(body, name)} is not supported (only {neutral})", name)
    if body.logit_bias:
      return error(400, "logit_bias is not supported (only empty)", "logit_bias")
    if body.tokens_per_step > engine.max_tokens_per_step:
      return error(
        400,
        f"tokens_per_step={body.tokens_per_step}; this server takes at most "
        f"{engine.max_tokens_per_step} (ao-mdm serve --max_tokens_per_step)",
        "tokens_per_step",
      )
    body.policy = body.policy or next(iter(engine.batchers))
    if body.policy not in engine.batchers:
      return error(
        400,
        f"policy={body.policy!r} is not served; this server runs {', '.join(engine.batchers)} "
        "(ao-mdm serve --policies)",
        "policy",
      )
    draws = body.best_of or body.n
    if draws < body.n:
      return error(400, f"best_of={draws} is below n={body.n}: it must be at least n", "best_of")
    if draws > body.n and body.stream:
      return error(
        400, f"best_of={draws} > n cannot be streamed (the best is known last)", "best_of"
      )
    if body.max_tokens == 0 and not body.echo:
      return error(400, "max_tokens=0 needs echo=true (the prompt's log-probs)", "max_tokens")
    one = isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int))
    given: list[Any] = [body.prompt] if one else list(body.prompt)
    if not given:
      return error(400, "prompt: an empty list", "prompt")
    if len(given) * draws > engine.max_queue:  # could never be queued: not a retry later
      per = "best_of" if body.best_of else "n"
      return error(
        400,
        f"{len(given)} prompts x {per}={draws} = {len(given) * draws} choices; this server "
        f"queues at most {engine.max_queue} (ao-mdm serve --max_queue)",
        per if draws > 1 else "prompt",
      )
    if any(isinstance(x, str) and text_lib.MASK in x for x in given):
      for name, wrong in (
        ("max_tokens", "max_tokens" in body.model_fields_set),
        ("suffix", body.suffix is not None),
        ("stream", body.stream),
      ):
        if wrong:
          return error(
            400,
            f"{name} does not apply to a prompt with {text_lib.MASK}: its [MASK] spans are drawn "
            "(infill_span tokens each) and its text is whole once all are",
            name,
          )
    elif "infill_span" in body.model_fields_set:
      return error(400, f"infill_span applies to a prompt with {text_lib.MASK}", "infill_span")
    named = [(f"prompt[{i}]", "prompt", x) for i, x in enumerate(given)]
    for what, param, x in named + [("suffix", "suffix", body.suffix or "")]:
      if isinstance(x, str) and len(x.replace(text_lib.MASK, "").encode()) > max_text_bytes:
        return error(400, f"{what} is longer than the model's {t} positions", param)
      if not isinstance(x, str) and any(not 0 <= v < engine.vocab_limit for v in x):
        return error(400, f"{what}: token ids must be in [0, {engine.vocab_limit})", param)
    usage_chunk = bool((body.stream_options or {}).get("include_usage"))
    stop = tuple(s for s in ([body.stop] if isinstance(body.stop, str) else body.stop or ()) if s)
    # Texts are tokenized off the event loop (the tokenizers release the GIL): a long prompt
    # does not hold up the other requests.
    try:
      encoded = await asyncio.to_thread(
        lambda: [_layout(x, tok, t, body.infill_span) for x in given]
      )
    except ValueError as e:  # an infill that does not fit
      return error(400, str(e), "prompt")
    prompts = [  # the echo's text
      x if isinstance(x, str) and not inside else tok.decode(list(ids))
      for x, (ids, _, inside) in zip(given, encoded)
    ]
    suffix = tuple(await asyncio.to_thread(tok.encode, body.suffix)) if body.suffix else ()
    loop = asyncio.get_running_loop()
    seed = secrets.randbits(31) if body.seed is None else body.seed
    jobs, queues = [], []
    for i, (ids, span, inside) in enumerate(encoded):
      max_tokens = span or body.max_tokens
      if not ids and not suffix and body.max_tokens == 0:
        return error(400, f"prompt[{i}] is empty: nothing to score", "prompt")
      room = t - len(ids) - len(suffix)
      if max_tokens > room:
        return error(
          400,
          f"max_tokens={body.max_tokens}: prompt[{i}] ({len(ids)} tokens)"
          f"{f' and the suffix ({len(suffix)})' if suffix else ''} leave {max(room, 0)} of the "
          f"model's {t} positions",
          "max_tokens" if room > 0 else "prompt",
        )
      for c in range(draws):
        q: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, payload: dict, q: asyncio.Queue = q) -> None:
          try:
            loop.call_soon_threadsafe(q.put_nowait, (kind, payload))
          except RuntimeError:  # the event loop closed: the server is gone
            pass

        jobs.append(
          engine_lib.Job(
            ids,
            max_tokens,
            emit,
            suffix,
            stop,
            (seed + c) % 2**31,
            body.temperature,
            body.top_p,
            body.top_k,
            body.tokens_per_step,
            body.policy,
            score_prompt=body.echo and body.logprobs is not None,
            rank=draws > body.n,
            inside=inside,
          )
        )
        queues.append(q)
    try:
      engine.submit(jobs)
    except engine_lib.QueueFull as e:
      return error(429, f"too many requests: {e}; retry later")
    head: dict[str, Any] = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion"}
    head |= {"created": int(time.time()), "model": model_name}
    prompt_of = lambda i: prompts[i // draws]
    if body.stream:
      return responses.StreamingResponse(
        _stream(engine, jobs, queues, head, body, prompt_of, request, usage_chunk),
        media_type="text/event-stream",
      )
    try:
      results = await _gather(engine, jobs, queues, request)
    except asyncio.CancelledError:
      for job in jobs:
        engine.cancel(job)
      raise
    if results is None:  # the client went away
      return responses.Response(status_code=499)
    for i, (*_, done) in enumerate(results):
      if "error" in done:
        return error(500, f"choice {i} failed: {done['error']}", kind="server_error")
    choices: list[dict] = []
    for i in _best(results, len(given), draws, body.n):
      text, ids, lps, done = results[i]
      j = len(choices)  # choice j: prompt j // n, as the API numbers them
      choices.append(_choice(j, text, ids, lps, done, body, prompt_of(i), jobs[i], tok))
    usage = {
      "prompt_tokens": sum(len(j.prompt) for j in jobs[::draws]),
      "completion_tokens": sum(len(r[1]) for r in results),
    }
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {**head, "choices": choices, "usage": usage}

  return app


def _layout(prompt: Any, tok: Any, t: int, span: int) -> tuple[tuple, int, tuple]:
  """(the ids before the first [MASK] or all of them, the positions drawn after those: an
  infill's span to its end or 0, an infill's known (position, id) pairs in that span)."""
  if not isinstance(prompt, str) or text_lib.MASK not in prompt:
    return tuple(tok.encode(prompt)) if isinstance(prompt, str) and prompt else tuple(prompt), 0, ()
  positions, ids, end = text_lib.layout_known(tok.encode, t, infill=prompt, span=span)
  p = next(i for i, q in enumerate([*positions, t]) if q != i)  # the first [MASK]'s position
  inside = tuple(zip(positions[p:], ids[p:]))
  return tuple(ids[:p]), end - p, inside


def _best(results: list, prompts: int, draws: int, n: int) -> list[int]:
  """The results to return, prompt by prompt: all of them, or (best_of) the n of each prompt's
  draws with the highest exact log-prob per generated token, best first."""
  if draws == n:
    return list(range(len(results)))
  mean = lambda i: results[i][3]["logprob"] / max(len(results[i][1]), 1)
  out = []
  for first in range(0, prompts * draws, draws):
    out += sorted(range(first, first + draws), key=mean, reverse=True)[:n]
  return out


async def _gather(engine: engine_lib.Engine, jobs: list, queues: list, request: Any) -> Any:
  """Each job's (text, ids, logprobs, done payload), or None when the client left first."""
  results, checked = [], time.monotonic()
  for q in queues:
    text, ids, lps = "", list[int](), list[float]()
    while True:
      try:
        kind, payload = await asyncio.wait_for(q.get(), timeout=0.5)
      except TimeoutError:
        kind = ""
      if time.monotonic() - checked >= 0.5:  # whether events flow or not
        checked = time.monotonic()
        if await request.is_disconnected():
          for j in jobs:
            engine.cancel(j)
          return None
      if kind == "text":
        text += payload["text"]
        ids, lps = ids + payload["ids"], lps + payload["logprobs"]
      elif kind == "error":
        results.append((text, ids, lps, {"error": payload["message"]}))
        break
      elif kind == "done":
        results.append((text, ids, lps, payload))
        break
  return results


def token_texts(ids: list, tok: Any, offset: int = 0) -> tuple[list, list]:
  """(tokens, text offsets) of `ids`: each token's text, or `bytes:\\xe6\\x97` where it holds
  part of a character (as OpenAI shows one), and the index in the text of the character it
  starts or continues, so the offsets never decrease."""
  utf8 = codecs.getincrementaldecoder("utf-8")("replace")
  tokens, offsets, chars = [], [], offset
  for i in ids:
    piece = tok.token_bytes(i)
    offsets.append(chars)
    chars += len(utf8.decode(piece))
    try:
      tokens.append(piece.decode())
    except UnicodeDecodeError:
      tokens.append("bytes:" + "".join(f"\\x{b:02x}" for b in piece))
  return tokens, offsets


def _choice(i, text, ids, lps, done, body, prompt, job, tok) -> dict:
  out: dict[str, Any] = {"index": i, "text": text, "logprobs": None}
  out["finish_reason"] = done["finish_reason"]
  if body.echo:
    out["text"] = prompt + text
  if body.logprobs is not None:
    tokens: list = []
    values: list = []
    offsets: list = []
    if body.echo and done.get("prompt_logprobs") is not None:
      tokens, offsets = token_texts(list(job.prompt), tok)
      values = list(done["prompt_logprobs"])
    gen = token_texts(ids, tok, len(prompt) if body.echo else 0)
    tokens, values, offsets = tokens + gen[0], values + list(lps), offsets + gen[1]
    offsets = [min(o, len(out["text"])) for o in offsets]  # a tokenizer's decode may trim
    out["logprobs"] = {
      "tokens": tokens,
      "token_logprobs": values,
      "top_logprobs": [{t: v} for t, v in zip(tokens, values)] if body.logprobs else None,
      "text_offset": offsets,
    }
  return out


async def _stream(engine, jobs, queues, head, body, prompt_of, request, usage_chunk):
  """Server-sent events: a chunk per choice whenever its text grows by final text, one with its
  finish reason, a chunk with the usage when stream_options.include_usage asks, then [DONE]. A
  client gone cancels every choice still running."""
  pending = {asyncio.ensure_future(q.get()): i for i, q in enumerate(queues)}
  generated = 0
  try:
    if body.echo:
      for i in range(len(jobs)):
        yield _sse(head, i, prompt_of(i), None)
    while pending:
      done, _ = await asyncio.wait(pending, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
      if not done and await request.is_disconnected():
        break
      for fut in done:
        i = pending.pop(fut)
        kind, payload = fut.result()
        if kind == "text":
          generated += len(payload["ids"])
          logprobs = None
          if body.logprobs is not None:
            pieces = token_texts(payload["ids"], engine.tokenizer)[0]
            logprobs = {"tokens": pieces, "token_logprobs": payload["logprobs"]}
            logprobs["top_logprobs"] = None
          yield _sse(head, i, payload["text"], None, logprobs)
          pending[asyncio.ensure_future(queues[i].get())] = i
        elif kind == "error":
          failed = {"error": {"message": payload["message"], "type": "server_error"}}
          yield f"data: {json.dumps(failed)}\n\n"
        else:
          yield _sse(head, i, "", payload["finish_reason"])
    else:
      if usage_chunk:
        prompt_tokens = sum(len(j.prompt) for j in jobs[:: body.n])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated}
        usage["total_tokens"] = prompt_tokens + generated
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
      yield "data: [DONE]\n\n"
  finally:
    for fut in pending:
      fut.cancel()
    for job in jobs:
      engine.cancel(job)


def _sse(head: dict, i: int, text: str, finish: str | None, logprobs: Any = None) -> str:
  choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
  return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
