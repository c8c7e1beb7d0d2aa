"""Argument types shared by the commands: numbers as people type them (1e10, 4e6)."""

from __future__ import annotations

import argparse
import math
from pathlib import PurePath

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


def positive_number(text: str) -> float:
    """A number above 0 (a count of tokens, FLOPs, minutes): 0 is refused, never read as "not given"."""
    value = number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' must be above 0")
    return value


def whole_number(text: str) -> int:
    """A count of at least 1 (ranks, sequences, steps)."""
    value = number(text)
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must be a whole number of at least 1")
    return int(value)


def plot_file(text: str) -> str:
    """A chart's file name whose extension names a format matplotlib writes (without one, it would add .png
    and write another file than the one asked for)."""
    from matplotlib.backend_bases import FigureCanvasBase  # slow to import: only where a chart is asked for

    formats = FigureCanvasBase.get_supported_filetypes()
    if PurePath(text).suffix[1:].lower() not in formats:
        raise argparse.ArgumentTypeError(
            f"'{text}' needs the extension of an image format, e.g. {text.rstrip('.')}.png (or "
            f"{', '.join(sorted(f for f in formats if f != 'png'))})")
    return text


def byte_size(text: str) -> int:
    """A memory size as people type it (80GiB, 24GB, 1e9): argparse then names the flag in its error."""
    try:
        return parse_bytes(text)
    except TrainwiseError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
