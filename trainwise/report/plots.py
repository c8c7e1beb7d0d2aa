"""The report's charts, drawn with matplotlib and returned as PNG bytes.

One house style for every chart (light grid, no top/right spines, SI-prefixed axes) so the report
reads as one document. Each function takes plain rows/dicts from the run directory, not tensors.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import matplotlib

from trainwise.measure.roofline import plot_roofline

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import EngFormatter, PercentFormatter  # noqa: E402

BLUE, ORANGE, GREEN, GRAY = "#2563eb", "#ea580c", "#16a34a", "#6b7280"
STYLE = {
    "figure.figsize": (7.0, 3.6), "figure.dpi": 100, "savefig.dpi": 130, "font.size": 10,
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
    "axes.titlesize": 11, "axes.titleweight": "bold", "axes.titlelocation": "left", "legend.frameon": False,
}


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def loss_chart(rows: list[dict]) -> bytes:
    """Training loss (every logged step) and validation loss (eval rows) against tokens seen."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots()
        ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], color=BLUE, lw=1.6, label="train")
        val = [r for r in rows if "val_loss" in r]
        if val:
            ax.plot([r["tokens"] for r in val], [r["val_loss"] for r in val], color=ORANGE, lw=1.6, marker="o",
                    ms=4, label="validation")
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.set(xlabel="tokens seen", ylabel="loss (nats/token)")
        ax.legend()
        return png(fig)


def lr_chart(rows: list[dict]) -> bytes:
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots()
        ax.plot([r["step"] for r in rows], [r["lr"] for r in rows], color=GREEN, lw=1.6)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        ax.set(xlabel="optimizer step", ylabel="learning rate")
        ax.set_ylim(bottom=0)
        return png(fig)


def throughput_chart(rows: list[dict]) -> bytes:
    """tokens/s and MFU per logged interval, on two panels sharing the step axis."""
    steps = [r["step"] for r in rows]
    with plt.rc_context(STYLE):
        fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7.0, 4.2))
        top.plot(steps, [r["tokens_per_s"] for r in rows], color=BLUE, lw=1.6)
        top.yaxis.set_major_formatter(EngFormatter())
        top.set(ylabel="tokens/s")
        top.set_ylim(bottom=0)
        bottom.plot(steps, [r["mfu"] for r in rows], color=ORANGE, lw=1.6, label="MFU")
        if any("hfu" in r for r in rows):
            bottom.plot(steps, [r.get("hfu", r["mfu"]) for r in rows], color=GRAY, lw=1.2, ls="--", label="HFU")
            bottom.legend()
        bottom.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=None))
        bottom.set(xlabel="optimizer step", ylabel="MFU")
        bottom.set_ylim(bottom=0)
        return png(fig)


def memory_chart(predicted: dict[str, float], measured: dict[str, float] | None) -> bytes:
    """Horizontal bars per memory category (MiB), predicted beside measured where measured exists."""
    names = list(predicted)
    mib = 2 ** 20
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(7.0, 4.2))
        ys = range(len(names))
        h = 0.38 if measured else 0.6
        ax.barh([y - (h / 2 if measured else 0) for y in ys], [predicted[n] / mib for n in names], height=h,
                color=BLUE, label="predicted (plan)")
        if measured:
            ax.barh([y + h / 2 for y in ys], [measured.get(n, 0) / mib for n in names], height=h, color=ORANGE,
                    label="measured")
        ax.set_yticks(list(ys), names)
        ax.invert_yaxis()
        ax.set(xlabel="MiB (2^20 bytes)")
        ax.grid(axis="y", visible=False)
        ax.legend(loc="upper right")
        return png(fig)


def roofline_chart(points, peak_flops: float, bandwidth: float, title: str) -> bytes:
    """trainwise.measure.roofline's chart, read back as PNG bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "roofline.png"
        plot_roofline(points, peak_flops, bandwidth, str(path), title)
        return path.read_bytes()


# ---------------------------------------------------------------------------------------------------
# Several runs on one chart (trainwise compare): one color per run, in the order given

PALETTE = (BLUE, ORANGE, GREEN, "#9333ea", "#dc2626", "#0891b2", "#ca8a04", GRAY)


def runs_loss_chart(runs: list[tuple[str, list[dict]]], x_key: str, x_label: str) -> bytes:
    """Training loss (thin) and validation loss (markers) of each run against `x_key` of its rows
    (tokens, or the model FLOPs the compare page adds to each row)."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots()
        for (name, rows), color in zip(runs, PALETTE * 4):
            ax.plot([r[x_key] for r in rows], [r["loss"] for r in rows], color=color, lw=1.2, alpha=0.55)
            val = [r for r in rows if "val_loss" in r]
            if val:
                ax.plot([r[x_key] for r in val], [r["val_loss"] for r in val], color=color, lw=1.6, marker="o",
                        ms=4)
            ax.plot([], [], color=color, lw=2, label=name)
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.set(xlabel=x_label, ylabel="loss (nats/token)")
        ax.legend(title="line: train · dots: validation", title_fontsize=8, fontsize=8)
        return png(fig)


def runs_throughput_chart(runs: list[tuple[str, list[dict]]]) -> bytes:
    """tokens/s and MFU of each run per logged interval, against tokens seen."""
    with plt.rc_context(STYLE):
        fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7.0, 4.2))
        for (name, rows), color in zip(runs, PALETTE * 4):
            tokens = [r["tokens"] for r in rows]
            top.plot(tokens, [r["tokens_per_s"] for r in rows], color=color, lw=1.6, label=name)
            bottom.plot(tokens, [r["mfu"] for r in rows], color=color, lw=1.6)
        top.yaxis.set_major_formatter(EngFormatter())
        top.set(ylabel="tokens/s")
        top.set_ylim(bottom=0)
        top.legend(fontsize=8)
        bottom.xaxis.set_major_formatter(EngFormatter())
        bottom.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=None))
        bottom.set(xlabel="tokens seen", ylabel="MFU")
        bottom.set_ylim(bottom=0)
        return png(fig)


def runs_memory_chart(names: list[str], memory: list[dict[str, float]], categories: list[str]) -> bytes:
    """Grouped horizontal bars (MiB): one group per memory category, one bar per run."""
    mib = 2 ** 20
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(7.0, 1.2 + 0.45 * len(categories) * max(2, len(names)) / 2))
        h = 0.8 / len(names)
        for i, (name, mem, color) in enumerate(zip(names, memory, PALETTE * 4)):
            ys = [c + (i - (len(names) - 1) / 2) * h for c in range(len(categories))]
            ax.barh(ys, [mem.get(c, 0) / mib for c in categories], height=h, color=color, label=name)
        ax.set_yticks(range(len(categories)), categories)
        ax.invert_yaxis()
        ax.set(xlabel="MiB (2^20 bytes)")
        ax.grid(axis="y", visible=False)
        ax.legend(loc="best", fontsize=8)
        return png(fig)
