"""Other processes' share of this machine's cores, read from /proc/stat, and what it costs a step.

A CPU step's kernels run on every core and wait for their slowest thread at the end of each parallel
region. A process that shares a core with one of those threads halves it while it runs (the scheduler's
fair share), and the whole step with it; the fastest-of-many timings the calibration and the speed probe
take step around such moments, a run's mean step time does not. load_factor turns the share read while
a probe ran into that slowdown.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Other processes' use of the cores below which it is the machine's own housekeeping, not load (in cores:
# a quiet machine reads about a fifth of it, a process keeping one core 25% busy twice it or more:
# benchmarks/RESULTS.md, "One in-step factor per compute precision; other processes' share of the cores").
LOAD_MIN_CORES = 0.05
LOAD_MAX_SHARE = 0.75  # at most 4x: past that the fair-share picture (one other process per core) is off


def cpu_busy_jiffies() -> tuple[float, float] | None:
    """(busy seconds of all CPUs since boot, this process's CPU seconds) from /proc, or None off Linux."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), time.process_time()


def others_share(before: tuple[float, float] | None, after: tuple[float, float] | None, wall: float,
                 cores: int | None = None) -> float | None:
    """Share of the usable cores that OTHER processes kept busy between two cpu_busy_jiffies readings:
    (all CPUs' busy time - ours) / (wall x cores). Independent of how many threads our own kernels use
    (a small matmul may run on one), so a quiet machine reads ~0 however the measurement runs."""
    if before is None or after is None or wall <= 0:
        return None
    cores = cores or os.cpu_count() or 1
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / (wall * cores))


def load_factor(share: float | None, threads: int, cores: int | None = None) -> float:
    """How much longer a step of `threads` threads takes, on average, while other processes keep `share`
    of the `cores` busy: 1 / (1 - x), x = the others' core-seconds per second that land on cores our
    threads use (beyond the cores we leave free). Derivation: another process sharing a core with one of
    our threads gets half of it, so it runs there for twice the CPU time it uses (a fraction 2x of the
    wall), and our step, which waits on that thread, moves at half speed meanwhile: 1 - 2x/2 of full
    speed: a lower bound, since a shared core also loses its caches (benchmarks/RESULTS.md compares it with
    measured steps). 1.0 below LOAD_MIN_CORES."""
    cores = cores or os.cpu_count() or 1
    if share is None:
        return 1.0
    on_ours = share * cores - max(cores - threads, 0)
    if on_ours < LOAD_MIN_CORES:
        return 1.0
    return 1.0 / (1.0 - min(on_ours, LOAD_MAX_SHARE))
