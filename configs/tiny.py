"""Tiny AO-GPT for the CPU demo and the tests: trains in a few minutes on 2 cores."""
import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  return base_config()
