"""Every config key with its default: the tiny AO-GPT of the CPU demo (configs/tiny.py).

Shipped configs start from `base_config()` and override fields; they add no keys.
"""

import ml_collections

DTYPES = ("float32", "bfloat16")  # model.dtype (compute) and the decoding dtypes


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.variant = "ao"  # "ao" (AO-GPT, AdaLN target conditioning) | "sigma" (sigma-GPT baseline)
  c.model.vocab_size = (
    2048  # a multiple of 128; the SentencePiece tokenizer is trained to this size
  )
  c.model.block_size = 128  # T
  c.model.n_layer = 4
  c.model.n_head = 4
  c.model.n_embd = 128
  c.model.cond_dim = 128  # C, width of the target-position conditioning (AO-GPT only)
  c.model.dtype = "float32"  # compute dtype; params are always float32
  c.model.unroll_layers = False  # training/scoring: True unrolls the layer scan, ~15% faster
  # steps on CPU (no stacked residuals) but longer compiles; the
  # cached decoders always loop (faster there)
  c.model.remat = "none"  # none | full | dots: rematerialise each block in the backward pass
  # Attention of training and scoring (the cached decoders keep their own): auto = splash on TPU
  # (T a multiple of 128), cudnn on GPU (bfloat16), else xla; xla | cudnn | splash (the Pallas
  # TPU kernel; interpreted, slowly, elsewhere) to choose.
  c.model.attention = "auto"

  c.order = ml_collections.ConfigDict()
  c.order.kind = "mixed"  # random | l2r | mixed | fixed | blockwise
  c.order.random_ratio = 0.9  # mixed: probability of a random order per sequence
  c.order.ramp_steps = 0  # mixed: the probability grows linearly from 0 over these steps
  # fixed: "seed:N" draws the permutation from seed N; "order1".."order3" are the authors'
  # literal permutations of the order study (ao_mdm/data/paper_orders.json, T=1024)
  c.order.fixed = "seed:0"
  c.order.block = 4  # blockwise: block length b
  c.order.pattern = (0, 2, 3, 1)  # blockwise: order within each block

  c.data = ml_collections.ConfigDict()
  c.data.dataset = "sotu"  # a registry name (ao_mdm.data.datasets) or "text_file"
  c.data.text_file = ""  # with dataset="text_file": a local UTF-8 file, one document per line
  c.data.tokenizer = "sentencepiece"
  c.data.tfds_dir = ""  # "" -> $TFDS_DATA_DIR or ~/tensorflow_datasets
  # Where `ao-mdm prepare` (or train/eval, when missing) writes token shards;
  # "" -> <tfds_dir>/ao_mdm_prepared
  c.data.prepared_dir = ""

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 16  # global batch, sequences per step
  c.train.num_steps = 400
  c.train.learning_rate = 3e-3
  c.train.min_lr = 3e-4
  c.train.warmup_steps = 40
  c.train.lr_decay_steps = 0  # end of the cosine (reaches min_lr); 0: num_steps
  c.train.weight_decay = 0.05
  c.train.b1 = 0.9
  c.train.b2 = 0.95
  c.train.grad_clip = 1.0
  c.train.ema_decay = 0.999
  c.train.microbatches = 1  # gradient accumulation: micro-batches per step
  c.train.log_every = 50
  c.train.checkpoint_every = 200
  c.train.keep_checkpoints = 3
  c.train.eval_every = 200  # validation loss with the EMA params every N steps (0: at the end only)
  c.train.eval_batches = 8  # validation batches for the L2R / random-order loss
  c.train.peak_flops_per_device = 0.0  # FLOP/s of one device, for MFU (0: measured on CPU,
  # hardware.PEAK_FLOPS on TPUs and GPUs)
  # A jax.profiler trace of steps profile_start_step .. + profile_steps - 1 into WORKDIR/profile
  c.train.profile_start_step = 10  # after the first steps' compiles
  c.train.profile_steps = 0  # 0: no trace
  # Weights & Biases: the logged metrics also go to this project (the [wandb] extra; WANDB_MODE
  # and the other WANDB_* variables as wandb reads them); "": not at all
  c.train.wandb_project = ""

  # Mesh ('data', 'fsdp', 'tensor'): ICI sizes within a slice/host group, DCN sizes across them.
  # -1 fills the remaining devices. Rules map logical axis names to mesh axes.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.ici = (-1, 1, 1)
  c.mesh.dcn = (1, 1, 1)
  c.mesh.rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("cond", None),
    ("layers", None),
  )
  return c
