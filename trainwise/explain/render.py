"""A worked example as text: a title, steps "formula = substituted = result unit" in aligned columns,
free lines and tables, a closing "in your run" note; and the named values behind it for --json."""

from __future__ import annotations

import math
import re
import textwrap
import unicodedata
from dataclasses import dataclass, field
from typing import Any

IN_YOUR_RUN = {"en": "In your run", "zh": "在你的训练中"}


def num(x: float | int, digits: int = 4) -> str:
    """12,345 for whole numbers below 1e15, else 4 significant digits (1.5e+06, 0.09, 17.36)."""
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int) or (isinstance(x, float) and math.isfinite(x) and x == int(x) and abs(x) < 1e15):
        if abs(x) < 1e7:
            return f"{int(x):,}"
    return re.sub(r"e([+-])0*(\d)", lambda m: "e" + ("-" if m.group(1) == "-" else "") + m.group(2), f"{x:.{digits}g}")


def width(text: str) -> int:
    """Columns a string takes in a terminal: CJK characters are two wide."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def _wide(ch: str) -> bool:
    return unicodedata.east_asian_width(ch) in "WF"


def wrap(text: str, cols: int = 100, indent: str = "") -> list[str]:
    """Lines of at most `cols` terminal columns; CJK text breaks between its characters and at spaces, and
    keeps runs of other characters (`model.ffn_hidden`, 4,096) whole unless one is longer than a line."""
    if not any(_wide(ch) for ch in text):
        return textwrap.wrap(text, cols, subsequent_indent=indent, break_on_hyphens=False) or [""]
    units = re.findall(r"\s|[^\s]", text)  # one character each, then runs of narrow ones joined
    joined: list[str] = []
    for u in units:
        if joined and not u.isspace() and not _wide(u) and not joined[-1].isspace() and not _wide(joined[-1][-1]):
            joined[-1] += u
        else:
            joined.append(u)
    lines, line = [], ""
    for u in joined:
        if width(line) + width(u) > cols and line.strip():
            lines.append(line.rstrip())
            line = indent
            if u.isspace():
                continue
        while width(line) + width(u) > cols:  # a run longer than a whole line: cut it
            room = cols - width(line)
            lines.append(line + u[:room])
            line, u = indent, u[room:]
        line += u
    return lines + [line]


def pad(text: str, cols: int) -> str:
    return text + " " * max(0, cols - width(text))


@dataclass
class Doc:
    title: str
    lang: str = "en"
    values: dict[str, Any] = field(default_factory=dict)
    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def step(self, label: str, formula: str, substituted: str = "", result: str = "") -> None:
        """One line of a derivation: label  formula = substituted = result."""
        if self.blocks and self.blocks[-1][0] == "steps":
            self.blocks[-1][1].append((label, formula, substituted, result))
        else:
            self.blocks.append(("steps", [(label, formula, substituted, result)]))

    def text(self, line: str = "") -> None:
        self.blocks.append(("text", line))

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.blocks.append(("table", (header, rows)))

    def where(self, *lines: str) -> None:
        """Where the idea shows up in the user's own run."""
        self.blocks.append(("text", ""))
        self.blocks.append(("text", f"{IN_YOUR_RUN.get(self.lang, IN_YOUR_RUN['en'])}:"))
        for line in lines:
            self.blocks.append(("text", f"  - {line}"))

    def render(self) -> str:
        out = [self.title, "=" * min(width(self.title), 100)]
        for kind, body in self.blocks:
            if kind == "text":
                out.extend(wrap(body, indent="    " if body.startswith("  - ") else ""))
            elif kind == "steps":
                out.extend(_steps(body))
            else:
                out.extend(_table(*body))
        return "\n".join(out)


def _steps(rows: list[tuple[str, str, str, str]]) -> list[str]:
    w = [max(width(r[i]) for r in rows) for i in range(3)]
    lines = []
    for label, formula, sub, result in rows:
        parts = [pad(formula, w[1])]
        if sub:
            parts.append(pad(sub, w[2]))
        if result:
            parts.append(result)
        lines.append(("  " + pad(label, w[0]) + "  " + " = ".join(parts)).rstrip())
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    w = [max(width(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  " + "  ".join(pad(str(c), w[i]) for i, c in enumerate(r))  # noqa: E731
    return [fmt(header).rstrip(), "  " + "  ".join("-" * x for x in w)] + [fmt(r).rstrip() for r in rows]
