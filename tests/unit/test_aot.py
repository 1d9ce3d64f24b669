"""Ahead-of-time compile of the train step for TPU topologies on this CPU host (needs libtpu)."""

import importlib.util

import pytest

from ao_mdm import specs
from ao_mdm.config import base_config
from ao_mdm.paper import paper_config
from ao_mdm.perf import aot, hlo

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None, reason="libtpu not installed: pip install -e '.[tpu]'"
)


def tiny_config():
  c = base_config()
  c.model.update(vocab_size=256, block_size=32, n_layer=2, n_embd=32, n_head=2)
  c.train.batch_size = 8
  return c


def test_tiny_compiles_for_v5e_2x2(capsys):
  r = aot.compile_for_topology(specs.parse(tiny_config()), "v5e:2x2")
  assert (r["num_devices"], r["device_kind"], r["hbm_gib"]) == (4, "TPU v5 lite", 16.0)
  for key in ("arguments", "outputs", "generated_code", "total"):
    assert r[key] > 0, key
  assert r["temps"] >= 0  # the unrolled step of a model this small may need none
  assert r["total"] < r["hbm_gib"] and r["compile_seconds"] > 0
  out = capsys.readouterr().out
  assert "per-device memory (GiB)" in out and "roofline projection" in out
  p = r["projection"]
  # Data parallel over 4 chips: the gradients (f32, all parameters) are all-reduced each step.
  n_params = 2 * 256 * 32 + 2 * 12 * 32 * 32  # lower bound: embeddings/head + block kernels
  assert p["collective_bytes_per_device"] >= 4 * n_params
  assert 0.5 < p["xla_over_model_flops"] < 3 and 0 < p["mfu_upper_bound"] <= 1
  assert p["step_s_lower_bound"] >= p["model_flops_per_device"] / 197e12


def test_hlo_traffic_counts_loop_iterations():
  text = """HloModule m
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar = f32[256,4]{1,0} all-reduce(f32[256,4]{1,0} %x), replica_groups={}, to_apply=%add
  %ag-start = (bf16[8], bf16[32]) all-gather-start(bf16[8] %y), dimensions={0}
}
%cond (p: (s32[], f32[4])) -> pred[] {
  %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}
ENTRY %main (a: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]) while((s32[], f32[4]) %t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %rs = f32[16]{0} reduce-scatter(f32[64]{0} %z), dimensions={0}
  %ag-done = bf16[32] all-gather-done((bf16[8], bf16[32]) %ag-start)
}
"""  # noqa: E501  (HLO text as XLA prints it)
  per_iteration = 256 * 4 * 4 + (8 + 32) * 2
  traffic = hlo.hlo_traffic(text)
  assert traffic["collective"] == 12 * per_iteration + 16 * 4
  # HBM: each instruction's result and operands; the compare in the loop condition is not a
  # body instruction, the -done of an async collective adds nothing.
  assert traffic["hbm"] == 12 * (2 * 256 * 4 * 4 + (8 + 32) * 2 + 8 * 2) + (16 + 64) * 4
  # The TPU compiler leaves out known_trip_count: the bound comes from the condition `i < 5`.
  tpu = text.replace(', backend_config={"known_trip_count":{"n":"12"}}', "").replace(
    "  %lt = pred[]", "  %c = s32[]{:T(128)} constant(5)\n  %lt = pred[]"
  )
  assert hlo.hlo_traffic(tpu)["collective"] == 5 * per_iteration + 16 * 4


def test_unknown_topology():
  with pytest.raises(ValueError, match="invalid TPU topology 'v9z:2x2'"):
    aot.compile_for_topology(specs.parse(tiny_config()), "v9z:2x2")
  with pytest.raises(ValueError, match="invalid TPU topology 'v5e-16'"):
    aot.compile_for_topology(specs.parse(tiny_config()), "v5e-16")


def test_too_big_for_hbm():
  c = paper_config("ao_small")
  c.train.batch_size = 64  # compiles in seconds: XLA rejects the temporaries before codegen
  c.train.microbatches = 1
  with pytest.raises(ValueError, match="does not fit on v5e:2x2.*raise train.microbatches"):
    aot.compile_for_topology(specs.parse(c), "v5e:2x2")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ao_small", "ao_medium"])
def test_paper_configs_fit_v5e_4x4(name):
  """The authors' 1024 x 1024 tokens a step fit 16 GiB v5e chips with the configs' microbatches."""
  c = paper_config(name)
  r = aot.compile_for_topology(specs.parse(c), "v5e:4x4")
  assert c.train.batch_size * c.model.block_size == 1_048_576 and r["total"] < r["hbm_gib"]


@pytest.mark.slow
def test_sampler_compiles_for_one_v5e_chip_in_both_dtypes(capsys):
  c = tiny_config()
  r32 = aot.compile_sampler(specs.parse(c), "v5e:1", batch_size=2, steps=8, dtype="float32")
  r16 = aot.compile_sampler(specs.parse(c), "v5e:1", batch_size=2, steps=8, dtype="bfloat16")
  out = capsys.readouterr().out
  assert "the cached sampler" in out and "generation / forward" in out
  import flax.linen as nn
  import jax

  from ao_mdm import model as model_lib

  n = model_lib.count_params(
    nn.unbox(jax.eval_shape(lambda: model_lib.init_params(specs.parse(c).model, jax.random.key(0))))
  )
  gib = 1024**3
  # The arguments are the params (4 or 2 bytes each, small arrays padded to TPU tiles) and the
  # small token inputs.
  assert 4 * n <= r32["arguments"] * gib < 1.5 * 4 * n
  assert 2 * n <= r16["arguments"] * gib < 0.75 * r32["arguments"] * gib
  for r, itemsize in ((r32, 4), (r16, 2)):
    assert r["device_kind"] == "TPU v5 lite" and r["total"] < r["hbm_gib"]
    assert sum(b["steps"] for b in r["buckets_detail"]) == 8
    # The K/V cache prefix each bucket reads: 2 (K, V) x L x B x length x D.
    for b in r["buckets_detail"]:
      assert b["cache_bytes"] == 2 * 2 * 2 * b["cache_len"] * 32 * itemsize
    assert r["generation_s"] == pytest.approx(
      sum(b["steps"] * b["step_s"] for b in r["buckets_detail"])
    )
  assert r16["generation_bytes"] == pytest.approx(r32["generation_bytes"] / 2)
  assert r16["generation_flops"] == r32["generation_flops"]


def test_single_chip_topologies():
  assert len(aot.tpu_devices("v5e:1")) == 1
  assert aot.tpu_devices("v6e:1x1")[0].device_kind == "TPU v6 lite"


def test_peak_flops_per_device_for_mfu():
  from ao_mdm import hardware

  assert hardware.peak_flops(aot.tpu_devices("v5e:2x2")) == 197e12
  assert hardware.peak_flops(aot.tpu_devices("v6e:2x2")) == 918e12

  class Gpu:  # the fields JAX's GPU devices have that this reads
    def __init__(self, kind):
      self.device_kind, self.id = kind, 0

  assert hardware.peak_flops([Gpu("NVIDIA H100 80GB HBM3")]) == 989e12
  assert hardware.peak_flops([Gpu("NVIDIA H200")]) == 989e12
  assert hardware.peak_flops([Gpu("Some Future GPU")]) == 0.0  # no MFU rather than a wrong one


@pytest.mark.slow  # two compiles at T=1024, about 160 s here
def test_splash_attention_compiles_for_a_v5e_chip_with_less_memory(capsys):
  """The Pallas kernel (Mosaic) compiles on this CPU host for a TPU and needs fewer temporaries
  than XLA's attention, which materialises [B, H, T, T] scores (measured: 1.06 against 1.41
  GiB; the rest is the other activations)."""
  c = tiny_config()
  c.model.update(block_size=1024, n_embd=256, n_head=4)
  got = {
    a: aot.compile_for_topology(specs.parse(c), "v5e:1")
    for a in ("xla", "splash")
    if not c.model.update(attention=a)
  }
  assert got["splash"]["attention"] == "splash" and got["xla"]["attention"] == "xla"
  assert got["splash"]["temps"] < 0.8 * got["xla"]["temps"], {a: r["temps"] for a, r in got.items()}
  assert "splash attention" in capsys.readouterr().out
  # That "auto" means splash on a TPU target: test_model's attention_kind test.
