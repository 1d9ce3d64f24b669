"""Worker for tests/test_sharding.py, run with 8 CPU devices: train steps on several meshes.

Writes OUT_DIR/NAME.npz (losses and final params) per case and OUT_DIR/specs.json (the
sharding of a few params and the shape of their first shard, per mesh).
"""

import json
import sys

import numpy as np

STEPS = 2
MESHES = {"mesh_8_1_1": (8, 1, 1), "mesh_2_2_2": (2, 2, 2), "mesh_1_4_2": (1, 4, 2)}
SPEC_PARAMS = {
  "mlp_in": ("blocks", "mlp_in", "kernel"),
  "token_embed": ("token_embed",),
  "qkv": ("blocks", "qkv", "kernel"),
}


def tiny_config(ici=(1, 1, 1), microbatches=1, order="mixed", attention="xla", block_size=32):
  from ao_mdm.config import base_config

  c = base_config()
  c.model.update(
    vocab_size=256,
    block_size=block_size,
    n_layer=2,
    n_embd=32,
    n_head=2,
    cond_dim=32,
    attention=attention,
  )
  c.train.update(batch_size=8, warmup_steps=1, learning_rate=1e-2, microbatches=microbatches)
  c.order.kind = order
  c.mesh.ici = ici
  return c


def run(config, devices, out_path):
  """STEPS train steps on a mesh over `devices`; save losses and params; return the state."""
  import time

  import jax

  from ao_mdm import specs
  from ao_mdm.train import step as train_step

  program = train_step.make_program(specs.parse(config), devices)
  state = program.init_state()
  start = time.perf_counter()
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(STEPS):
    tokens = rng.integers(0, config.model.vocab_size, (8, config.model.block_size), np.int32)
    state, metrics = program.step(state, program.global_batch(tokens))
    losses.append(float(metrics["loss"]))
  print(f"{out_path}: {time.perf_counter() - start:.1f} s", flush=True)
  leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
  np.savez(
    out_path, loss=np.asarray(losses), **{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}
  )
  return state


def main(out_dir: str) -> None:
  import jax

  devices = jax.devices()
  assert len(devices) == 8, devices
  run(tiny_config(), devices[:1], f"{out_dir}/reference.npz")
  specs = {}
  for name, ici in MESHES.items():
    state = run(tiny_config(ici), devices, f"{out_dir}/{name}.npz")
    for key, path in SPEC_PARAMS.items():
      leaf = state.params
      for part in path:
        leaf = leaf[part]
      specs[f"{name}/{key}"] = {
        "spec": list(leaf.sharding.spec),
        "shard_shape": list(leaf.addressable_shards[0].data.shape),
      }
  # Gradient accumulation: fixed orders, so every micro-batch sees the same permutation.
  run(tiny_config(order="fixed"), devices[:1], f"{out_dir}/accum_m1.npz")
  run(tiny_config(order="fixed", microbatches=4), devices[:1], f"{out_dir}/accum_m4.npz")
  run(tiny_config((2, 1, 2), 4, "fixed"), devices[:4], f"{out_dir}/accum_m4_mesh_2_1_2.npz")
  # Splash attention (interpreted) on a mesh: each device runs it on its rows and heads.
  run(tiny_config(block_size=128), devices[:1], f"{out_dir}/attention_xla.npz")
  run(
    tiny_config((2, 2, 2), attention="splash", block_size=128),
    devices,
    f"{out_dir}/attention_splash_mesh_2_2_2.npz",
  )
  with open(f"{out_dir}/specs.json", "w") as f:
    json.dump(specs, f)


if __name__ == "__main__":
  main(sys.argv[1])
