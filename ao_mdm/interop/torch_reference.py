"""AO-GPT in plain PyTorch (eager, float32), written the way the authors' model is written.

The one PyTorch forward of the project: the import tests check our key mapping against it, and
`ao-mdm bench train --baseline=torch` trains it as the opponent of our train step. Its
parameters carry the authors' state-dict names (scxue/AO-GPT-MDM) and are loaded from our params
with `torch_layout.to_torch_state_dict`, so both sides start from the same weights.

Like the authors' model it runs T+1 slots (X in array names, docs/design.md "Shape letters"):
slot 0 is the [None] token, slot s >= 1 holds the token at order[s-1] and predicts the token at
order[s]; the last slot has no target and its output is dropped. The forward covers both
variants; the training step (`Trainer`) is for AO-GPT (`variant="ao"`) only. Needs the `[torch]`
extra: import this module lazily.
"""

from collections.abc import Callable
import math
import time
from typing import Any

import flax.linen as flax_nn
import jax
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ao_mdm import model as model_lib
from ao_mdm import specs
from ao_mdm.interop import torch_layout
from ao_mdm.train import state as train_state


def _norm(cfg: specs.ModelSpec, dim: int) -> nn.Module:
  """RMSNorm (AO-GPT) or LayerNorm with bias (sigma-GPT); eps as in ao_mdm.model."""
  if cfg.variant == "ao":
    return nn.RMSNorm(dim, eps=model_lib.NORM_EPS)
  return nn.LayerNorm(dim, eps=model_lib.NORM_EPS)


def _adaln(cfg: specs.ModelSpec, n: int) -> nn.Sequential:
  """SiLU, then a Linear from the target conditioning to n modulation vectors of width D."""
  return nn.Sequential(nn.SiLU(), nn.Linear(cfg.cond_dim, n * cfg.n_embd))


class Attention(nn.Module):
  """Causal self-attention over the slots, with QK RMSNorm for AO-GPT."""

  def __init__(self, cfg: specs.ModelSpec):
    super().__init__()
    d, self.n_head = cfg.n_embd, cfg.n_head
    self.c_attn = nn.Linear(d, 3 * d)
    self.c_proj = nn.Linear(d, d)
    if cfg.variant == "ao":
      self.q_norm = _norm(cfg, d // self.n_head)
      self.k_norm = _norm(cfg, d // self.n_head)

  def forward(self, x_BXD: torch.Tensor) -> torch.Tensor:
    b, s, d = x_BXD.shape
    q, k, v = [
      z.view(b, s, self.n_head, d // self.n_head).transpose(1, 2)  # [B, H, X, K]
      for z in self.c_attn(x_BXD).split(d, dim=2)
    ]
    if hasattr(self, "q_norm"):
      q, k = self.q_norm(q), self.k_norm(k)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))


class MLP(nn.Module):
  """Linear to 4D, exact GELU, Linear back to D."""

  def __init__(self, cfg: specs.ModelSpec):
    super().__init__()
    self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
    self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
  """Pre-norm block; AO-GPT modulates both norms and gates both branches (AdaLN)."""

  def __init__(self, cfg: specs.ModelSpec):
    super().__init__()
    self.ln_1, self.attn = _norm(cfg, cfg.n_embd), Attention(cfg)
    self.ln_2, self.mlp = _norm(cfg, cfg.n_embd), MLP(cfg)
    if cfg.variant == "ao":
      self.adaLN = _adaln(cfg, 6)  # the authors' key

  def forward(self, x_BXD: torch.Tensor, c_BXC: torch.Tensor) -> torch.Tensor:
    if not hasattr(self, "adaLN"):
      x_BXD = x_BXD + self.attn(self.ln_1(x_BXD))
      return x_BXD + self.mlp(self.ln_2(x_BXD))
    shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN(c_BXC).chunk(6, dim=-1)
    x_BXD = x_BXD + gate1 * self.attn(self.ln_1(x_BXD) * (1 + scale1) + shift1)
    return x_BXD + gate2 * self.mlp(self.ln_2(x_BXD) * (1 + scale2) + shift2)


class FinalLayer(nn.Module):
  """AO-GPT's last RMSNorm, modulated by the target conditioning."""

  def __init__(self, cfg: specs.ModelSpec):
    super().__init__()
    self.ln_f = _norm(cfg, cfg.n_embd)
    self.adaLN_final = _adaln(cfg, 2)  # the authors' key

  def forward(self, x_BXD: torch.Tensor, c_BXC: torch.Tensor) -> torch.Tensor:
    shift, scale = self.adaLN_final(c_BXC).chunk(2, dim=-1)
    return self.ln_f(x_BXD) * (1 + scale) + shift


class TorchAOGPT(nn.Module):
  """AO-GPT or sigma-GPT (cfg.variant) with the authors' module tree and state-dict names."""

  def __init__(self, cfg: specs.ModelSpec):
    super().__init__()
    self.cfg = cfg
    ao = cfg.variant == "ao"
    d, t = cfg.n_embd, cfg.block_size
    wte = nn.Embedding(cfg.vocab_size, d)
    layers = dict(
      wte=wte,
      wpe=nn.Embedding(t + 1, d),
      wtpe=nn.Embedding(t, cfg.cond_dim if ao else d),
      wnonee=nn.Embedding(1, d),
      h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
    )
    if ao:
      layers["final_layer"] = FinalLayer(cfg)
    else:
      layers["ln_f"] = _norm(cfg, d)
    self.transformer = nn.ModuleDict(layers)
    self.lm_head = nn.Linear(d, cfg.vocab_size, bias=ao)
    if not ao:
      self.lm_head.weight = wte.weight  # sigma-GPT ties the head

  def forward(self, idx_BT: torch.Tensor, orders_BT: torch.Tensor) -> torch.Tensor:
    """Logits of the T+1 slots, [B, T+1, V]; the last slot has no target."""
    w: Any = self.transformer  # torch types the entries of a ModuleDict as Tensor | Module
    b, t = idx_BT.shape
    tok = torch.cat(
      [w.wnonee.weight.expand(b, 1, -1), w.wte(torch.gather(idx_BT, 1, orders_BT))], dim=1
    )
    pos = torch.cat([w.wpe.weight[:1].expand(b, 1, -1), w.wpe(orders_BT + 1)], dim=1)
    target = w.wtpe(orders_BT)
    c_BXC = torch.cat([target, torch.zeros_like(target[:, :1])], dim=1)  # the last slot: none
    x_BXD = tok + pos
    if self.cfg.variant == "sigma":
      x_BXD = x_BXD + c_BXC
    for block in w.h:
      x_BXD = block(x_BXD, c_BXC)
    x_BXD = w.final_layer(x_BXD, c_BXC) if self.cfg.variant == "ao" else w.ln_f(x_BXD)
    return self.lm_head(x_BXD)


def from_params(params: Any, cfg: specs.ModelSpec) -> TorchAOGPT:
  """The PyTorch model holding our params (boxed or not, on device or host), float32 on CPU."""
  model = TorchAOGPT(cfg)
  state = torch_layout.to_torch_state_dict(params, cfg)
  model.load_state_dict({k: torch.tensor(v) for k, v in state.items()})  # a copy: v is read-only
  return model


def logits(model: TorchAOGPT, tokens_BT: np.ndarray, order_BT: np.ndarray) -> np.ndarray:
  """[B, T, V] float32 logits where slot s predicts the token at order[s] (no gradient)."""
  with torch.no_grad():
    out = model(
      torch.as_tensor(np.asarray(tokens_BT), dtype=torch.long),
      torch.as_tensor(np.asarray(order_BT), dtype=torch.long),
    )
  return out[:, :-1].numpy()


def loss(model: TorchAOGPT, idx_BT: torch.Tensor, orders_BT: torch.Tensor) -> torch.Tensor:
  """Mean NLL over all B*T targets (= the mean of per-sequence means), integer labels."""
  out = model(idx_BT, orders_BT)[:, :-1].contiguous()
  return F.cross_entropy(out.view(-1, out.shape[-1]), torch.gather(idx_BT, 1, orders_BT).view(-1))


def mixed_orders(
  batch: int, t: int, random_ratio: float, generator: torch.Generator
) -> torch.Tensor:
  """[batch, t] orders: a random permutation with probability random_ratio, else 0..t-1."""
  coins = torch.rand(batch, generator=generator) < random_ratio
  return torch.stack(
    [torch.randperm(t, generator=generator) if coin else torch.arange(t) for coin in coins.tolist()]
  )


def order_ratio(order: specs.OrderSpec) -> float:
  """The random-order probability of an order config the baseline can draw (mixed/random/l2r)."""
  ratios = {"random": 1.0, "l2r": 0.0, "mixed": float(order.random_ratio)}
  if order.kind not in ratios:
    raise ValueError(
      f"order.kind={order.kind!r}: the PyTorch baseline draws {', '.join(ratios)} orders only"
    )
  return ratios[order.kind]


def check_train_config(config: specs.Spec) -> None:
  """Raise one clear ValueError for a training config the PyTorch step cannot run."""
  if config.model.variant != "ao":
    raise ValueError(
      f"model.variant={config.model.variant!r}: the PyTorch training step is "
      "written for AO-GPT (ao) only"
    )
  order_ratio(config.order)


class Trainer:
  """The authors' training step on our recipe: AdamW with our weight-decay mask, global-norm
  clip, our warmup-cosine schedule, gradient accumulation over train.microbatches and our EMA.

  `step(idx_BT, orders_BT)` trains on one global batch and returns the loss; `step_count` is
  the number of steps taken (the lr of step n is the schedule at n, as in ao_mdm.train).
  """

  def __init__(self, params: Any, config: specs.Spec):
    check_train_config(config)
    train = config.train
    self.model = from_params(params, config.model)
    decays = _decay_flags(params, config)
    groups = [
      [p for n, p in self.model.named_parameters() if decays[n] == flag] for flag in (True, False)
    ]
    self.optimizer = torch.optim.AdamW(
      [
        {"params": groups[0], "weight_decay": train.weight_decay},
        {"params": groups[1], "weight_decay": 0.0},
      ],
      lr=0.0,
      betas=(train.b1, train.b2),
      eps=1e-8,
    )
    self.schedule: Callable = jax.jit(train_state.learning_rate_schedule(train))
    self.grad_clip, self.ema_decay = train.grad_clip, train.ema_decay
    self.microbatches = train.microbatches
    self.ema = [p.detach().clone() for p in self.model.parameters()]
    self.step_count = 0

  def step(self, idx_BT: torch.Tensor, orders_BT: torch.Tensor) -> float:
    """One optimizer step on the batch with the given orders; returns its mean loss."""
    lr = float(self.schedule(self.step_count))
    for group in self.optimizer.param_groups:
      group["lr"] = lr
    total = 0.0
    m = self.microbatches
    for i in range(m):  # micro-batch i takes rows i, i + m, ..., as in ao_mdm.train
      micro = loss(self.model, idx_BT[i::m], orders_BT[i::m]) / m
      micro.backward()
      total += micro.item()
    nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)
    self.step_count += 1
    n = self.step_count
    decay = min(self.ema_decay, (1.0 + n) / (10.0 + n))
    with torch.no_grad():
      for e, p in zip(self.ema, self.model.parameters()):
        e.lerp_(p, 1.0 - decay)
    return total

  def state_dicts(self) -> tuple[dict, dict]:
    """(params, EMA params) as numpy arrays under the authors' state-dict names."""
    names = [n for n, _ in self.model.named_parameters()]
    params = {n: p.detach().numpy().copy() for n, p in self.model.named_parameters()}
    return params, {n: e.numpy().copy() for n, e in zip(names, self.ema)}


def _decay_flags(params: Any, config: specs.Spec) -> dict[str, bool]:
  """Per PyTorch parameter name: decayed under our `state.weight_decay_mask`?"""
  params = flax_nn.unbox(params)
  mask = train_state.weight_decay_mask(params)
  filled = jax.tree.map(lambda p, m: np.full(np.shape(p), m, np.float32), params, mask)
  return {
    k: bool(v.all()) for k, v in torch_layout.to_torch_state_dict(filled, config.model).items()
  }


def time_steps(
  trainer: Trainer,
  tokens_BT: np.ndarray,
  random_ratio: float,
  warmup: int,
  repeats: int,
  seed: int = 0,
) -> list[float]:
  """Wall seconds of `repeats` steps after `warmup` steps, orders drawn afresh in each step."""
  idx = torch.as_tensor(np.asarray(tokens_BT), dtype=torch.long)
  generator = torch.Generator().manual_seed(seed)
  b, t = idx.shape
  times = []
  for i in range(warmup + repeats):
    start = time.perf_counter()
    out = trainer.step(idx, mixed_orders(b, t, random_ratio, generator))
    if not math.isfinite(out):
      raise FloatingPointError(f"PyTorch baseline: loss {out} at step {i}")
    times.append(time.perf_counter() - start)
  return times[warmup:]
