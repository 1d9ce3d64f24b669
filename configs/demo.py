"""The `make demo` model: an AO-GPT that learns to use its context in a few minutes on 2 cores.

The setting comes from the exploration in docs/reproducing.md; configs/tiny.py stays the
smallest config (tests).
"""
import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  return base_config()
