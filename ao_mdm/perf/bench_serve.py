"""`ao-mdm bench serve`: a load generator against `ao-mdm serve` in a subprocess, the official
`openai` client streaming every request: the same requests one at a time, then from concurrent
clients, throughput, latency and time to first token of both, in one run (docs/performance.md)."""

from collections.abc import Callable, Iterator
import concurrent.futures
import contextlib
import json
import random
import select
import statistics
import subprocess
import sys
import time
from typing import Any

import ml_collections
import psutil

from ao_mdm.data import corpus


def workload(
  bench: ml_collections.ConfigDict, prompt_words: Any = None, max_tokens: Any = None, seed: int = 0
) -> list:
  """(prompt, max_tokens) of bench.requests requests: prompts of the embedded corpus's words,
  their lengths and the output lengths drawn uniformly from prompt_words and max_tokens
  (default: bench's)."""
  rng = random.Random(seed)
  words = " ".join(corpus.sotu_documents("train")[:20]).split()
  out = []
  for _ in range(int(bench.requests)):
    n, start = rng.randint(*(prompt_words or bench.prompt_words)), rng.randrange(len(words) - 64)
    out.append((" ".join(words[start : start + n]), rng.randint(*(max_tokens or bench.max_tokens))))
  return out


def _start(checkpoint: str, bench: ml_collections.ConfigDict, *extra: str) -> tuple:
  flags = [f"--max_batch={bench.max_batch}", f"--max_queue={4 * int(bench.requests)}", *extra]
  flags.append(f"--max_tokens_per_step={bench.tokens_per_step}")
  proc = subprocess.Popen(
    [sys.executable, "-m", "ao_mdm.cli.main", "serve", f"--checkpoint={checkpoint}", "--port=0"]
    + flags,
    stdout=subprocess.PIPE,
    text=True,
  )
  assert proc.stdout is not None
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if select.select([proc.stdout], [], [], 1)[0]:
      line = proc.stdout.readline()
      if line.startswith("serving "):
        return proc, line.split()[1], line.split(" at ")[1].split()[0]
  proc.kill()
  raise RuntimeError(f"`ao-mdm serve --checkpoint={checkpoint}` did not start")


def _one(client: Any, model: str, prompt: str, max_tokens: int, tokens_per_step: int) -> dict:
  start = time.perf_counter()
  first = None
  for chunk in client.completions.create(
    model=model,
    prompt=prompt,
    max_tokens=max_tokens,
    stream=True,
    temperature=1.0,
    extra_body={"tokens_per_step": tokens_per_step},
  ):
    if first is None and chunk.choices and chunk.choices[0].text:
      first = time.perf_counter() - start
  return {"latency": time.perf_counter() - start, "ttft": first or 0.0, "tokens": max_tokens}


def _run(requests: list, clients: int, ask: Callable) -> dict:
  """The requests from `clients` concurrent clients: wall time, token throughput (requested
  tokens: EOS may end some earlier), latency p50/p99, time to first token p50/p99."""
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    done = list(pool.map(lambda r: ask(*r), requests))
  wall = time.perf_counter() - start
  pct = lambda xs, q: statistics.quantiles(xs, n=100, method="inclusive")[q - 1]
  lat, ttft = [d["latency"] for d in done], [d["ttft"] for d in done]
  return {
    "clients": clients,
    "seconds": wall,
    "tokens_per_s": sum(d["tokens"] for d in done) / wall,
    "latency_p50_s": pct(lat, 50),
    "latency_p99_s": pct(lat, 99),
    "ttft_p50_s": pct(ttft, 50),
    "ttft_p99_s": pct(ttft, 99),
  }


@contextlib.contextmanager
def _server(checkpoint: str, bench: ml_collections.ConfigDict, *extra: str) -> Iterator[tuple]:
  """`ao-mdm serve` with bench's flags (and extra) while in the block: (its process, a function
  (prompt, max_tokens) -> _one's record through the `openai` client)."""
  import openai

  proc, model, url = _start(checkpoint, bench, *extra)
  client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
  k = int(bench.tokens_per_step)
  try:
    yield proc, lambda prompt, n: _one(client, model, prompt, n, k)
  finally:
    proc.terminate()
    proc.wait(timeout=120)


def bench_serve(
  checkpoint: str, bench: ml_collections.ConfigDict, log: Callable[[str], None] = print
) -> dict:
  """Starts the server, warms it up (every compile), runs the workload one request at a time,
  then from bench.clients clients; with bench.duration_s, repeats the concurrent load that long
  and compares the server's memory after the first minute and at the end; then the shared
  opening, on the same server and on one with --prefix_cache."""
  requests = workload(bench)
  sp = bench.shared_prefix
  shared: dict[str, Any] = {}
  with _server(checkpoint, bench) as (proc, ask):
    log(f"serving {checkpoint}; warming up (compiles) with the {len(requests)} requests once")
    _run(requests, int(bench.clients), ask)
    results: dict[str, Any] = {
      "requests": len(requests),
      "tokens_per_step": int(bench.tokens_per_step),
    }
    results["sequential"] = _run(requests, 1, ask)
    results["concurrent"] = _run(requests, int(bench.clients), ask)
    results["speedup"] = (
      results["concurrent"]["tokens_per_s"] / results["sequential"]["tokens_per_s"]
    )
    for name in ("sequential", "concurrent"):
      r = results[name]
      log(
        f"{name} ({r['clients']} client{'s' if r['clients'] > 1 else ''}): "
        f"{r['tokens_per_s']:.1f} tokens/s, latency p50 {r['latency_p50_s']:.2f} s / p99 "
        f"{r['latency_p99_s']:.2f} s, first token p50 {r['ttft_p50_s']:.2f} s / p99 "
        f"{r['ttft_p99_s']:.2f} s"
      )
    log(f"concurrent / sequential throughput: {results['speedup']:.2f}x")
    if float(bench.duration_s) > 0:
      samples, start = [], time.time()  # (minutes, server RSS MiB) after each round
      while time.time() - start < float(bench.duration_s):
        _run(requests, int(bench.clients), ask)
        rss = psutil.Process(proc.pid).memory_info().rss / 2**20
        samples.append(((time.time() - start) / 60, rss))
      first = next((s for s in samples if s[0] >= 1), samples[0])
      results["memory"] = {
        "first_minute": first,
        "end": samples[-1],
        "end_over_first": samples[-1][1] / first[1],
      }
      log(
        f"server RSS after {first[0]:.1f} min {first[1]:.0f} MiB, "
        f"after {samples[-1][0]:.1f} min {samples[-1][1]:.0f} MiB"
      )
    if sp.words:  # this server has no prefix cache: the first of the two
      shared["prefix_cache_0"] = _shared_prefix(bench, ask, 0, log)
  if sp.words:
    cache = int(sp.cache)
    with _server(checkpoint, bench, f"--prefix_cache={cache}") as (_, ask):
      on = shared[f"prefix_cache_{cache}"] = _shared_prefix(bench, ask, cache, log)
    shared["gain"] = on["tokens_per_s"] / shared["prefix_cache_0"]["tokens_per_s"]
    log(f"prefix cache on / off throughput: {shared['gain']:.2f}x")
    results["shared_prefix"] = shared
  log(json.dumps(results))
  return results


def _shared_prefix(
  bench: ml_collections.ConfigDict, ask: Callable, cache: int, log: Callable[[str], None]
) -> dict:
  """One opening of bench.shared_prefix.words words before every prompt (a system prompt, a
  few-shot header), from bench.clients clients, against a running server with --prefix_cache
  `cache`: throughput and time to first token (the requests sent four times, after a round
  that compiles and, with the cache, fills it)."""
  sp = bench.shared_prefix
  opening = " ".join(corpus.sotu_documents("train")[0].split()[: int(sp.words)])
  requests = [
    (f"{opening} {p}", n) for p, n in workload(bench, sp.tail_words, sp.max_tokens, seed=1)
  ] * 4  # short answers: four rounds make a run long enough to time
  _run(requests, int(bench.clients), ask)
  r = _run(requests, int(bench.clients), ask)
  log(
    f"shared {sp.words}-word opening, --prefix_cache={cache}: {r['tokens_per_s']:.1f} tokens/s,"
    f" first token p50 {r['ttft_p50_s']:.2f} s / p99 {r['ttft_p99_s']:.2f} s"
  )
  return r
