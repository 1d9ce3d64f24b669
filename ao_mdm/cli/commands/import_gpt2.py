"""`ao-mdm import-gpt2`: a local Hugging Face GPT-2 as the scorer of `eval --generated`."""

from absl import flags

from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.storage import paths

SUMMARY = (
  "convert a local Hugging Face GPT-2 (e.g. gpt2-large) into a scorer for eval "
  "--generated: --hf_dir=DIR --out=DIR"
)


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string(
    "hf_dir",
    None,
    "A local Hugging Face GPT-2 directory (config.json and "
    "model.safetensors or pytorch_model.bin).",
    flag_values=fv,
  )
  flags_lib.out(fv, "Directory of the scorer (new or empty).")
  flags_lib.storage_timeout(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "hf_dir", "out")
  paths.new_output_dir(v["out"])


def run(v: dict, given: set) -> None:
  del given
  from ao_mdm.interop import hf_gpt2

  print(f"wrote {hf_gpt2.import_hf_gpt2(v['hf_dir'], v['out'])}")
