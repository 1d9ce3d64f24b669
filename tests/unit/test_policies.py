"""The decoding policies' registry (decode/policies.py): the docs' one-file rule runs as written
and decodes as the built-in margin policy; a policy's options and until-EOS orders are checked
by name."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from ao_mdm.decode import generate, policies

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "sampling.md"


def docs_policy() -> str:
  """The python block of docs/sampling.md's "Policies" section."""
  section = DOCS.read_text().split("### Policies", 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_docs_new_rule_is_one_short_file_and_decodes_as_the_built_in_margin(
  eos_export, monkeypatch
):
  monkeypatch.setattr(policies, "POLICIES", dict(policies.POLICIES))
  code = docs_policy()
  rule = code[code.index("class Margin") : code.index("if __name__")]
  assert len([line for line in rule.splitlines() if line.strip()]) <= 8, rule
  exec(compile(code, str(DOCS), "exec"), {"__name__": "docs"})
  _, config, params, tokenizer = eos_export
  kw = dict(num_samples=3, batch_size=3, prompt="We the people", steps=8, seed=5, temperature=0.7)
  mine = list(generate.sample_texts(params, config.model, tokenizer, mode="my_margin", **kw))
  built_in = list(generate.sample_texts(params, config.model, tokenizer, mode="margin", **kw))
  for name in ("tokens", "logprobs", "raw_logprobs"):  # the records carry the draws' log-probs
    np.testing.assert_array_equal([r[name] for r in mine], [r[name] for r in built_in])
  ids = tokenizer.encode("We the people")
  assert all(r["tokens"][: len(ids)] == ids for r in mine)
  with pytest.raises(ValueError, match="--score applies to --mode=confidence, not --mode=my_marg"):
    policies.check_options("my_margin", {"score"})
  with pytest.raises(ValueError, match="--until_eos applies to --mode=parallel or --mode=spec"):
    policies.check_until_eos("my_margin", None)
  with pytest.raises(ValueError, match="'my_margin' exists already"):
    exec(compile(code, str(DOCS), "exec"), {"__name__": "docs"})
  with pytest.raises(TypeError, match=r"unknown options \['kk'\]"):
    generate.sample_texts(params, config.model, tokenizer, num_samples=1, batch_size=1, kk=2)


@pytest.mark.slow  # a process that loads JAX and an export (about 15 s here)
def test_the_docs_policy_script_runs_as_written_and_quietly(eos_export, tmp_path):
  """The block saved as a file and run on an export: two samples of the prompt on stdout,
  nothing of the libraries (TPU start-up, Orbax's notes) on stderr."""
  script = tmp_path / "my_margin.py"
  script.write_text(docs_policy())
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = subprocess.run(
    [sys.executable, str(script), eos_export[0], "We the people"], capture_output=True,
    text=True, timeout=300, env=env,
  )  # fmt: skip
  assert out.returncode == 0 and out.stderr == "", out.stderr
  assert out.stdout.startswith("We the people") and out.stdout.count("We the people") >= 2


def test_an_unknown_policy_names_the_known_ones():
  accepted = "parallel, speculative, confidence, margin"
  with pytest.raises(ValueError, match=f"mode='beam'; accepted: {accepted}"):
    policies.get("beam")
  assert policies.get("speculative").order(None, 0) == "l2r"
  assert policies.get("confidence").order("l2r", 3) is None  # it takes no order
