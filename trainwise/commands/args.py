"""Argument types shared by the commands: numbers as people type them (1e10, 4e6)."""

from __future__ import annotations

import argparse
import math


def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number (e.g. 1e10)") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number (e.g. 1e10)")
    return value


def whole_number(text: str) -> int:
    value = number(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"'{text}' must be a whole number")
    return int(value)
