"""The ml_collections config that config files and `--config.x.y=...` overrides change: every
field of ao_mdm/specs.py with its default (the tiny AO-GPT of the CPU demo, configs/tiny.py)."""

import ml_collections

from ao_mdm import specs


def base_config() -> ml_collections.ConfigDict:
  """Every config key and its default, as declared by the specs; shipped configs override
  fields and add no keys."""
  return ml_collections.ConfigDict(specs.defaults())
