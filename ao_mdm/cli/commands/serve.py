"""`ao-mdm serve`: an OpenAI-compatible completions server over a run or an export, requests
decoded together by continuous batching (docs/serving.md). SIGTERM or Ctrl-C drains: new
requests get 503, running ones finish or, after --drain_timeout, end with an error; exit 0."""

import asyncio
import contextlib
import signal
import socket
import sys
import time

from absl import flags

from ao_mdm.checkpoint import layout
from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.decode import policies

SUMMARY = "an OpenAI-compatible completions server: --checkpoint=DIR [--port=8000 --max_batch=8]"


def define(fv: flags.FlagValues) -> None:
  flags_lib.checkpoint(fv)
  flags_lib.weights(fv)
  flags.DEFINE_string(
    "host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).", flag_values=fv
  )
  flags.DEFINE_integer(
    "port", 8000, "Port to listen on (0: any free one, printed).", flag_values=fv
  )
  flags.DEFINE_string(
    "name",
    None,
    "The model's name in the API (default: the checkpoint's last path part).",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "max_batch", 8, "Rows decoded together: requests that run at once.", flag_values=fv
  )
  flags.DEFINE_integer(
    "max_queue", 64, "Choices that may wait for a row; past it a request gets 429.", flag_values=fv
  )
  flags.DEFINE_integer(
    "max_tokens_per_step", 1, "The most tokens a request may ask to commit per forward "
    "(tokens_per_step); every row pays for that many per step. 1: exact L2R sampling.",
    flag_values=fv,
  )  # fmt: skip
  flags.DEFINE_string(
    "policies", "parallel", "Decoding policies clients may ask for (a request's `policy`; the "
    "first is the default), comma-separated; each is compiled before the server is ready and "
    "has its own batch of --max_batch rows.",
    flag_values=fv,
  )  # fmt: skip
  flags.DEFINE_integer(
    "prefix_cache", 0, "Prompts whose cache is kept: a new prompt sharing 8 or more leading tokens "
    "with one copies those slots instead of computing them (log-probs within 1e-5). 0: off.",
    flag_values=fv,
  )  # fmt: skip
  flags.DEFINE_float(
    "drain_timeout",
    30.0,
    "Seconds running requests get to finish after SIGTERM or Ctrl-C.",
    flag_values=fv,
  )
  flags_lib.dtype(fv, "Decode in float32 (the default; exact) or bfloat16.")
  flags_lib.storage_timeout(fv)
  flags_lib.compile_cache(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "checkpoint")
  layout.check_checkpoint(v["checkpoint"])
  for name, low in (
    ("max_batch", 1),
    ("max_queue", 1),
    ("max_tokens_per_step", 1),
    ("port", 0),
    ("prefix_cache", 0),
  ):
    if v[name] < low:
      raise ValueError(f"--{name}={v[name]} must be >= {low}")
  if v["port"] > 65535:
    raise ValueError(f"--port={v['port']} must be in [0, 65535]")
  served_policies(v["policies"])
  if not v["drain_timeout"] >= 0:
    raise ValueError(f"--drain_timeout={v['drain_timeout']} must be >= 0")
  for module in ("fastapi", "uvicorn"):
    checks.extra_installed(module, "serve", "ao-mdm serve")
  check_address(v["host"], v["port"])


def served_policies(given: str) -> tuple[str, ...]:
  """--policies as names, each a policy that runs in a continuous batch."""
  names = tuple(dict.fromkeys(n.strip() for n in given.split(",") if n.strip()))
  batched = [p.name for p in policies.POLICIES.values() if p.batched]
  for name in names or ("",):
    if name not in batched:
      accepted = ", ".join(batched)
      raise ValueError(f"--policies={given!r}: {name!r} is not served; accepted: {accepted}")
  return names


def check_address(host: str, port: int) -> None:
  """The server can listen at host:port (a name that resolves, a port no other server holds),
  checked before the model loads."""
  try:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
  except socket.gaierror as e:
    raise ValueError(f"--host={host!r} is not an address of this machine: {e.strerror}") from None
  with socket.socket(family, kind, proto) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
    try:
      s.bind(address)
    except OSError as e:
      raise ValueError(f"cannot listen at --host={host} --port={port}: {e.strerror}") from None


def run(v: dict, given: set) -> None:
  del given
  flags_lib.enable_compile_cache(v["compile_cache"])
  import uvicorn

  from ao_mdm.checkpoint import checkpoints
  from ao_mdm.decode import common
  from ao_mdm.serve import api
  from ao_mdm.serve import engine as engine_lib

  config, params, tokenizer = checkpoints.load_run(v["checkpoint"], v["weights"])
  params, cfg = common.with_dtype(params, config.model, v["dtype"] or "float32")
  engine = engine_lib.Engine(
    params,
    cfg,
    tokenizer,
    max_batch=v["max_batch"],
    max_queue=v["max_queue"],
    max_tokens_per_step=v["max_tokens_per_step"],
    prefix_cache=v["prefix_cache"],
    policies=served_policies(v["policies"]),
  ).start()
  name = v["name"] or v["checkpoint"].rstrip("/").split("/")[-1]
  app = api.build(engine, name)

  class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # _serve's handlers: drain first, then stop
      yield

  server = Server(
    uvicorn.Config(
      app,
      host=v["host"],
      port=v["port"],
      log_level="warning",
      access_log=False,
      timeout_graceful_shutdown=5,
      lifespan="off",
    )  # fmt: skip
  )
  asyncio.run(_serve(server, app, engine, name, v["drain_timeout"]))
  print("stopped")


async def _serve(server, app, engine, name: str, drain_timeout: float) -> None:
  loop = asyncio.get_running_loop()
  signals: asyncio.Queue = asyncio.Queue()
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, signals.put_nowait, sig)
  task = asyncio.create_task(server.serve())
  while not server.started and not task.done():
    await asyncio.sleep(0.05)
  if task.done():  # e.g. the port is taken: uvicorn said why
    await task
    sys.exit(2)
  host, port = server.servers[0].sockets[0].getsockname()[:2]
  while engine.warming and signals.empty():  # /health says 503 "starting" meanwhile
    await asyncio.sleep(0.05)
  print(
    f"serving {name} at http://{host}:{port}/v1 (SIGTERM or Ctrl-C: drain and stop)", flush=True
  )
  sig = await signals.get()
  app.state.draining = True
  print(
    f"{signal.Signals(sig).name}: draining {engine.busy()} running or queued choices "
    f"(at most {drain_timeout:g} s)",
    flush=True,
  )
  deadline = time.monotonic() + drain_timeout
  while engine.busy() and time.monotonic() < deadline and signals.empty():
    await asyncio.sleep(0.05)
  left = engine.busy()
  if left:
    engine.fail_all("the server shut down before this request finished")
    print(f"ended {left} unfinished choices with an error", flush=True)
    await asyncio.sleep(0.5)  # their responses go out
  server.should_exit = True
  await task
  await asyncio.to_thread(engine.stop)  # while the loop its jobs report to is open
