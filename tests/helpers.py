"""What test modules of both tiers share: the repository's root, the `ao-mdm` command run as a
process, a tiny config, and the reference models and samplers several modules test against."""

import contextlib
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time
from typing import Any

from flax import linen, traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.config import base_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def printed_time(label: str):
  """Prints the block's seconds and `label`: where a long test's time goes (seen with -s)."""
  start = time.perf_counter()
  yield
  print(f"{time.perf_counter() - start:6.1f} s  {label}")


def default_stage_keeps(cases: list, keep: list) -> list:
  """A parametrize grid whose cases in `keep` run in the default stage and the rest are marked
  slow: `make test` samples the grid, CI's slow stage runs all of it. A tuple is a case's values
  for several names (wrap a tuple value of one name in a 1-tuple)."""
  values = lambda c: c if isinstance(c, tuple) else (c,)
  return [pytest.param(*values(c), marks=() if c in keep else pytest.mark.slow) for c in cases]


# `ao-mdm train` flags of a small model, and with short steps, which the process tests extend.
SMALL_MODEL_FLAGS = (
  "--config.model.vocab_size=512",
  "--config.model.block_size=32",
  "--config.model.n_layer=2",
  "--config.model.n_embd=32",
  "--config.model.n_head=2",
)
SMALL_TRAIN_FLAGS = (
  *SMALL_MODEL_FLAGS,
  "--config.train.batch_size=8",
  "--config.train.warmup_steps=2",
  "--config.train.log_every=1",
  "--config.train.eval_batches=1",
)

# Set by conftest for a faster compile; a test of float tolerances between two programs drops
# them (default_compiler_flags) to see the numerics users get.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def default_compiler_flags() -> str:
  """XLA_FLAGS without FAST_COMPILE_FLAGS."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  return " ".join(f for f in flags if f not in FAST_COMPILE_FLAGS)


def ao_mdm(*args: str, env: dict | None = None, timeout: float = 300, cwd=ROOT):
  """`ao-mdm ARGS` in a process of its own (CPU platform): its CompletedProcess, text output."""
  return subprocess.run(
    [sys.executable, "-m", "ao_mdm.cli.main", *args],
    capture_output=True,
    text=True,
    timeout=timeout,
    cwd=cwd,
    env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
  )


def error_lines(out) -> list:
  """The `error: ` lines of a command's stderr."""
  return [line for line in out.stderr.splitlines() if line.startswith("error: ")]


def tiny_config(data_dir: str):
  """A two-layer model of T=32 trained for two steps, checkpointed at each."""
  c = base_config()
  c.model.update(vocab_size=512, block_size=32, n_layer=2, n_embd=32, n_head=2, cond_dim=32)
  c.train.update(
    batch_size=8, num_steps=2, warmup_steps=1, eval_batches=1, eval_every=0, checkpoint_every=1
  )
  c.data.tfds_dir = data_dir
  return c


def random_model(v: int, t: int, scale: float, seed: int = 0):
  """A small AO-GPT of vocab v and length t, its weights scaled by `scale`: (model spec, params)."""
  cfg = specs.default().model.replace(
    vocab_size=v, block_size=t, n_layer=2, n_embd=32, n_head=4, cond_dim=16
  )
  params = linen.unbox(model_lib.init_params(cfg, jax.random.key(seed)))
  # Random init is near uniform; larger weights make p (L2R) and q (drafts) clearly different.
  return cfg, jax.tree.map(lambda p: p * scale if p.ndim >= 2 else p, params)


EOS = 1  # SentencePiece's EOS id, as the tokenizers of ao_mdm train them


def eos_model(v: int = 64, t: int = 32, eos_logit: float = 2.5, seed: int = 0):
  """A random AO-GPT whose head favours EOS: about one position in eight draws it."""
  cfg = specs.default().model.replace(
    vocab_size=v, block_size=t, n_layer=2, n_embd=32, n_head=4, cond_dim=16
  )
  params = linen.unbox(model_lib.init_params(cfg, jax.random.key(seed)))
  params["head"]["bias"] = params["head"]["bias"].at[EOS].set(eos_logit)
  return cfg, params


def random_params(config, seed: int) -> dict:
  """A random model of ours: every leaf random (norm scales near 1, biases non-zero)."""
  shapes = linen.unbox(
    jax.eval_shape(lambda: model_lib.init_params(config.model, jax.random.key(0)))
  )
  rng = np.random.default_rng(seed)
  flat = {
    path: (path[-1] == "scale") + rng.normal(0, 0.1, a.shape).astype(np.float32)
    for path, a in traverse_util.flatten_dict(shapes).items()
  }
  return traverse_util.unflatten_dict(flat)


def naive_greedy(cfg, params, known_tokens, order, counts):
  """Reference: for each step and target, the full training forward with that target next."""
  forward = jax.jit(lambda tok, o: model_lib.make_model(cfg).apply({"params": params}, tok, o))
  b = order.shape[0]
  tokens = known_tokens.copy()
  logits_log = np.zeros((b, cfg.block_size, cfg.vocab_size), np.float32)
  for n, n_next in zip(counts[:-1], counts[1:]):
    for m in range(n, n_next):
      o = np.concatenate([order[:, :n], order[:, m : m + 1], np.delete(order[:, n:], m - n, 1)], 1)
      logits = np.asarray(forward(jnp.asarray(tokens), jnp.asarray(o)))[:, n]
      logits_log[np.arange(b), order[:, m]] = logits
    for m in range(n, n_next):  # tokens of one step are written after all its targets are scored
      tokens[np.arange(b), order[:, m]] = logits_log[np.arange(b), order[:, m]].argmax(-1)
  return tokens, logits_log


HF_VOCAB, HF_BLOCK = 101, 16  # the sizes of conftest's hf_model


def save_hf(model, path, fmt: str = "safetensors") -> str:
  """`save_pretrained`; "bin" rewrites the weights as a Hub-style pytorch_model.bin."""
  import torch

  model.save_pretrained(path)
  if fmt == "bin":  # transformers 5 always writes safetensors, so write the .bin ourselves
    os.remove(os.path.join(path, "model.safetensors"))
    sd = {k.removeprefix("transformer."): v for k, v in model.state_dict().items()}  # has lm_head
    block = model.config.n_positions
    for i in range(model.config.n_layer):  # the buffers old checkpoints carry
      sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, block, block, dtype=torch.bool))
      sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, os.path.join(path, "pytorch_model.bin"))
  return str(path)


SHARD_DOCS = 64  # conftest's corpus_file is 5 shards of it


def text_file_config(text_file, tfds_dir, prepared_dir):
  """The data spec of a text file, its TFDS build and preparation under the given dirs."""
  return specs.default().data.replace(
    dataset="text_file",
    text_file=str(text_file),
    tfds_dir=str(tfds_dir),
    prepared_dir=str(prepared_dir),
  )


def split_files(split):
  """{file name: bytes} of a preparation's shards, counts and manifest."""
  names = [s["file"] for s in split.manifest["shards"]] + ["token_counts.npy", "manifest.json"]
  return {n: open(os.path.join(split.directory, n), "rb").read() for n in names}


def filtered_probs(logits, temperature: float, top_p: float, top_k: int) -> np.ndarray:
  """The distribution a row draws from, written out plainly: softmax(logits / temperature),
  then the top_k most likely, then the authors' top-p (drop each token whose inclusive
  cumulative probability exceeds top_p, the most likely always kept), renormalised."""
  x = np.asarray(logits, np.float64) / temperature
  probs = np.exp(x - x.max())
  probs /= probs.sum()
  keep = np.ones(len(probs), bool)
  ranked = np.argsort(-probs, kind="stable")
  if top_k:
    keep[ranked[top_k:]] = False
  kept = np.where(keep, probs, 0.0)
  cum = np.cumsum(kept[ranked] / kept.sum())
  keep[ranked[(cum > top_p) & (np.arange(len(ranked)) > 0)]] = False
  return np.where(keep, probs, 0.0) / probs[keep].sum()


class Server:
  """A running `ao-mdm serve` of `path`; its URL read from the line it prints when ready."""

  def __init__(self, path: str, *flags: str):
    import openai

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

  def post(self, body: str | dict) -> Any:
    import httpx

    data = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(f"{self.url}/completions", content=data, headers=headers, timeout=120)

  def get(self, path: str) -> Any:
    import httpx

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
