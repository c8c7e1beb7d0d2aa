"""Planner vs tracked memory over 3 model sizes x {fp32, bf16 autocast} x {no, full checkpointing} x
micro-batch {1, 4} on real CPU steps. Prints the table (bytes as MiB; error = measured / predicted - 1).

    python benchmarks/memory_grid.py
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_memtrack import SIZES, measure  # noqa: E402


def main() -> None:
    print(f"{'size':<4} {'prec':<5} {'ckpt':<5} {'B':>2} {'params':>8} {'grads':>8} {'optim':>8} "
          f"{'peak pred MiB':>14} {'peak meas MiB':>14} {'peak err':>9}")
    for size, prec, ckpt, b in itertools.product(SIZES, ("fp32", "bf16"), ("none", "full"), (1, 4)):
        plan, t = measure(size, prec, ckpt, b)
        s = plan.states
        print(f"{size:<4} {prec:<5} {ckpt:<5} {b:>2} {t.params / s.params - 1:>+8.2%} {t.grads / s.grads - 1:>+8.2%} "
              f"{t.optimizer / s.optimizer - 1:>+8.2%} {plan.peak_bytes / 2**20:>14.3f} "
              f"{t.peak_bytes / 2**20:>14.3f} {t.peak_bytes / plan.peak_bytes - 1:>+9.2%}")


if __name__ == "__main__":
    main()
