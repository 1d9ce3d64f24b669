"""`ao-mdm export-torch`: a run's or an export's params as a checkpoint of the authors' PyTorch
code (their state-dict names and model_args), or a safetensors file of the same names."""

from absl import flags

from ao_mdm.checkpoint import layout
from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.storage import paths

SUMMARY = (
  "write the params in the authors' PyTorch layout: --checkpoint=DIR --out=FILE "
  "[--weights=ema|params --format=torch|safetensors]"
)
FORMATS = ("torch", "safetensors")  # interop/torch_export.py's


def define(fv: flags.FlagValues) -> None:
  flags_lib.checkpoint(fv)
  flags_lib.out(
    fv, "The file to write (a new path): ckpt.pt for the authors' code, or a .safetensors file."
  )
  flags_lib.weights(
    fv,
    help_text="Which params of a training work dir: ema | params (an export holds one set: ema).",
  )
  flags.DEFINE_enum(
    "format",
    "torch",
    list(FORMATS),
    "torch = a torch.save dict as the "
    "authors' trainer writes (model, ema_model, model_args); safetensors = the "
    "state dict alone, model_args in its metadata.",
    flag_values=fv,
  )
  flags_lib.storage_timeout(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "checkpoint", "out")
  layout.check_checkpoint(v["checkpoint"])
  paths.new_output_file(v["out"])


def run(v: dict, given: set) -> None:
  del given
  from ao_mdm.interop import torch_export

  print(f"wrote {torch_export.export_torch(v['checkpoint'], v['out'], v['weights'], v['format'])}")
