"""The smallest config (the base_config() defaults: L=4, D=128, T=128, SentencePiece vocab 2,048):
what the tests and the examples use; the `make demo` model is configs/demo.py."""

import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  return base_config()
