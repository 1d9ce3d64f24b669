"""Golden outputs of the decoders, recorded before issue 45's engine replaced them: each case is
one call of a public sampler; its tokens, order, stats and logits must stay the same.
`python tests/unit/test_decode_golden.py --record` rewrites tests/data/decode_golden.npz."""
# ruff: noqa: E402 (the recording run finds helpers before the imports)

import os
import pathlib
import sys

if __name__ == "__main__":  # pytest's pythonpath and conftest's platform, for --record
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import datetime
import functools
import json

import flax.linen as nn
import jax
import jaxlib
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.decode import confidence, draft, parallel, speculative
from helpers import FAST_COMPILE_FLAGS, default_stage_keeps

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "data" / "decode_golden.npz"
SAMPLERS = {"par": parallel.sample, "conf": confidence.sample, "spec": speculative.sample}
PROMPT = dict(known_positions=list(range(7)), known_tokens=[5, 17, 33, 2, 60, 41, 9])
INFILL = dict(known_positions=[0, 3, 4, 11, 20, 31], known_tokens=[7, 12, 40, 3, 55, 21])
# An infill that ends at its text: positions from 18 on are never drawn.
ENDS = dict(known_positions=[0, 1, 2, 3, 14, 15, 16, 17], known_tokens=[8, 30, 1, 44] * 2, end=18)
# Until-EOS: ids the model draws often enough that rows stop at different lengths (sampled, greedy).
EOS, EOS_G = dict(eos_id=38), dict(eos_id=50)


@functools.cache
def model(variant: str) -> tuple:
  """A deterministic AO-GPT or sigma-GPT of T=32, vocab 64, its weights x3 for clear margins."""
  cfg = specs.default().model.replace(
    variant=variant, block_size=32, vocab_size=64, n_layer=2, n_embd=32, n_head=4
  )
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  return cfg, jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, params)


@functools.cache
def head() -> dict:
  """A random draft head of the AO-GPT, x4 so that its drafts differ from the base's."""
  params = draft.init_head(model("ao")[0], jax.random.key(100))
  return jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)


def case(name: str, sampler: str, variant: str = "ao", **kw) -> dict:
  """One call `SAMPLERS[sampler](params, cfg, **kw)`. Greedy ones (temperature 0) draw no token
  at random (random orders still come from the seed); sampled ones may move to a counts test."""
  greedy = kw.get("temperature", 1.0) == 0
  return dict(name=name, sampler=sampler, variant=variant, greedy=greedy, kw=kw)


B1, B3, B8 = dict(batch_size=1), dict(batch_size=3), dict(batch_size=8)
G, S1 = dict(temperature=0.0), dict(seed=1)
CASES = [
  case("par_random_s32_greedy", "par", steps=32, order="random", **B3, **G),
  case("par_random_cosine_s8_greedy", "par", steps=8, order="random", schedule="cosine", **B3, **G),
  case("par_l2r_s16", "par", steps=16, order="l2r", **B8),
  case("par_l2r_cosine_s4_seed1", "par", steps=4, order="l2r", schedule="cosine", **B1, **S1),
  case("par_random_s2", "par", steps=2, order="random", **B3),
  case("par_default_order_s16_seed1", "par", steps=16, **B8, **S1),
  case("par_prompt_greedy", "par", steps=25, **PROMPT, **B3, **G),
  case("par_prompt_random_s10_seed1", "par", steps=10, order="random", **PROMPT, **B8, **S1),
  case("par_infill_random_greedy", "par", steps=13, order="random", **INFILL, **B3, **G),
  case("par_infill_l2r", "par", steps=26, order="l2r", **INFILL, **B1),
  case("par_end_greedy", "par", steps=6, **ENDS, **B3, **G),
  case("par_end_random_seed1", "par", steps=10, order="random", **ENDS, **B8, **S1),
  case("par_block8_random_greedy", "par", steps=16, order="random", block_len=8, **B3, **G),
  case("par_block5_prompt_l2r", "par", steps=10, order="l2r", block_len=5, **PROMPT, **B3),
  case("par_eos_block8_random", "par", steps=16, order="random", block_len=8, **EOS, **B8),
  case("par_eos_prompt_l2r_seed1", "par", steps=25, order="l2r", **EOS, **PROMPT, **B8, **S1),
  case("par_eos_block8_greedy", "par", steps=16, order="random", block_len=8, **EOS_G, **B8, **G),
  case("par_nocache_random_greedy", "par", steps=8, order="random", use_cache=False, **B3, **G),
  case("par_nocache_prompt", "par", steps=5, use_cache=False, **PROMPT, **B3),
  case("par_logits_random_greedy", "par", steps=8, order="random", return_logits=True, **B3, **G),
  case("par_logits_infill", "par", steps=13, order="random", return_logits=True, **INFILL, **B1),
  case("par_bf16_random_greedy", "par", steps=8, order="random", dtype="bfloat16", **B3, **G),
  case("par_bf16_prompt_seed1", "par", steps=25, dtype="bfloat16", **PROMPT, **B8, **S1),
  case("par_top_p", "par", steps=16, order="random", top_p=0.8, **B8),
  case("par_top_k_nucleus", "par", steps=8, top_k=5, top_p=0.9, top_p_rule="nucleus", **B3),
  case("par_vocab_limit_seed1", "par", steps=8, order="random", vocab_limit=50, **B3, **S1),
  case("sigma_par_random_greedy", "par", "sigma", steps=8, order="random", **B3, **G),
  case("sigma_par_block8_prompt", "par", "sigma", steps=10, block_len=8, **PROMPT, **B3),
  case("conf_max_prob_greedy", "conf", steps=8, **B3, **G),
  case("conf_entropy_cosine", "conf", steps=16, score="entropy", schedule="cosine", **B8),
  case("conf_prompt_seed1", "conf", steps=5, **PROMPT, **B1, **S1),
  case("conf_end_entropy_greedy", "conf", steps=6, score="entropy", **ENDS, **B3, **G),
  case("conf_infill_bf16", "conf", steps=13, dtype="bfloat16", **INFILL, **B3),
  # (confidence.sample on sigma-GPT raised a TypeError when these were recorded; test_logprobs.py)
  case("spec_self_d4", "spec", draft=4, **B8),
  case("spec_self_d1_greedy", "spec", draft=1, **B3, **G),
  case("spec_self_d4_random_greedy", "spec", draft=4, order="random", **B3, **G),
  case("spec_self_d4_random_seed1", "spec", draft=4, order="random", **B3, **S1),
  case("spec_head_d4_greedy", "spec", draft=4, draft_head=True, **B3, **G),
  case("spec_head_d1_random", "spec", draft=1, order="random", draft_head=True, **B8),
  case("spec_head_d4_prompt", "spec", draft=4, draft_head=True, **PROMPT, **B3),
  case("spec_self_eos", "spec", draft=4, **EOS, **B8),
  case("spec_head_eos_prompt_seed1", "spec", draft=4, draft_head=True, **EOS, **PROMPT, **B8, **S1),
  case("spec_self_end_greedy", "spec", draft=4, **ENDS, **B3, **G),
  case("spec_head_end_random", "spec", draft=4, order="random", draft_head=True, **ENDS, **B3),
  case("spec_head_bf16", "spec", draft=4, dtype="bfloat16", draft_head=True, **B3),
  case("sigma_spec_self_greedy", "spec", "sigma", draft=4, **B3, **G),
]
BY_NAME = {c["name"]: c for c in CASES}
assert len(BY_NAME) == len(CASES)


def run(c: dict) -> dict:
  """The case's call now: {"CASE/tokens", "CASE/order", "CASE/logits", "CASE/stats/NAME"}."""
  cfg, params = model(c["variant"])
  kw = dict(c["kw"], draft_head=head()) if c["kw"].get("draft_head") else c["kw"]
  out = SAMPLERS[c["sampler"]](params, cfg, **kw)
  arrays = {"tokens": out.tokens, "order": out.order, "logits": out.logits}
  arrays.update({f"stats/{k}": v for k, v in (out.stats or {}).items()})
  return {f"{c['name']}/{k}": np.asarray(v) for k, v in arrays.items() if v is not None}


# The default stage: one greedy case per decoder (until-EOS block-wise for parallel).
KEEP = ["par_eos_block8_greedy", "conf_end_entropy_greedy", "spec_self_d4_random_greedy"]


@pytest.mark.parametrize("name", default_stage_keeps(list(BY_NAME), KEEP))
def test_decoder_gives_its_golden_outputs(name):
  """Integer outputs bitwise, float ones (logits, overlap sums) to 1e-6 relative. Two changes
  of the engine (issue 45) are allowed: the parallel policy's draws use a key per row (row r:
  fold_in(the batch's draw key, r), then its step), so its sampled cases keep their orders and
  known tokens only (test_batching.py shows the draws' distribution); and an until-EOS row
  stops at its EOS, so its tokens are compared up to its length. Issue 60 moved the confidence
  policy to a key per row too: its sampled cases keep their known tokens (test_confidence.py
  shows the draws' distribution), and speculative, now a policy of the protocol: its sampled
  cases keep their orders and known tokens, its greedy ones their tokens and orders
  but not their counts of accepted drafts (its first drafts are drawn per row), and
  test_speculative.py shows the draws' distribution."""
  c = BY_NAME[name]
  with np.load(GOLDEN, allow_pickle=False) as golden:
    want = {k: golden[k] for k in golden.files if k.startswith(f"{name}/")}
  got = run(c)
  assert sorted(got) == sorted(want)
  redrawn = not c["greedy"]
  known = np.asarray(c["kw"].get("known_positions", []), int)
  for key, value in want.items():
    assert got[key].dtype == value.dtype, key
    if redrawn and (c["sampler"] == "conf" or not key.endswith("/order")):
      continue
    if c["sampler"] == "spec" and "/stats/" in key and not key.endswith("/length"):
      continue  # the first drafts are drawn per row: how many are accepted changes
    if key.endswith("/tokens") and "eos_id" in c["kw"]:
      for row, length in enumerate(want[f"{name}/stats/length"]):
        np.testing.assert_array_equal(got[key][row, :length], value[row, :length], err_msg=key)
    elif np.issubdtype(value.dtype, np.floating):
      np.testing.assert_allclose(got[key], value, rtol=1e-6, atol=1e-6, err_msg=key)
    else:
      np.testing.assert_array_equal(got[key], value, err_msg=key)
  if redrawn:  # the known tokens stay, first in the order
    order = got[f"{name}/order"][:, : len(known)]
    np.testing.assert_array_equal(order, want[f"{name}/order"][:, : len(known)])
    np.testing.assert_array_equal(got[f"{name}/tokens"][:, known], want[f"{name}/tokens"][:, known])
  if "eos_id" in c["kw"]:  # the golden rows stop at different lengths
    assert len(set(want[f"{name}/stats/length"].tolist())) > 1


def record() -> None:
  """Run every case and write GOLDEN (a temporary name, then renamed)."""
  arrays = {}
  for c in CASES:
    arrays.update(run(c))
  meta = dict(
    jax=jax.__version__,
    jaxlib=jaxlib.__version__,
    backend=jax.default_backend(),
    xla_flags=os.environ["XLA_FLAGS"],
    date=datetime.date.today().isoformat(),
  )
  arrays["meta.json"] = np.asarray(json.dumps(meta))
  GOLDEN.parent.mkdir(exist_ok=True)
  tmp = GOLDEN.with_name(f".{GOLDEN.name}.tmp.npz")
  np.savez_compressed(tmp, **arrays)
  os.replace(tmp, GOLDEN)
  print(f"{GOLDEN}: {len(CASES)} cases, {GOLDEN.stat().st_size} bytes")


if __name__ == "__main__":
  if sys.argv[1:] != ["--record"]:
    sys.exit("usage: python tests/unit/test_decode_golden.py --record")
  # The XLA flags conftest sets for the tests: the recorded numerics are the tests' numerics.
  os.environ["XLA_FLAGS"] = " ".join(
    [*os.environ.get("XLA_FLAGS", "").split(), *FAST_COMPILE_FLAGS]
  )
  record()
