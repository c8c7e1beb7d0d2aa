"""Scaling laws from the user's own runs: fit L(N, D) = E + A/N^alpha + B/D^beta (Hoffmann et al. 2022,
approach 3), say what the points identify, predict a planned run's loss, find the compute-optimal N and
D, and run a small sweep.

    law.py      the law, its forms, its Huber/L-BFGS fit, the bootstrap and what it identifies
    points.py   (N, D, L) points from run directories (which rows count, and why)
    fitting.py  fit / predict / optimal on fit records, and their refusals to extrapolate the unidentified
    store.py    fit records on disk, per corpus + tokenizer
    sweep.py    an IsoFLOP grid trained inside a time budget (on builtin:stdlib unless given data)
    plot.py     the chart;  commands/scale.py  `trainwise scale ...`
"""
