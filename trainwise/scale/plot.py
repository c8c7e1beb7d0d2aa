"""The fit's chart, in the report's house style (trainwise.report.plots): the points of each run against
tokens with the fitted law through them, and the fitted against the observed loss of every point."""

from __future__ import annotations

import numpy as np

from trainwise.report.plots import STYLE, plt, png
from trainwise.scale.law import Law


def fit_chart(groups: list[tuple[str, np.ndarray]], law: Law) -> bytes:
    """groups: (label, (P, 3) array of N, D, L) per run. Returns PNG bytes."""
    from matplotlib.ticker import EngFormatter, NullFormatter

    colors = plt.cm.viridis(np.linspace(0.0, 0.9, max(1, len(groups))))
    with plt.rc_context(STYLE):
        fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.0), gridspec_kw=dict(width_ratios=[1.6, 1]))
        for (label, pts), color in zip(groups, colors):
            n = pts[0, 0]
            left.scatter(pts[:, 1], pts[:, 2], s=14, color=color, label=f"{label} (N={n / 1e6:.3g}M)")
            d = np.geomspace(pts[:, 1].min(), pts[:, 1].max(), 50)
            left.plot(d, law.loss(n, d), color=color, lw=1.2)
            right.scatter(pts[:, 2], law.loss(pts[:, 0], pts[:, 1]), s=12, color=color)
        left.set_xscale("log")
        left.xaxis.set_major_formatter(EngFormatter())
        left.xaxis.set_minor_formatter(NullFormatter())
        left.set(xlabel="tokens seen D", ylabel="validation loss (nats/token)",
                 title=f"L = {law.E:.3g} + {law.A:.3g}/N^{law.alpha:.3g} + {law.B:.3g}/D^{law.beta:.3g}")
        left.legend(fontsize=7)
        every = np.concatenate([p[:, 2] for _, p in groups])
        lims = [every.min() * 0.98, every.max() * 1.02]
        right.plot(lims, lims, color="#6b7280", lw=1, ls="--")
        right.set(xlabel="observed loss", ylabel="fitted loss", xlim=lims, ylim=lims, title="fit vs observed")
        return png(fig)
