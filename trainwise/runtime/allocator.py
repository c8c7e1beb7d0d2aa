"""Keep freed host memory in the process: a CPU training step then stops paying page faults.

PyTorch has no caching allocator for CPU tensors: each one is a malloc, and glibc serves large blocks
(above a threshold that starts at 128 KiB and adapts up to 32 MiB) by mmap, returning them to the OS on
free. A training step allocates the same large activations, logits and gradients every step, so each
step faulted its pages in afresh: the default run's compiled step took twice as long in a new process as
once the threshold was set (benchmarks/RESULTS.md, "Host allocator"), and a step's time depended on what the process had
allocated before, which no time model can follow. Setting the mmap threshold high and the trim threshold higher keeps
the heap: the step's blocks are reused. The peak resident memory is the same (a step touches its peak anyway); memory is
returned when the process ends. The same lever as running under jemalloc/tcmalloc, with nothing to install. Off glibc it
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap (larger ones: mmap, as before)
TRIM_THRESHOLD = (1 << 31) - 1  # free memory at the heap's top is kept up to 2 GiB

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process (TRAINWISE_MALLOC=default leaves them);
    True when set. Called by the CLI, the trainer and the calibration, so that what is measured and
    what runs use the same allocator."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux") or os.environ.get("TRAINWISE_MALLOC", "").lower() == "default":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
