"""MoE training-step time against a dense model of equal *active* parameters, side by side.

    python benchmarks/bench_moe.py [--micro-batch 16] [--seq-len 256] [--reps 5] [--dispatch both]

Models: trainwise-moe-small (8 experts of width 352, top-2) and trainwise-small (one MLP of width 704,
the same active parameters bar the 8H router per layer). A step is the trainer's own (trainwise.runtime
.step: forward + backward + clip + fused AdamW update) on one micro-batch. Both models are timed in this process with interleaved repetitions (dense, moe, dense,
moe, ...) so that load from other processes hits both alike; medians are reported, in fp32 and under
bf16 autocast. --dispatch compares torch._grouped_mm with the loop over experts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainwise.config import TrainConfig
from trainwise.cost.params import params
from trainwise.model import Transformer
from trainwise.model.moe import MoE
from trainwise.presets import get_preset
from trainwise.runtime.step import build_model, build_step

CPU = torch.device("cpu")


def make_step(model: Transformer, batch: torch.Tensor, precision: str):
    train_step = build_step(model, TrainConfig(), CPU, precision)
    batches = [(batch[:, :-1], batch[:, 1:])]

    def step() -> float:
        start = time.perf_counter()
        train_step(batches)
        return time.perf_counter() - start

    return step


def set_dispatch(model: Transformer, grouped_mm: bool | None) -> None:
    for m in model.modules():
        if isinstance(m, MoE):
            m.grouped_mm = grouped_mm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    ap.add_argument("--dispatch", choices=["grouped", "loop", "both"], default="both")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0 = torch's default); 1 is steadier on a CPU shared with others")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dense_cfg, moe_cfg = get_preset("trainwise-small"), get_preset("trainwise-moe-small")
    dense_n, moe_n = params(dense_cfg), params(moe_cfg)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, micro_batch {args.micro_batch} x "
          f"seq_len {args.seq_len}, {args.reps} interleaved repetitions (median)")
    print(f"dense {dense_cfg.name}: {dense_n.total:,} params; moe {moe_cfg.name}: {moe_n.active:,} active "
          f"of {moe_n.total:,} ({moe_cfg.n_experts} experts x {moe_cfg.expert_ffn_hidden}, top-{moe_cfg.top_k})")
    torch.manual_seed(0)
    batch = torch.randint(0, dense_cfg.vocab_size, (args.micro_batch, args.seq_len + 1))
    dispatches = {"grouped": [None], "loop": [False], "both": [None, False]}[args.dispatch]
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    for precision in precisions:
        torch.manual_seed(0)
        runs = {"dense": make_step(build_model(dense_cfg), batch, precision)}
        for grouped_mm in dispatches:
            moe = build_model(moe_cfg)
            set_dispatch(moe, grouped_mm)
            runs["moe " + ("grouped_mm" if grouped_mm is None else "loop")] = make_step(moe, batch, precision)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for name, step in runs.items():  # warm-up: allocator, AdamW state, one-time kernel setup
            step()
        for _ in range(args.reps):
            for name, step in runs.items():
                times[name].append(step())
        dense_s = statistics.median(times["dense"])
        for name, ts in times.items():
            median = statistics.median(ts)
            ratios = [t / d for t, d in zip(ts, times["dense"])]  # per interleaved repetition
            print(f"{precision:5s} {name:16s} step {median * 1e3:8.1f} ms  (min {min(ts) * 1e3:7.1f}, max "
                  f"{max(ts) * 1e3:7.1f})  ratio to dense {median / dense_s:5.2f}x  (per-rep ratio "
                  f"min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
