"""The train state: its construction (sharded or abstract), the optimizer and the lr schedule.

Shared by training, checkpoint restore, the benchmark and the ahead-of-time compile.
"""

import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ao_mdm import model as model_lib
from ao_mdm import sharding, specs

EMBEDDINGS = ("token_embed", "pos_embed", "none_embed", "target_embed")


def weight_decay_mask(params: Any) -> Any:
  """True for the leaves the authors decay (their >= 2-D tensors): dense kernels and embeddings.

  Decided by name, not rank: nn.scan stacks every block's biases and norm scales along a layer
  axis, and `none_embed` ([D] here, [1, D] in the reference) is decayed.
  """

  def decays(path, _):
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    return name == "kernel" or name in EMBEDDINGS

  return jax.tree_util.tree_map_with_path(decays, params)


class TrainState(flax.struct.PyTreeNode):  # a flax.struct.dataclass whose `replace` is typed
  step: jax.Array
  rng: jax.Array  # raw uint32 key data; orders for step n come from fold_in(rng, n)
  params: Any
  opt_state: Any
  ema_params: Any


def learning_rate_schedule(train: specs.TrainSpec) -> optax.Schedule:
  """Linear warmup to learning_rate, then cosine to min_lr at lr_decay_steps (0: num_steps).

  The horizon may lie past num_steps (the paper's order study stops at 20k of a 500k cosine).
  """
  horizon = train.lr_decay_steps or train.num_steps
  return optax.warmup_cosine_decay_schedule(
    0.0, train.learning_rate, train.warmup_steps, max(horizon, train.warmup_steps + 1), train.min_lr
  )


def make_optimizer(train: specs.TrainSpec, updates: int = 1) -> optax.GradientTransformation:
  """Global-norm clip, then AdamW; weight decay on dense kernels and embeddings only. With
  `updates` per train step (GRPO), the schedule still advances once per step."""
  schedule = learning_rate_schedule(train)
  return optax.chain(
    optax.clip_by_global_norm(train.grad_clip),
    optax.adamw(
      schedule if updates == 1 else lambda count: schedule(count // updates),
      b1=train.b1,
      b2=train.b2,
      eps=1e-8,
      weight_decay=train.weight_decay,
      mask=weight_decay_mask,
    ),
  )


def init_state(config: specs.Spec, key: jax.Array) -> TrainState:
  """Boxed initial state: parameters keep their logical axis names for sharding."""
  k_params, k_rng = jax.random.split(key)
  params = model_lib.init_params(config.model, k_params)
  opt_state = make_optimizer(config.train).init(params)
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    rng=jax.random.key_data(k_rng),
    params=params,
    opt_state=opt_state,
    ema_params=params,
  )


def sharded_shapes(config: specs.Spec, mesh, axis_rules) -> tuple[Any, TrainState]:
  """(NamedSharding per leaf, the unboxed ShapeDtypeStructs carrying them), from one trace of
  the initialiser."""
  boxed = jax.eval_shape(functools.partial(init_state, config), jax.random.key(0))
  shardings = sharding.logical_shardings(boxed, mesh, axis_rules)
  abstract = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings
  )
  return shardings, abstract


def create_state(config: specs.Spec, mesh, axis_rules, shardings: Any) -> TrainState:
  """Initialise the train state directly sharded over the mesh (`shardings`: sharded_shapes')."""
  init = jax.jit(lambda key: nn.unbox(init_state(config, key)), out_shardings=shardings)
  with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules):
    return init(jax.random.key(config.seed))


def abstract_state(config: specs.Spec) -> TrainState:
  """Unboxed ShapeDtypeStructs of the train state on one device, for restoring."""
  boxed = jax.eval_shape(functools.partial(init_state, config), jax.random.key(0))
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), nn.unbox(boxed)
  )
