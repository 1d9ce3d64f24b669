"""`ao-mdm import-torch`: a checkpoint of the authors' PyTorch code as an ao_mdm export."""
from absl import flags

from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.storage import fs
from ao_mdm.storage import paths

SUMMARY = ("convert a reference PyTorch checkpoint: --checkpoint=ckpt.pt --out=DIR "
           "[--weights=ema|model] [--variant=ao|sigma]")


def define(fv: flags.FlagValues) -> None:
  flags_lib.checkpoint(fv, "The authors' PyTorch ckpt.pt file.")
  flags_lib.out(fv, "Directory of the export (new or empty).")
  flags_lib.weights(fv, ("ema", "model"), "Which of the PyTorch checkpoint's params to import: "
                    "ema | model.")
  flags.DEFINE_enum("variant", None, ["ao", "sigma"], "Model variant (default: detected from "
                    "the keys).", flag_values=fv)
  flags_lib.storage_timeout(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "checkpoint", "out")
  if fs.isdir(v["checkpoint"]):
    raise ValueError(f"--checkpoint {v['checkpoint']!r} is a directory; give the PyTorch "
                     "ckpt.pt file of the authors' code")
  if not fs.isfile(v["checkpoint"]):
    raise FileNotFoundError(f"--checkpoint {v['checkpoint']!r}: no such file (a PyTorch "
                            "ckpt.pt of the authors' code)")
  paths.new_output_dir(v["out"])


def run(v: dict, given: set) -> None:
  del given
  from ao_mdm.interop import torch_import  # pylint: disable=g-import-not-at-top
  torch_import.import_torch(v["checkpoint"], v["out"], v["weights"], v["variant"])
  print(f"wrote {v['out']}")
