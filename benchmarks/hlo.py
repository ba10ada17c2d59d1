"""What a compiled step holds: its approximate kernel count and its memory, read from XLA."""

from __future__ import annotations

import re

# Instructions of the ENTRY computation that launch nothing on the device.
_NO_LAUNCH = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})
# "%name = <shape> opcode(" (shapes hold no "word(", so the first one is the opcode).
_OPCODE = re.compile(r"=\s*\S.*?\s([a-z][a-z0-9-]*)\(")


def count_kernels(hlo_text: str) -> int:
  """Approximate count of the device launches of one call of a compiled step.

  The instructions of the ENTRY computation of the optimised HLO (`compiled.as_text()`), except
  parameter, constant, tuple, get-tuple-element and bitcast. Approximate: a while loop or
  conditional counts once however many kernels it runs, an async start/done pair twice, a GPU
  command buffer (a `call` that replays several kernels as one CUDA graph) once, and on the CPU
  it counts what XLA would launch, not threads.
  """
  count, in_entry = 0, False
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY "):
      in_entry = True
    elif in_entry:
      if line.startswith("}"):
        break
      match = _OPCODE.search(line)
      if match and match.group(1) not in _NO_LAUNCH:
        count += 1
  return count


def count_opcode(hlo_text: str, opcode: str) -> int:
  """How many instructions of the whole module (every computation) are `opcode`."""
  return hlo_text.count(f" {opcode}(")


def memory(compiled) -> dict:
  """Argument, output, aliased and temporary bytes of a compiled call ({} where XLA gives none)."""
  m = compiled.memory_analysis()
  if m is None:
    return {}
  return {
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "alias_bytes": int(m.alias_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
  }
