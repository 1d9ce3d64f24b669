"""`ao-mdm import-torch`: a checkpoint of the authors' PyTorch code, or a file of `ao-mdm
export-torch` (torch or safetensors), as an ao_mdm export."""

from absl import flags

from ao_mdm.cli import checks
from ao_mdm.cli import flags as flags_lib
from ao_mdm.storage import fs, paths

SUMMARY = (
  "convert a reference PyTorch checkpoint or an export-torch file: "
  "--checkpoint=ckpt.pt|FILE.safetensors --out=DIR [--weights=ema|model] "
  "[--variant=ao|sigma] [--tokenizer=gpt2|FILE]"
)


def define(fv: flags.FlagValues) -> None:
  flags_lib.checkpoint(
    fv, "The authors' PyTorch ckpt.pt file, or a file of `ao-mdm export-torch` (either format)."
  )
  flags_lib.out(fv, "Directory of the export (new or empty).")
  flags_lib.weights(
    fv,
    ("ema", "model"),
    "Which of the PyTorch checkpoint's params to import: "
    "ema | model (a safetensors file holds one set).",
  )
  flags.DEFINE_enum(
    "variant",
    None,
    ["ao", "sigma"],
    "Model variant (default: detected from the keys).",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "tokenizer",
    None,
    "The model's tokenizer: gpt2, or a SentencePiece "
    ".model file (default: the one an export-torch file carries, else gpt2, "
    "the authors').",
    flag_values=fv,
  )
  flags_lib.storage_timeout(fv)


def check(v: dict, given: set) -> None:
  del given
  checks.require(v, "checkpoint", "out")
  if fs.isdir(v["checkpoint"]):
    raise ValueError(
      f"--checkpoint {v['checkpoint']!r} is a directory; give the PyTorch "
      "ckpt.pt file of the authors' code"
    )
  if not fs.isfile(v["checkpoint"]):
    raise FileNotFoundError(
      f"--checkpoint {v['checkpoint']!r}: no such file (a PyTorch ckpt.pt of the authors' code)"
    )
  if v["tokenizer"] not in (None, "gpt2"):
    v["tokenizer"] = paths.check(v["tokenizer"], "--tokenizer")
    if not fs.isfile(v["tokenizer"]):
      raise FileNotFoundError(
        f"--tokenizer {v['tokenizer']!r}: no such file (a SentencePiece .model, or gpt2)"
      )
  paths.new_output_dir(v["out"])


def run(v: dict, given: set) -> None:
  from ao_mdm.interop import torch_import

  if "weights" in given and torch_import.is_safetensors(v["checkpoint"]):
    raise ValueError(
      f"--weights does not apply to {v['checkpoint']!r}: a safetensors file holds "
      "one set of weights (those `export-torch --weights` chose)"
    )
  torch_import.import_torch(
    v["checkpoint"], v["out"], v["weights"], v["variant"], tokenizer=v["tokenizer"]
  )
  print(f"wrote {v['out']}")
