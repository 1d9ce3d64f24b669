"""`ao-mdm import-torch` refuses, in one line, what a file cannot honour."""

import pytest

from helpers import ao_mdm

pytest.importorskip("torch")


def test_safetensors_import_refuses_weights_given_on_the_command_line(tmp_path, sp_export):
  """A safetensors file holds one set of weights: --weights would be ignored, so it is refused
  (one line, exit 2, nothing written)."""
  from ao_mdm.interop import torch_export

  path = torch_export.export_torch(sp_export, str(tmp_path / "m.safetensors"), fmt="safetensors")
  out = ao_mdm(
    "import-torch", f"--checkpoint={path}", f"--out={tmp_path / 'back'}", "--weights=model"
  )
  assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
  assert out.stderr.startswith("error: --weights does not apply to")
  assert not (tmp_path / "back").exists()
