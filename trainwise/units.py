"""Bytes as a person writes and reads them: '80GiB' in, '16.00 GB (14.90 GiB)' out.

The convention (docs/ARCHITECTURE.md, "Units and names"): print both the SI unit (MB, GB: 10^k bytes) and
the binary one (MiB, GiB: 2^k bytes) wherever a person reads a size; JSON holds plain bytes.
"""

from __future__ import annotations

import math
import re

from trainwise.errors import TrainwiseError

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """'80GiB' -> 85899345920, '80GB' -> 8e10, '1e9' -> 1e9 bytes."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise TrainwiseError(f"memory size '{text}' is not understood; write bytes or e.g. 80GiB, 80GB, 512MiB.")
        try:
            value = float(m.group(1)) * _UNITS[m.group(2).lower()]
        except ValueError:
            raise TrainwiseError(f"memory size '{text}' is not a number followed by a unit (e.g. 80GiB).") from None
    if not value > 0 or value == float("inf"):
        raise TrainwiseError(f"memory size '{text}' must be a positive, finite number of bytes (e.g. 80GiB).")
    return int(value)


def fmt_bytes(n: float | None) -> str:
    """'16.00 GB (14.90 GiB)'; docs/ARCHITECTURE.md, "Units and names": print MB/GB (10^k) and MiB/GiB (2^k)."""
    if n is None:
        return "unknown"
    for si, bi, unit in ((1e12, 2**40, "T"), (1e9, 2**30, "G"), (1e6, 2**20, "M"), (1e3, 2**10, "K")):
        if n >= si:
            return f"{n / si:,.2f} {unit}B ({n / bi:,.2f} {unit}iB)"
    return f"{n:,.0f} B"


def fmt_finite(x: float, spec: str = ".4f") -> str:
    """x formatted, or 'not finite' for nan and inf (a diverged run's loss): no number a reader can act on."""
    return format(x, spec) if math.isfinite(x) else "not finite"
