"""Synthetic scaling-law fit records for the scale tests: curves drawn from a known law, fitted and
bootstrapped as `scale fit` does, with the fields a stored record carries."""

from __future__ import annotations

import numpy as np

from trainwise.scale.fitting import fit_points, identification_of
from trainwise.scale.law import FULL, Form, Law

# Hoffmann et al. 2022's own fit (eq. 10), used as the "known values".
TRUE = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
# The law the built-in corpus's sweep fitted (issue 31): a power law in D, an N term under 0.15 nats.
SMALL_CORPUS = Law(E=0.00069, A=9.67e5, B=21.3, alpha=1.37, beta=0.116)


def curves(law: Law, sizes, tokens, noise: float, run_noise: float = 0.0, seed: int = 0) -> list[np.ndarray]:
    """One curve of (N, D, L) per size along `tokens`, with multiplicative Gaussian noise per point and
    per run (a run's whole curve moves with its seed)."""
    rng = np.random.default_rng(seed)
    groups = []
    for n in sizes:
        d = np.asarray(tokens, dtype=float)
        loss = law.loss(n, d) * np.exp(rng.normal(0.0, noise, d.shape) + rng.normal(0.0, run_noise))
        groups.append(np.stack([np.full_like(d, n), d, loss], axis=1))
    return groups


def record_of(groups: list[np.ndarray], form: Form = FULL, samples: int = 12, unique: int | None = None) -> dict:
    """A fit record as `scale fit` stores it, for synthetic runs."""
    record = {**fit_points(groups, form, samples=samples), "recipe": None, "corpus_train_tokens": unique,
              "corpus": "a synthetic corpus", "conventions": {"N": "N", "D": "D", "L": "L"},
              "runs": [{"run_dir": f"m{i}", "name": f"m{i}", "seed": 0, "n_params": float(g[0, 0]), "used": "synthetic",
                        "points": g[:, 1:].tolist()}
                       for i, g in enumerate(groups)]}
    record["identification"] = identification_of(record)
    return record
