"""The config defined once (ao_mdm/specs.py): base_config() comes from the specs' fields, each
field has a help line, every declared choice and bound is checked with an error naming the field
and what it accepts, a misspelt key gets the closest one, shipped configs parse."""

import dataclasses
import importlib.util
import json

import pytest

from ao_mdm import specs
from ao_mdm.cli import checks
from ao_mdm.config import base_config
from helpers import ROOT


def _fields() -> list:
  """(section or "", field) of every field of a run's config."""
  top = [("", f) for f in dataclasses.fields(specs.Spec) if f.name not in specs.SECTIONS]
  return top + [(s, f) for s, cls in specs.SECTIONS.items() for f in dataclasses.fields(cls)]


def _outside(bounds: str) -> list:
  """Values just outside `bounds` ('>= 1', '> 0', '[0, 1)', ...)."""
  if bounds.startswith(">"):
    low = float(bounds.lstrip(">= "))
    return [low - 1 if bounds.startswith(">=") else low]
  low, high = (float(x) for x in bounds[1:-1].split(","))
  return [low - 1 if bounds[0] == "[" else low, high + 1 if bounds[-1] == "]" else high]


def _read(spec: specs.Spec, section: str, name: str):
  return getattr(getattr(spec, section) if section else spec, name)


def _with(section: str, name: str, value) -> dict:
  config = specs.defaults()
  (config[section] if section else config)[name] = value
  return config


def test_base_config_is_the_specs_fields_and_defaults():
  config = base_config()
  assert config.to_dict() == specs.defaults()
  assert specs.parse(config) == specs.Spec() == specs.default()
  for section, f in _fields():
    default = (config[section] if section else config)[f.name]
    assert type(default) is f.type, (section, f.name, default)  # 0.0, not 0, for a float
    assert f.metadata["help"].strip(), f"{section}.{f.name} has no help line"


def test_every_choice_and_bound_is_checked_and_named_in_the_error():
  choices, bounded = [], []
  for section, f in _fields():
    name = f"{section}.{f.name}"
    for choice in f.metadata.get("choices", ()):
      assert _read(specs.parse(_with(section, f.name, choice)), section, f.name) == choice
    if f.metadata.get("choices"):
      with pytest.raises(ValueError, match=rf"^{name}='bogus'; accepted: "):
        specs.parse(_with(section, f.name, "bogus"))
      choices.append(name)
    if bounds := f.metadata.get("bounds"):
      for value in _outside(bounds):
        value = f.type(value)
        with pytest.raises(ValueError) as e:
          specs.parse(_with(section, f.name, value))
        assert str(e.value) == f"{name}={value} must be {'' if bounds[0] == '>' else 'in '}{bounds}"
      bounded.append(name)
  assert {"model.variant", "model.attention", "order.kind"} <= set(choices)
  assert {"model.n_layer", "order.random_ratio", "train.ema_decay"} <= set(bounded)


def test_variant_parts_come_from_the_registry(monkeypatch):
  """A variant is one entry of specs.VARIANTS: the spec accepts it, and a name outside it is
  refused with the registry's names."""
  assert list(specs.VARIANTS) == ["ao", "sigma"]
  assert specs.ModelSpec().arch.adaln and specs.ModelSpec(variant="sigma").arch.tied_head
  tied = dataclasses.replace(specs.VARIANTS["ao"], tied_head=True)
  monkeypatch.setitem(specs.VARIANTS, "ao_tied", tied)
  assert specs.ModelSpec(variant="ao_tied").arch == tied
  with pytest.raises(ValueError, match="model.variant='bert'; accepted: ao, sigma, ao_tied"):
    specs.ModelSpec(variant="bert")


def test_a_saved_config_gets_the_defaults_of_new_keys():
  saved = json.loads(json.dumps(specs.Spec().replace(seed=3).to_dict()))  # tuples as lists
  del saved["train"]["wandb_project"]  # a key added after the save
  saved["model"]["gone"] = 1  # a key since removed
  assert specs.with_defaults(saved) == specs.Spec(seed=3)


def test_a_misspelt_key_gets_the_closest_one():
  config = base_config()
  with config.unlocked():
    config.model.n_embed = 64
  with pytest.raises(ValueError, match="sets model.n_embed, which is no config key; did you mean"):
    specs.parse(config)
  argv = ["ao-mdm", f"--config={ROOT}/configs/tiny.py", "--config.model.n_embed=64"]
  assert checks.config_flag_error(argv, KeyError("n_embed")) == (
    "--config.model.n_embed: config.model has no key 'n_embed'; did you mean --config.model.n_embd?"
  )
  argv = ["ao-mdm", f"--config={ROOT}/configs/tiny.py", "--config.trian.steps=1"]
  assert checks.config_flag_error(argv, KeyError("trian")).endswith("did you mean --config.train?")


def test_every_shipped_config_parses():
  names = []
  for path in sorted((ROOT / "configs").glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"shipped_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    specs.parse(module.get_config())
    names.append(path.stem)
  assert {"tiny", "demo", "paper", "repro", "bench_train"} <= set(names)
