"""Validation helpers of the config sections: a value from a fixed set, the closest valid name."""

from __future__ import annotations

import difflib
from typing import Any

from trainwise.errors import TrainwiseError


def choice(where: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise TrainwiseError(f"{where} = '{value}' is not one of {', '.join(allowed)}{suggest(value, allowed)}.")


def suggest(word: str, candidates: Any, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.5)
    if not close:
        return ""
    names = " or ".join(f"'{prefix + '.' if prefix else ''}{c}'" for c in close)
    return f" (did you mean {names}?)"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
