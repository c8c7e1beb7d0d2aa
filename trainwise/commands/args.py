"""Argument types shared by the commands: numbers as people type them (1e10, 4e6)."""

from __future__ import annotations

import argparse
import math

from trainwise.errors import TrainwiseError
from trainwise.units import parse_bytes


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


def byte_size(text: str) -> int:
    """A memory size as people type it (80GiB, 24GB, 1e9): argparse then names the flag in its error."""
    try:
        return parse_bytes(text)
    except TrainwiseError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
