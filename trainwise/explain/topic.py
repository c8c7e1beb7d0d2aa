"""What a topic is: its name, its Chinese term, a one-line summary per language, its arguments and the
function that computes it (keyword arguments in, a Doc out)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from trainwise.errors import TrainwiseError
from trainwise.explain.render import Doc


@dataclass(frozen=True)
class Arg:
    flag: str  # "--lr"
    kwargs: dict  # for add_argument: type, default, help

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Topic:
    name: str
    term_zh: str  # the term Chinese ML courses use; the zh output contains it
    summary: dict[str, str]  # {"en": ..., "zh": ...}, one line for the listing
    run: Callable[..., Doc]  # run(lang=..., **{arg.dest: value}) -> Doc
    args: list[Arg] = field(default_factory=list)
    examples: str = ""


def floats(text: str) -> list[float]:
    """'2,1,0.1' -> [2.0, 1.0, 0.1]."""
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' must be comma-separated numbers, e.g. 2,1,0.1") from None


def ints(text: str) -> list[int]:
    """'8,1024,4096' -> [8, 1024, 4096]."""
    try:
        values = [int(float(v)) for v in text.replace("x", ",").split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' must be comma-separated whole numbers, e.g. 8,1024,4096") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"'{text}' must be one or more positive sizes")
    return values


def positive(value: float, name: str) -> None:
    if not value > 0:
        raise TrainwiseError(f"{name} = {value} must be positive.")
