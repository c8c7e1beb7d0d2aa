"""The fit's chart, in the report's house style (trainwise.report.plots): the points of each run against
tokens with the fitted law through them, and the fitted against the observed loss of every point.
One colour per model (ordered by N), one marker shape per seed, the legend by model."""

from __future__ import annotations

import numpy as np

from trainwise.report.plots import STYLE, plt, png
from trainwise.scale.law import Law

MARKERS = "osD^vP*X"  # seed i of the fit (in the order seeds first appear) gets MARKERS[i % len]


def fit_chart(groups: list[tuple[str, int | None, np.ndarray]], law: Law) -> bytes:
    """groups: (model name, seed, (P, 3) array of N, D, L) per run. Returns PNG bytes."""
    with plt.rc_context(STYLE):
        return png(fit_figure(groups, law))


def fit_figure(groups: list[tuple[str, int | None, np.ndarray]], law: Law):
    """The chart's matplotlib figure (call inside plt.rc_context(STYLE) for the house style)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, NullFormatter

    models = sorted({(pts[0, 0], name) for name, _, pts in groups})
    colors = dict(zip(models, plt.cm.tab10(np.arange(len(models)) % 10)))
    seeds = list(dict.fromkeys(seed for _, seed, _ in groups))
    marker = {seed: MARKERS[i % len(MARKERS)] for i, seed in enumerate(seeds)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.0), gridspec_kw=dict(width_ratios=[1.6, 1]))
    for name, seed, pts in groups:
        color = colors[(pts[0, 0], name)]
        left.scatter(pts[:, 1], pts[:, 2], s=14, color=color, marker=marker[seed])
        right.scatter(pts[:, 2], law.loss(pts[:, 0], pts[:, 1]), s=12, color=color, marker=marker[seed])
    handles = []
    for (n, name), color in colors.items():
        d = np.concatenate([pts[:, 1] for other, _, pts in groups if other == name and pts[0, 0] == n])
        d = np.geomspace(d.min(), d.max(), 50)
        left.plot(d, law.loss(n, d), color=color, lw=1.2)
        handles.append(Line2D([], [], color=color, lw=1.2, marker="o", ms=4, label=f"{name} (N={n / 1e6:.3g}M)"))
    if len(seeds) > 1:
        handles += [Line2D([], [], color="#6b7280", lw=0, marker=marker[s], ms=4, label=f"seed {s}") for s in seeds]
    left.set_xscale("log")
    left.xaxis.set_major_formatter(EngFormatter())
    left.xaxis.set_minor_formatter(NullFormatter())
    left.set(xlabel="tokens seen D", ylabel="validation loss (nats/token)",
             title=f"L = {law.E:.3g} + {law.A:.3g}/N^{law.alpha:.3g} + {law.B:.3g}/D^{law.beta:.3g}")
    left.legend(handles=handles, fontsize=7)
    every = np.concatenate([p[:, 2] for _, _, p in groups])
    lims = [every.min() * 0.98, every.max() * 1.02]
    right.plot(lims, lims, color="#6b7280", lw=1, ls="--")
    right.set(xlabel="observed loss", ylabel="fitted loss", xlim=lims, ylim=lims, title="fit vs observed")
    return fig
