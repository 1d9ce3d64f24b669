"""The model against docs/design.md, "The model": sizes, causality in order space, slots."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ao_mdm import model as model_lib
from ao_mdm import orders, specs
from helpers import default_stage_keeps

PAPER_SIZES = [  # (variant, L, D, H, parameters) from the paper's configurations
  ("ao", 12, 768, 12, 170_605_952),
  ("ao", 24, 1024, 16, 425_804_928),
  ("sigma", 12, 768, 12, 125_263_872),
  ("sigma", 24, 1024, 16, 355_921_920),
]


def small_cfg(variant="ao", t=16):
  return specs.default().model.replace(
    variant=variant, block_size=t, vocab_size=64, n_layer=2, n_embd=32, n_head=4
  )


@pytest.mark.parametrize("variant,layers,width,heads,expected", PAPER_SIZES)
def test_paper_parameter_counts(variant, layers, width, heads, expected):
  cfg = specs.default().model.replace(
    variant=variant, n_layer=layers, n_embd=width, n_head=heads, block_size=1024, vocab_size=50304
  )
  shapes = nn.unbox(jax.eval_shape(lambda k: model_lib.init_params(cfg, k), jax.random.key(0)))
  assert model_lib.count_params(shapes) == expected


def _forward(cfg, params, tokens, order):
  return model_lib.make_model(cfg).apply({"params": params}, tokens, order)


@pytest.fixture(scope="module", params=["ao", "sigma"])
def setup(request):
  cfg = small_cfg(request.param)
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(1)))
  # Random init gives near-uniform logits; scale the weights up so differences are visible.
  params = jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)
  return cfg, params


def test_causality_in_order_space(setup):
  cfg, params = setup
  t = cfg.block_size
  rng = np.random.default_rng(0)
  for trial in range(3):
    order = orders.random_orders(jax.random.key(trial), 1, t)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, t)), jnp.int32)
    base = _forward(cfg, params, tokens, order)
    sigma = np.asarray(order[0])
    for s in (1, t // 2, t - 1):
      # Changing every token at sigma[s:] leaves slots 0..s unchanged (slot s sees sigma[:s]).
      changed = np.asarray(tokens).copy()
      changed[0, sigma[s:]] = (changed[0, sigma[s:]] + 1) % cfg.vocab_size
      out = _forward(cfg, params, jnp.asarray(changed), order)
      np.testing.assert_allclose(out[0, : s + 1], base[0, : s + 1], atol=1e-5)
      # Changing one token in sigma[:s] changes slot s.
      seen = np.asarray(tokens).copy()
      seen[0, sigma[s - 1]] = (seen[0, sigma[s - 1]] + 1) % cfg.vocab_size
      out = _forward(cfg, params, jnp.asarray(seen), order)
      assert np.abs(np.asarray(out[0, s] - base[0, s])).max() > 1e-4


def test_target_conditioning(setup):
  cfg, params = setup
  t = cfg.block_size
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, t)), jnp.int32)
  order = np.asarray(orders.random_orders(jax.random.key(5), 1, t))
  base = _forward(cfg, params, tokens, jnp.asarray(order))
  for s, later in ((0, 3), (4, t - 1), (7, 9)):
    swapped = order.copy()
    swapped[0, [s, later]] = swapped[0, [later, s]]
    out = _forward(cfg, params, tokens, jnp.asarray(swapped))
    assert np.abs(np.asarray(out[0, s] - base[0, s])).max() > 1e-4
    np.testing.assert_allclose(out[0, :s], base[0, :s], atol=1e-5)


def test_hidden_states_on_request(setup):
  """return_hidden gives the same logits and the hidden states that `logits` reads them from
  (what the draft head is trained on); the hidden states are those of the layer stack."""
  cfg, params = setup
  t = cfg.block_size
  model = model_lib.make_model(cfg)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, t)), jnp.int32)
  order = orders.random_orders(jax.random.key(4), 2, t)
  logits, h_BTD = model.apply({"params": params}, tokens, order, return_hidden=True)
  assert h_BTD.shape == (2, t, cfg.n_embd)
  np.testing.assert_array_equal(logits, _forward(cfg, params, tokens, order))
  prev_tok, prev_pos = model_lib.slot_inputs(tokens, order)
  x_BTD, cond = model.apply({"params": params}, prev_tok, prev_pos, order, method="embed")
  stacked, _ = model.apply({"params": params}, x_BTD, cond, method="stack")
  np.testing.assert_allclose(h_BTD, stacked, atol=1e-6)
  np.testing.assert_allclose(
    model.apply({"params": params}, h_BTD, cond, method="logits"), logits, atol=1e-5
  )


def test_slot_bookkeeping(setup):
  cfg, params = setup
  t = cfg.block_size
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, t)), jnp.int32)
  order = orders.random_orders(jax.random.key(3), 2, t)
  logits = np.asarray(_forward(cfg, params, tokens, order), np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  tok, sig = np.asarray(tokens), np.asarray(order)
  by_hand = np.mean([[-logp[b, s, tok[b, sig[b, s]]] for s in range(t)] for b in range(2)])
  from ao_mdm.train import step as train_step

  loss = float(jnp.mean(train_step.sequence_nll(model_lib.make_model(cfg), params, tokens, order)))
  np.testing.assert_allclose(loss, by_hand, rtol=1e-5)
  # Identity order: ordinary next-token prediction; slot 0 predicts x[0] from [None] alone.
  ident = orders.identity(2, t)
  out = _forward(cfg, params, tokens, ident)
  other = _forward(cfg, params, (tokens + 7) % cfg.vocab_size, ident)
  np.testing.assert_allclose(out[:, 0], other[:, 0], atol=1e-5)
  labels = model_lib.slot_labels(tokens, ident)
  np.testing.assert_array_equal(labels, tokens)


def test_init_statistics():
  cfg = small_cfg("ao", t=64).replace(n_embd=256, n_head=4, vocab_size=1024)
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  emb = np.asarray(params["token_embed"])
  assert np.abs(emb).max() <= 0.06 + 1e-6  # truncated at 3 std
  np.testing.assert_allclose(emb.std(), 0.02 * 0.9866, rtol=0.03)  # std of N(0,1) cut at 3
  out = np.asarray(params["blocks"]["mlp_out"]["kernel"])
  np.testing.assert_allclose(out.std(), 0.02 / np.sqrt(2 * cfg.n_layer) * 0.9866, rtol=0.03)
  assert not np.any(params["head"]["bias"]) and np.all(params["ln_f"]["scale"] == 1)
  assert np.abs(np.asarray(params["blocks"]["adaln"]["kernel"])).max() > 0  # not zero-init
  for name in ("pos_embed", "target_embed"):
    np.testing.assert_allclose(np.asarray(params[name]).std(), 0.02 * 0.9866, rtol=0.05)
  wide = nn.unbox(model_lib.init_params(cfg.replace(position_std=0.1), jax.random.key(0)))
  for name in ("pos_embed", "target_embed"):  # model.position_std: these two tables only
    np.testing.assert_allclose(np.asarray(wide[name]).std(), 0.1 * 0.9866, rtol=0.05)
  np.testing.assert_array_equal(wide["token_embed"], params["token_embed"])


def test_bad_model_config():
  with pytest.raises(ValueError, match="n_embd=30 is not divisible by model.n_head=4"):
    small_cfg().replace(n_embd=30)
  with pytest.raises(ValueError, match="model.variant='bert'"):
    small_cfg().replace(variant="bert")


def test_the_attention_and_remat_registries_hold_the_specs_names():
  assert list(model_lib.ATTENTION) == [a for a in specs.ATTENTION if a != "auto"]
  assert list(model_lib.REMAT) == list(specs.REMAT)


def test_a_variant_is_one_registry_entry(monkeypatch):
  """AO-GPT with its token embedding as the head, added as one entry of specs.VARIANTS: the
  params of AO-GPT but the head, the logits of AO-GPT whose head is the embedding (no bias),
  the FLOPs of the same matmuls."""
  tied = dataclasses.replace(specs.VARIANTS["ao"], tied_head=True)
  monkeypatch.setitem(specs.VARIANTS, "ao_tied", tied)
  cfg, ao_cfg = small_cfg("ao_tied"), small_cfg("ao")
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  ao = nn.unbox(model_lib.init_params(ao_cfg, jax.random.key(0)))
  assert set(ao) - set(params) == {"head"} and set(params) <= set(ao)
  ao["head"] = {"kernel": ao["token_embed"].T, "bias": jnp.zeros(cfg.vocab_size)}
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
  order = orders.random_orders(jax.random.key(1), 2, 16)
  np.testing.assert_allclose(
    _forward(cfg, params, tokens, order), _forward(ao_cfg, ao, tokens, order), atol=1e-6
  )
  n, n_ao = model_lib.count_params(params), model_lib.count_params(ao)
  assert n_ao - n == cfg.vocab_size * (cfg.n_embd + 1)
  fpt = model_lib.flops_per_token
  assert fpt(cfg, n) == fpt(ao_cfg, n_ao) - 6 * cfg.vocab_size  # less the head's bias


def test_sequence_longer_than_block_size():
  cfg = small_cfg()
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  t = cfg.block_size + 1
  with pytest.raises(ValueError, match="block_size=16"):
    _forward(cfg, params, jnp.zeros((1, t), jnp.int32), orders.identity(1, t))


@pytest.mark.parametrize(
  "key,value",
  default_stage_keeps(
    [("remat", "full"), ("remat", "dots"), ("unroll_layers", True)], [("remat", "dots")]
  ),
)
def test_layer_schedules_give_the_same_gradients(key, value):
  """Remat policies and the unrolled layer scan change the schedule only."""
  from ao_mdm.train import step as train_step

  cfg = small_cfg()
  tokens = jnp.asarray(
    np.random.default_rng(0).integers(0, cfg.vocab_size, (2, cfg.block_size)), jnp.int32
  )
  order = orders.random_orders(jax.random.key(0), 2, cfg.block_size)
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  grads = []
  for c in (cfg, cfg.replace(**{key: value})):
    m = model_lib.make_model(c)
    grads.append(jax.grad(lambda p: train_step.sequence_nll(m, p, tokens, order).mean())(params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), *grads)


def test_adaln_from_the_target_table_equals_per_slot():
  """B x W > T slots take AdaLN from the T-row table (then gather); one row alone computes it
  per slot. Both must give the same logits."""
  cfg = small_cfg()
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(2)))
  params = jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)
  b, t = 3, cfg.block_size
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
  order = orders.random_orders(jax.random.key(3), b, t)
  together = _forward(cfg, params, tokens, order)  # 3T rows > T: the table path
  for i in range(b):  # T rows: the per-slot path
    alone = _forward(cfg, params, tokens[i : i + 1], order[i : i + 1])
    np.testing.assert_allclose(alone[0], together[i], rtol=1e-5, atol=1e-5)
  probe = nn.Dense(4)
  c_TC = jax.random.normal(jax.random.key(4), (t, 8))
  target_BW = order[:, :6]  # 18 slots > T = 16: the table path
  p = probe.init(jax.random.key(5), c_TC)
  rows = probe.apply(p, jnp.take(c_TC, target_BW, axis=0)).reshape(3, 6, 2, 2)
  table = probe.apply(
    p,
    (c_TC, target_BW),
    method=lambda m, cond: model_lib.per_slot(lambda c: m(c).reshape(c.shape[0], 2, 2), cond),
  )
  for i in range(2):
    np.testing.assert_allclose(table[i], rows[:, :, i], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
def test_cudnn_attention_matches_xla_on_gpu():
  """model.attention=cudnn (training path) gives the XLA attention's logits, in bf16."""
  cfg = small_cfg().replace(dtype="bfloat16", n_embd=128, n_head=2, cond_dim=128)  # head dim 64
  tokens = jnp.asarray(
    np.random.default_rng(0).integers(0, cfg.vocab_size, (2, cfg.block_size)), jnp.int32
  )
  order = orders.random_orders(jax.random.key(0), 2, cfg.block_size)
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  xla = np.asarray(_forward(cfg, params, tokens, order), np.float32)
  cudnn = np.asarray(_forward(cfg.replace(attention="cudnn"), params, tokens, order), np.float32)
  np.testing.assert_allclose(cudnn, xla, atol=0.05, rtol=0.05)


@pytest.mark.slow  # the kernel interpreted on CPU, 10 s a variant: a TPU path
@pytest.mark.parametrize("variant", ["ao", "sigma"])
def test_splash_attention_equals_xla_attention_in_interpret_mode(variant):
  """The Pallas splash kernel (interpreted on CPU) gives XLA attention's logits and gradients:
  T=384 is three of its 128-slot blocks, 4 heads, AO-GPT with its QK-norm. Measured: logits
  within 2e-6, gradients within 5e-8; the bounds leave a factor of 10."""
  cfg = small_cfg(variant, t=384).replace(n_embd=64, n_head=4, cond_dim=16)
  params = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  params = jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, params)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 384)), jnp.int32)
  order = orders.random_orders(jax.random.key(1), 2, 384)
  got = {}
  for attention in ("xla", "splash"):
    c = cfg.replace(attention=attention)
    assert model_lib.attention_kind(c, "cpu", 384) == attention
    loss = lambda p, c=c: model_lib.slot_nll(model_lib.make_model(c), p, tokens, order).mean()
    got[attention] = (
      jax.jit(lambda p, c=c: _forward(c, p, tokens, order))(params),
      jax.jit(jax.grad(loss))(params),
    )
  np.testing.assert_allclose(got["splash"][0], got["xla"][0], atol=2e-5, rtol=0)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=5e-7, rtol=0),
    got["splash"][1],
    got["xla"][1],
  )


def test_auto_attention_by_platform_and_length():
  cfg = small_cfg(t=256)
  assert [model_lib.attention_kind(cfg, p, 256) for p in ("cpu", "tpu", "gpu")] == [
    "xla",
    "splash",
    "xla",
  ]  # cuDNN takes bfloat16 only
  assert model_lib.attention_kind(cfg.replace(dtype="bfloat16"), "gpu", 256) == "cudnn"
  assert model_lib.attention_kind(cfg, "tpu", 96) == "xla"  # a forward cut short of 128 blocks
  assert model_lib.attention_kind(cfg.replace(attention="xla"), "tpu", 256) == "xla"
  with pytest.raises(ValueError, match="attention='splash' needs model.block_size a multiple"):
    small_cfg(t=64).replace(attention="splash")
