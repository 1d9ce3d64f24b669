"""The paper's training recipes, value by value from the authors' code (scxue/AO-GPT-MDM).

`paper_config(NAME)` builds each run; `configs/paper.py:NAME` and `ao-mdm import-torch` use it.
Every value cites the authors' file it mirrors (config_larger_model_v3/*.py, config_order/*.py,
train_AOGPT_CL.py defaults); "no authors' source" marks a value chosen here, with the reason.
docs/reproducing.md has the same table with every difference explained.
"""

import ml_collections

from ao_mdm.config import base_config

# config_larger_model_v3/train_AOGPT_AdaLN6_NoRep_cond_128{,_350M}.py: model size and peak lr.
# microbatches: gradient accumulation that fits 1024 x 1024 tokens per step on a v5e:4x4 slice
# (16 GiB per chip), measured with `ao-mdm compile` (docs/launching.md); the authors use
# 16 sequences per GPU x 64 accumulation steps over 8 GPUs per 8 steps, i.e. 1024 sequences.
SIZES = {
  "small": dict(n_layer=12, n_embd=768, n_head=12, learning_rate=6e-4, microbatches=16),
  "medium": dict(n_layer=24, n_embd=1024, n_head=16, learning_rate=3e-4, microbatches=32),
}

# Shared by every run (train_AOGPT_CL.py defaults unless a config file overrides them).
RECIPE = dict(
  batch_size=1024,  # configs: batch_size 16 x gradient_accumulation_steps 8*8 (global count)
  num_steps=500_000,  # configs: max_iters
  lr_decay_steps=500_000,  # configs: lr_decay_iters
  warmup_steps=2000,  # train_AOGPT_CL.py: warmup_iters
  min_lr=6e-5,  # train_AOGPT_CL.py: min_lr (also for Medium, whose peak is 3e-4)
  weight_decay=0.05,  # configs: weight_decay = 5e-2
  b1=0.9,  # train_AOGPT_CL.py: beta1
  b2=0.95,  # configs: beta2
  grad_clip=1.0,  # train_AOGPT_CL.py: grad_clip
  # configs: ema_rate = 1 - 1e-4; ema.py's update rule, warm-up min(rate, (1+n)/(10+n)),
  # is ours (train.make_train_step).
  ema_decay=0.9999,
  log_every=100,
  checkpoint_every=10_000,
  eval_every=2500,
  eval_batches=16,
)

# The order study (Fig. 2a), config_order/train_AOGPT_{order1,order2,order3,AR}.py: batch_size 32
# x gradient_accumulation_steps 2*8 = 512 sequences, max_iters 20000, lr_decay_iters 500000.
ORDER_STUDY = dict(batch_size=512, num_steps=20_000, lr_decay_steps=500_000, eval_every=1000)

NAMES = {
  "ao_small": "AO-GPT Small, mixed(0.9) orders: Tables 1 and 5",
  "ao_medium": "AO-GPT Medium, mixed(0.9) orders: Tables 1 and 5",
  "ao_small_random": "AO-GPT Small, pure any-order (the authors' NoCL run): Tables 1 and 5",
  "ar_small": "L2R baseline, AO-GPT network, identity order: Table 1 (no authors' source)",
  "sigma_small": "sigma-GPT Small, random orders: Tables 1 and 5 (no authors' config)",
  "sigma_medium": "sigma-GPT Medium, random orders: Table 5 (no authors' config)",
  "order_small_order1": "order study, the authors' fixed permutation order1: Fig. 2a",
  "order_small_order2": "order study, the authors' fixed permutation order2: Fig. 2a",
  "order_small_order3": "order study, the authors' fixed permutation order3: Fig. 2a",
  "order_small_l2r": "order study, left to right: Fig. 2a",
  "order_small_blockwise": "order study, blockwise b=4 pattern (0, 2, 3, 1): Fig. 2a "
  "(no authors' source)",
}


def paper_config(name: str = "ao_small") -> ml_collections.ConfigDict:
  """The config of one paper run (see NAMES), on OpenWebText with GPT-2 BPE."""
  if name not in NAMES:
    raise ValueError(f"unknown paper config {name!r}; accepted: {', '.join(NAMES)}")
  kind, size, *rest = name.split("_")
  s = SIZES[size]
  c = base_config()
  c.model.update(
    variant="sigma" if kind == "sigma" else "ao",
    vocab_size=50304,
    block_size=1024,
    n_layer=s["n_layer"],
    n_embd=s["n_embd"],
    n_head=s["n_head"],
    dtype="bfloat16",
  )  # train_AOGPT_CL.py: dtype bfloat16 autocast, fp32 params
  c.data.update(dataset="openwebtext", tokenizer="gpt2")
  c.train.update(RECIPE, learning_rate=s["learning_rate"], microbatches=s["microbatches"])
  # train_AOGPT_CL.py: random_ratio = 0.9 (a random order for 90% of the rows, L2R for the rest).
  c.order.update(kind="mixed", random_ratio=0.9)
  if kind == "ar":
    c.order.kind = "l2r"
  elif kind == "sigma":  # model_sigmaGPT.py: forward accepts mode 'AR' or 'Random' only (no
    c.order.kind = "random"  # 'Random_CL', no random_ratio), so their baseline saw random orders
  elif rest == ["random"]:  # config ..._NoCL.py: random_ratio = 1.0, weight_decay = 3e-2
    c.order.random_ratio = 1.0
    c.train.weight_decay = 0.03
  elif kind == "order":
    c.train.update(ORDER_STUDY, microbatches=s["microbatches"] // 2)
    variant = rest[0]
    if variant == "l2r":
      c.order.kind = "l2r"
    elif variant == "blockwise":
      c.order.update(kind="blockwise", block=4, pattern=(0, 2, 3, 1))
    else:  # the literal permutations of config_order/train_AOGPT_orderN.py
      c.order.update(kind="fixed", fixed=variant)
  c.mesh.ici = (1, -1, 1)  # FSDP over the slice; DCN data parallelism across slices
  return c


# The authors' evaluation protocol (data.py get_valid_dataloaders, eval_ppl_AOGPT*.py): wikitext2
# is scored on its train split, every other dataset on test (LAMBADA: OpenAI's whole jsonl); the
# any-order perplexity stops at 16 batches of 8 = 128 shuffled blocks, except PTB (all of it);
# L2R and ensemble perplexities cover the whole split.
EVAL_SPLITS = {
  "wikitext2": "train",
  "wikitext103": "test",
  "ptb": "test",
  "lambada": "test",
  "lm1b": "test",
}
EVAL_ANY_ORDER_BLOCKS = 128
EVAL_ALL_BLOCKS = ("ptb",)


def eval_split(dataset: str) -> str:
  """The split the authors evaluate `dataset` on; datasets they do not use: validation."""
  return EVAL_SPLITS.get(dataset, "validation")


def eval_any_order_blocks(dataset: str) -> int | None:
  """Blocks of the any-order estimate (None: all of them)."""
  return None if dataset in EVAL_ALL_BLOCKS else EVAL_ANY_ORDER_BLOCKS
