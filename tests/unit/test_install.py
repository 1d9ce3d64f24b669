"""setup.py's ranges admit the exact versions of constraints.txt, which are what is installed."""

import ast
import importlib.metadata
import os

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from helpers import ROOT


def _setup_requirements() -> list:
  tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
  found = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "INSTALL_REQUIRES":
      found["install"] = ast.literal_eval(node.value)
    if isinstance(node, ast.keyword) and node.arg == "extras_require":
      found["extras"] = ast.literal_eval(node.value)
  extras = [r for name, reqs in found["extras"].items() if name != "cuda" for r in reqs]
  return [Requirement(r) for r in found["install"] + extras]


def _constraints() -> dict:
  pins = {}
  for line in open(os.path.join(ROOT, "constraints.txt")):
    line = line.split("#")[0].strip()
    if line:
      name, version = line.split("==")
      pins[canonicalize_name(name)] = version
  return pins


def test_ranges_admit_the_pinned_versions_and_those_are_installed():
  pins = _constraints()
  for req in _setup_requirements():
    name = canonicalize_name(req.name)
    if name in ("matplotlib", "tensorboard-plugin-profile"):  # [repro] and [profile] are not
      continue  # part of the test install
    assert name in pins, f"{req} has no exact version in constraints.txt"
    assert req.specifier.contains(pins[name], prereleases=True), (str(req), pins[name])
    installed = importlib.metadata.version(req.name).split("+")[0]
    assert installed == pins[name], (req.name, installed, pins[name])
