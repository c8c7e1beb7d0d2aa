"""Argument types shared by the commands: numbers as people type them (1e10, 4e6)."""

from __future__ import annotations

import argparse


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number (e.g. 1e10)") from None


def whole_number(text: str) -> int:
    value = number(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"'{text}' must be a whole number")
    return int(value)
