"""One process of tests/test_multiprocess.py: 3 train steps of a tiny config on a global batch,
or with --grpo 3 GRPO steps per rollout policy on fixed prompts (answers drawn by each process).

Each process feeds only its rows of the same fixed global batches; process 0 writes the final
params (gathered from all processes) and the losses to --out as an .npz.
"""

import argparse

import numpy as np

STEPS = 3


def tiny_config():
  from ao_mdm.config import base_config

  c = base_config()
  c.model.update(vocab_size=256, block_size=32, n_layer=2, n_embd=32, n_head=2, cond_dim=32)
  c.train.update(batch_size=8, warmup_steps=1, learning_rate=1e-2)
  c.mesh.ici = (2, 2, 2)
  return c


def global_batches(config) -> list:
  rng = np.random.default_rng(0)
  shape = (config.train.batch_size, config.model.block_size)
  return [rng.integers(0, config.model.vocab_size, shape, dtype=np.int32) for _ in range(STEPS)]


class Bytes:
  """A byte tokenizer (EOS 0) for the GRPO rollouts' rewards."""

  eos_id, vocab_size = 0, 256

  def encode_batch(self, texts):
    return [list(t.encode()) for t in texts]

  def decode(self, ids):
    return bytes(ids).decode(errors="replace")


def answer_length(prompt: str, answer: str, reference: str) -> float:
  """A reward that a random model's answers differ in (grpo.reward names it)."""
  del prompt, reference
  return float(len(answer))


def grpo_run(policy: str, out: dict) -> None:
  """STEPS GRPO steps from random params on fixed prompts, each process its rows of them."""
  import jax
  from jax.experimental import multihost_utils
  import jax.numpy as jnp

  from ao_mdm import specs
  from ao_mdm.data import pairs
  from ao_mdm.train import grpo
  from ao_mdm.train import step as train_step

  config = tiny_config()
  config.data.pairs = "arithmetic:16"
  config.train.learning_rate = 1e-3  # at 1e-2 Adam turns float noise in tiny gradients into 1e-4
  config.grpo.update(
    reward="multiprocess_worker:answer_length",
    group=2,
    updates=2,
    kl=0.1,
    policy=policy,
    order="random" if policy == "parallel" else "l2r",
    tokens_per_step=2,
  )
  spec = specs.parse(config)
  program = train_step.make_program(spec)
  state = program.init_state()
  reference = jax.tree.map(jnp.copy, state.params)
  rollouts = grpo.Rollouts(spec, Bytes(), reference, program.batch_sharding)
  rows_NX = pairs.encode(pairs.arithmetic(16, 0), Bytes(), config.model.block_size)[0]
  n = config.train.batch_size // 2 // jax.process_count()  # prompts per process and step
  for step in range(STEPS):
    first = step * n * jax.process_count() + jax.process_index() * n
    batch, drawn = rollouts(state.params, rows_NX[first : first + n], step)
    out[f"{policy}/answers{step}"] = multihost_utils.process_allgather(batch["tokens"], tiled=True)
    state, metrics = program.step(state, batch)
    out.setdefault(f"{policy}/loss", []).append(float(metrics["loss"]))
    out.setdefault(f"{policy}/reward", []).append(drawn["reward"])
  params = multihost_utils.process_allgather(state.params, tiled=True)
  out.update({f"{policy}/{k}": v for k, v in flat_arrays(params).items()})


def flat_arrays(tree) -> dict:
  import jax

  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--process_id", type=int, default=0)
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--port", type=int, default=0)
  p.add_argument("--devices", type=int, required=True, help="CPU devices in this process")
  p.add_argument("--out", required=True)
  p.add_argument("--grpo", action="store_true")
  args = p.parse_args()

  import jax

  jax.config.update("jax_num_cpu_devices", args.devices)
  if args.num_processes > 1:
    jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{args.port}",
      num_processes=args.num_processes,
      process_id=args.process_id,
    )
  from jax.experimental import multihost_utils

  if args.grpo:
    out: dict = {}
    for policy in ("parallel", "speculative"):
      grpo_run(policy, out)
    if jax.process_index() == 0:
      np.savez(args.out, **out)
    print(f"process {jax.process_index()}/{jax.process_count()}: grpo {out['parallel/loss']}")
    return

  from ao_mdm import specs
  from ao_mdm.train import step as train_step

  config = tiny_config()
  program = train_step.make_program(specs.parse(config))
  state = program.init_state()
  rows = config.train.batch_size // jax.process_count()
  first = jax.process_index() * rows
  losses = []
  for tokens in global_batches(config):
    local = tokens[first : first + rows]  # what this process's data loader would produce
    tokens_BT = program.global_batch(local)
    for shard in tokens_BT.addressable_shards:  # each device holds its part of the global batch
      np.testing.assert_array_equal(np.asarray(shard.data), tokens[shard.index])
    state, metrics = program.step(state, tokens_BT)
    losses.append(float(metrics["loss"]))
  params = multihost_utils.process_allgather(state.params, tiled=True)
  if jax.process_index() == 0:
    np.savez(args.out, loss=np.asarray(losses), **flat_arrays(params))
  print(f"process {jax.process_index()}/{jax.process_count()}: losses {losses}", flush=True)


if __name__ == "__main__":
  main()
