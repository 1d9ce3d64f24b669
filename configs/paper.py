"""The paper's models on OpenWebText (Xue et al., arXiv 2506.19935). Use `--config=configs/paper.py:NAME`.

NAME (what it reproduces):
  ao_small, ao_medium          AO-GPT, mixed(0.9) orders: Tables 1 and 5
  ao_small_random              AO-GPT, pure any-order (random_ratio=1.0): Tables 1 and 5
  ar_small                     L2R autoregressive baseline, AO-GPT network, identity order: Table 1
  ao_small_fixed{0,1,2}        three fixed random orders of the order study: Fig. 2a
  ao_small_blockwise           blockwise order b=4, pattern (0, 2, 3, 1): Fig. 2a
  sigma_small, sigma_medium    sigma-GPT baseline with mixed(0.9) orders: Tables 1 and 5
Hyperparameters: AdamW lr 6e-4 (Small) / 3e-4 (Medium), betas (0.9, 0.95), weight decay 0.05,
warmup 2000, cosine to 6e-5, clip 1.0, EMA 0.9999, 512 x 1024 = 0.5M tokens per step,
GPT-2 BPE vocab 50304.
"""
import ml_collections

from ao_mdm.config import base_config

# microbatches: gradient accumulation that fits 512 x 1024 tokens per step on a v5e:4x4 slice
# (16 GiB per chip), measured with `ao-mdm compile` (docs/launching.md).
SIZES = {"small": dict(n_layer=12, n_embd=768, n_head=12, learning_rate=6e-4, microbatches=8),
         "medium": dict(n_layer=24, n_embd=1024, n_head=16, learning_rate=3e-4, microbatches=16)}
FIXED_ORDER_SEEDS = (0, 1, 2)  # Fig. 2a: three permutations drawn from these seeds


def get_config(name: str = "ao_small") -> ml_collections.ConfigDict:
  variant, size, *order = name.split("_")
  if variant not in ("ao", "ar", "sigma") or size not in SIZES:
    raise ValueError(f"unknown paper config {name!r}; see the docstring of configs/paper.py")
  s = SIZES[size]
  c = base_config()
  c.model.update(variant="sigma" if variant == "sigma" else "ao", vocab_size=50304,
                 block_size=1024, n_layer=s["n_layer"], n_embd=s["n_embd"], n_head=s["n_head"],
                 dtype="bfloat16")
  c.order.update(kind="mixed", random_ratio=0.9)
  if variant == "ar":
    c.order.kind = "l2r"
  elif order == ["random"]:
    c.order.random_ratio = 1.0
  elif order == ["blockwise"]:
    c.order.update(kind="blockwise", block=4, pattern=(0, 2, 3, 1))
  elif order and order[0].startswith("fixed") and int(order[0][5:]) in FIXED_ORDER_SEEDS:
    c.order.update(kind="fixed", fixed_seed=int(order[0][5:]))
  elif order:
    raise ValueError(f"unknown paper config {name!r}; see the docstring of configs/paper.py")
  c.data.update(dataset="openwebtext", tokenizer="gpt2")
  c.train.update(batch_size=512, microbatches=s["microbatches"], num_steps=1_000_000,
                 learning_rate=s["learning_rate"],
                 min_lr=6e-5, warmup_steps=2000, weight_decay=0.05, b1=0.9, b2=0.95,
                 grad_clip=1.0, ema_decay=0.9999, log_every=100, checkpoint_every=5000, eval_every=5000,
                 eval_batches=16)
  c.mesh.ici = (1, -1, 1)  # FSDP over the slice; DCN data parallelism across slices
  return c
