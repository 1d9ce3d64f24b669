"""Bytes a compiled program moves per step, read from its HLO text: collectives and HBM
traffic, with loop bodies counted by their trip counts (the roofline's inputs)."""

import re

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "u64": 8,
}


def hlo_traffic(hlo_text: str) -> dict:
  """Bytes one device moves per step, read from the compiled HLO: `collective` (results of
  all-reduce, all-gather, ...) and `hbm` (operands and results of every top-level instruction,
  fusions counted at their boundary). An instruction inside a while loop (the layer scan, the
  micro-batch scan) counts once per iteration, by the loop's known trip count.
  """
  computations: dict[str, dict] = {}
  comp = None
  for line in hlo_text.splitlines():
    head = re.match(r"\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$", line)
    if head:
      comp = head.group(2)
      computations[comp] = {"entry": bool(head.group(1)), "lines": []}
    elif comp is not None:
      computations[comp]["lines"].append(line)
  # computation -> [(called computation, times per call)] for while bodies and calls
  loops: dict[str, list[tuple[str, int]]] = {}
  for name, c in computations.items():
    for line in c["lines"]:
      body = re.search(r"\bbody=%?([\w.\-]+)", line)
      if body:
        n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        condition = re.search(r"\bcondition=%?([\w.\-]+)", line)
        trips = int(n.group(1)) if n else _loop_bound(computations, condition)
        loops.setdefault(name, []).append((body.group(1), trips))
      call = re.search(r"\scall\(.*\bto_apply=%?([\w.\-]+)", line)
      if call:
        loops.setdefault(name, []).append((call.group(1), 1))
  multiplier: dict[str, int] = {}

  def visit(name, factor):
    multiplier[name] = multiplier.get(name, 0) + factor
    for callee, times in loops.get(name, []):
      visit(callee, factor * times)

  for name, c in computations.items():
    if c["entry"]:
      visit(name, 1)
  out = {"collective": 0.0, "hbm": 0.0}
  for name, factor in multiplier.items():
    for line in computations.get(name, {"lines": []})["lines"]:
      m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)", line)
      if not m or m.group(2) in _NO_TRAFFIC:
        continue
      result, op, rest = m.group(1), m.group(2), m.group(3)
      if op.endswith("-done"):
        continue  # its -start counted the transfer
      if op.replace("-start", "") in _COLLECTIVES:
        out["collective"] += factor * _shape_bytes(result)
      operands = rest.split("), ")[0]  # the operand list, before attributes
      out["hbm"] += factor * (_shape_bytes(result) + _shape_bytes(operands))
  return out


def _loop_bound(computations: dict, condition) -> int:
  """Iterations of a `while i < N` loop (a scan), its condition's s32 constant N; 1 if unsure."""
  lines = computations.get(condition.group(1), {"lines": []})["lines"] if condition else []
  if not any("direction=LT" in line for line in lines):
    return 1
  bounds = [int(n) for line in lines for n in re.findall(r"= s32\[\][^ ]* constant\((\d+)\)", line)]
  return max(bounds, default=1)


_NO_TRAFFIC = (
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "while",
  "call",
  "conditional",
  "after-all",
  "partition-id",
  "replica-id",
  "iota",
)


def _shape_bytes(shape: str) -> float:
  """Bytes of an HLO result shape such as `f32[8,128]{1,0}` or a tuple of them."""
  total = 0
  for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _DTYPE_BYTES.get(dtype, 4)
  return total
