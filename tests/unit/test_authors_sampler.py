"""Our sampler against a PyTorch port of the authors' sampling (scxue/AO-GPT-MDM,
model_AOGPT_generate.py): the per-step counts against torch's own float32 ops; greedy
unconditional decoding (`generate`) token for token through their KV-cache loop; prompted
decoding (`cond_generate`) equal to ours once its cache pass uses the training forward's causal
mask, and different under its own upper-triangular one.
"""

import math

import numpy as np
import pytest

from ao_mdm import specs
from ao_mdm.decode import options, parallel, schedules

torch = pytest.importorskip("torch")


def torch_counts(t: int, known: int, steps: int, schedule: str) -> list:
  """Their count rule with torch float32 tensors, as in `generate` / `cond_generate`."""
  time = torch.linspace(1, 0, steps + 1)
  if schedule == "cosine":
    time = torch.cos((1 - time) * math.pi * 0.5)
  reached = (known + ((t - known) * (1 - time[1:])).to(torch.int64)).tolist()  # int() of each
  counts = [known]
  for n in reached:
    counts.append(max(n, counts[-1] + 1))
  return counts


@pytest.mark.parametrize("schedule", options.SCHEDULES)
@pytest.mark.parametrize("known", [0, 16])
def test_counts_equal_torch_float32_for_every_step_count(schedule, known):
  t = 1024
  for steps in range(1, t - known + 1):
    assert schedules.schedule_counts(t, known, steps, schedule).tolist() == torch_counts(
      t, known, steps, schedule
    ), steps


# --- A PyTorch port of the authors' KV-cache decoding loop, on ao_mdm.torch_reference's modules.
# Slot inputs, targets, masks and cache handling follow model_AOGPT_generate.py
# (forward_fn_generate_first_step, forward_fn_cond_cache_first_step, forward_fn_generate and the
# three _make_*_mask helpers); greedy argmax stands in for top_p_sampling_from_probs.

T = 16


def _attend(attn, x_BSD, past, allowed_SK):
  """Their CausalSelfAttention.forward: K/V appended to the layer's cache, an explicit mask."""
  b, s, d = x_BSD.shape
  q, k, v = [
    z.view(b, s, attn.n_head, d // attn.n_head).transpose(1, 2)
    for z in attn.c_attn(x_BSD).split(d, dim=2)
  ]
  q, k = attn.q_norm(q), attn.k_norm(k)
  if past is not None:
    k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
  y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed_SK)
  return attn.c_proj(y.transpose(1, 2).reshape(b, s, d)), (k, v)


def _stack(model, x_BSD, c_BSC, cache, allowed_SK):
  """Every block (their Block.forward, AdaLN), then the final layer; the new per-layer K/V."""
  kv = []
  for i, blk in enumerate(model.transformer.h):
    shift1, scale1, gate1, shift2, scale2, gate2 = blk.adaLN(c_BSC).chunk(6, dim=-1)
    h, layer_kv = _attend(
      blk.attn,
      blk.ln_1(x_BSD) * (1 + scale1) + shift1,
      None if cache is None else cache[i],
      allowed_SK,
    )
    x_BSD = x_BSD + gate1 * h
    x_BSD = x_BSD + gate2 * blk.mlp(blk.ln_2(x_BSD) * (1 + scale2) + shift2)
    kv.append(layer_kv)
  return model.transformer.final_layer(x_BSD, c_BSC), kv


def _step(model, cache, last_tok, last_pos, targets):
  """forward_fn_generate: the previous step's tokens as real slots (the last one predicts the
  first new target), then one phantom per further target, a copy of the last real slot's input;
  a real slot sees the cache and the real slots up to itself, a phantom the cache, the real
  slots before the last one, and itself. Returns the logits of the targets and the new cache
  (the real slots' K/V appended)."""
  w = model.transformer
  n_last, n_new = last_pos.shape[1], targets.shape[1]
  idx = torch.cat([last_tok, last_tok[:, -1:].repeat(1, n_new - 1)], dim=1)
  pos = torch.cat([last_pos, last_pos[:, -1:].repeat(1, n_new - 1)], dim=1)
  target = torch.cat([last_pos[:, 1:], targets], dim=1)
  rows, past = n_last + n_new - 1, cache[0][0].shape[2]
  allowed = torch.tril(torch.ones(rows, rows, dtype=torch.bool))  # _make_causal_with_parallel_mask
  allowed[-n_new:, -n_new:] = torch.eye(n_new, dtype=torch.bool)
  allowed = torch.cat([torch.ones(rows, past, dtype=torch.bool), allowed], dim=1)
  h, kv = _stack(model, w.wte(idx) + w.wpe(pos + 1), w.wtpe(target), cache, allowed)
  cache = [(k[:, :, : past + n_last], v[:, :, : past + n_last]) for k, v in kv]
  return model.lm_head(h[:, -n_new:]), cache


def _unshuffle(tokens_BT, orders_BT):
  out = torch.zeros_like(tokens_BT)
  out.scatter_(1, orders_BT, tokens_BT)
  return out


def _time(steps, schedule):
  time = torch.linspace(1, 0, steps + 1)
  return time if schedule == "linear" else torch.cos((1 - time) * math.pi * 0.5)


def authors_generate(model, orders_BT, steps, schedule):
  """Their `generate`, greedy: step 1 feeds [None] to every target of the step (identity mask,
  only the first slot's K/V cached), every later step runs _step."""
  w = model.transformer
  b, t = orders_BT.shape
  time = _time(steps, schedule)
  n_next = max(int(t * (1 - time[1])), 1)  # their 1024 is the block size
  targets = orders_BT[:, :n_next]
  x = (w.wnonee.weight + w.wpe.weight[0]).expand(b, n_next, -1)
  h, kv = _stack(model, x, w.wtpe(targets), None, torch.eye(n_next, dtype=torch.bool))
  cache = [(k[:, :, :1], v[:, :, :1]) for k, v in kv]
  tokens = model.lm_head(h).argmax(-1)
  total, last_tok, last_pos = tokens, tokens, targets
  for i in range(1, steps):
    n_cur = n_next
    n_next = max(int(t * (1 - time[i + 1])), n_cur + 1)
    targets = orders_BT[:, n_cur:n_next]
    logits, cache = _step(model, cache, last_tok, last_pos, targets)
    tokens = logits.argmax(-1)
    total, last_tok, last_pos = torch.cat([total, tokens], dim=1), tokens, targets
  return _unshuffle(total, orders_BT).numpy()


def authors_cond_generate(model, ids, locs, steps, schedule, cache_mask="authors"):
  """Their `cond_generate`, greedy, for one known context shared by the batch (B = 1 here):
  the unknown positions in ascending order after the known ones; the known tokens' K/V are
  cached in one pass whose mask is theirs (`_make_causal_mask`: slot i sees slots j >= i) or,
  cache_mask="causal", the training forward's (j <= i). Returns the tokens and the logits of
  the first step's targets."""
  w = model.transformer
  t = w.wtpe.weight.shape[0]
  ids, locs = torch.as_tensor(ids)[None], torch.as_tensor(locs)[None]
  n_known = ids.shape[1]
  missing = torch.tensor([p for p in range(t) if p not in locs[0].tolist()])
  orders = torch.cat([locs[0], missing])[None]
  tok = torch.cat([w.wnonee.weight[None], w.wte(ids[:, :-1])], dim=1)
  pos = torch.cat([w.wpe.weight[:1][None], w.wpe(locs[:, :-1] + 1)], dim=1)
  upper = torch.triu(torch.ones(n_known, n_known, dtype=torch.bool))
  allowed = upper if cache_mask == "authors" else upper.T
  _, cache = _stack(model, tok + pos, w.wtpe(locs), None, allowed)
  time = _time(steps, schedule)
  total, last_tok, last_pos, n_next, first = ids, ids[:, -1:], locs[:, -1:], n_known, None
  for i in range(1, steps + 1):
    n_cur = n_next
    n_next = max(n_known + int((t - n_known) * (1 - time[i])), n_cur + 1)
    targets = orders[:, n_cur:n_next]
    logits, cache = _step(model, cache, last_tok, last_pos, targets)
    first = logits[0].numpy() if first is None else first
    tokens = logits.argmax(-1)
    total, last_tok, last_pos = torch.cat([total, tokens], dim=1), tokens, targets
  return _unshuffle(total, orders)[0].numpy(), first


_MODEL = {}


def tiny():
  """A random AO-GPT (T = 16, V = 64), ours and its PyTorch copy. Every leaf is drawn with
  std 0.5 (norm scales around 1): at the init's scale (std 0.02, AdaLN gates near 0) the logits
  hardly depend on the context, and a wrong attention mask in the port would go unseen (with
  these weights, phantoms that also see the chunk's last real slot fail every case with
  phantoms, and a causal cache pass in place of theirs fails the prompted test)."""
  if not _MODEL:
    import flax
    import jax

    from ao_mdm import model as model_lib
    from ao_mdm.interop import torch_reference

    cfg = specs.default().model.replace(
      block_size=T, vocab_size=64, n_layer=2, n_embd=32, n_head=4, cond_dim=16
    )
    shapes = flax.linen.unbox(jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0))))
    rng = np.random.default_rng(0)
    params = flax.traverse_util.unflatten_dict(
      {
        path: (path[-1] == "scale") + rng.normal(0, 0.5, leaf.shape).astype(np.float32)
        for path, leaf in flax.traverse_util.flatten_dict(shapes).items()
      }
    )
    _MODEL.update(cfg=cfg, params=params, torch=torch_reference.from_params(params, cfg).eval())
  return _MODEL["cfg"], _MODEL["params"], _MODEL["torch"]


# Each S compiles its own decode loop (7-13 s on 2 busy cores): four in the default run.
@pytest.mark.parametrize(
  "steps,schedule",
  [
    (1, "linear"),
    (5, "linear"),
    (3, "cosine"),
    (T, "cosine"),
    pytest.param(6, "cosine", marks=pytest.mark.slow),
    pytest.param(7, "linear", marks=pytest.mark.slow),
  ],
)
def test_unconditional_greedy_equals_the_authors_loop(steps, schedule):
  cfg, params, model = tiny()
  out = parallel.sample(
    params, cfg, batch_size=4, steps=steps, schedule=schedule, temperature=0, seed=steps
  )
  with torch.no_grad():
    want = authors_generate(model, torch.tensor(out.order, dtype=torch.long), steps, schedule)
  np.testing.assert_array_equal(out.tokens, want)


def test_prompted_greedy_equals_the_authors_loop_with_the_training_mask_only():
  """With a causal cache pass, their cond_generate gives our tokens (our default order for a
  prompt is theirs, left to right); with their upper-triangular cache mask the known tokens'
  K/V differ from the training forward's, and so do the logits."""
  cfg, params, model = tiny()
  ids, locs, steps = [5, 17, 33, 2], [0, 1, 2, 3], 5
  out = parallel.sample(
    params,
    cfg,
    batch_size=1,
    steps=steps,
    schedule="cosine",
    temperature=0,
    known_positions=locs,
    known_tokens=ids,
    return_logits=True,
  )
  with torch.no_grad():
    fixed, fixed_first = authors_cond_generate(model, ids, locs, steps, "cosine", "causal")
    theirs, their_first = authors_cond_generate(model, ids, locs, steps, "cosine", "authors")
  np.testing.assert_array_equal(out.tokens[0], fixed)
  first = out.order[0, 4 : 4 + len(fixed_first)]  # the first step's targets
  ours = out.logits[0, first]
  np.testing.assert_allclose(fixed_first, ours, atol=1e-4, rtol=1e-4)
  assert np.abs(their_first - ours).max() > 0.5  # float32 noise is about 1e-5
  assert not np.array_equal(theirs, fixed)
