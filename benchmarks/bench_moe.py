"""MoE training-step time against a dense model of equal *active* parameters, side by side.

    python benchmarks/bench_moe.py [--micro-batch 16] [--seq-len 256] [--reps 5] [--dispatch all]

Models: trainwise-moe-small (8 experts of width 352, top-2) and trainwise-small (one MLP of width 704,
the same active parameters bar the 8H router per layer). A step is the trainer's own (trainwise.runtime
.step: forward + backward + clip + fused AdamW update) on one micro-batch. The models are timed in this
process one after the other (medians), in fp32 and under bf16 autocast. Every step gets new token ids, as
training does, so an MoE layer routes anew at each step.
--dispatch compares torch._grouped_mm with its groups padded where the model pads them (a CPU in 16 bits:
trainwise.model.moe.GROUP_SIZES), torch._grouped_mm with the groups as routed, and the loop over experts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainwise.config import TrainConfig
from trainwise.cost.params import params
from trainwise.hardware.cache import cpu_model
from trainwise.model import Transformer
from trainwise.model.moe import MoE
from trainwise.presets import get_preset
from trainwise.runtime.step import build_model, build_step

CPU = torch.device("cpu")
WARMUP = 8  # untimed steps per model: a padded MoE meets most of its group sizes in its first steps


def make_step(model: Transformer, batch: torch.Tensor, precision: str):
    """A timed step on batch's shape, with new token ids at each call (the same sequence for every model)."""
    train_step = build_step(model, TrainConfig(), CPU, precision)
    seeds = iter(range(1 << 30))

    def step() -> float:
        ids = torch.randint(0, int(batch.max()) + 1, batch.shape, generator=torch.Generator().manual_seed(next(seeds)))
        start = time.perf_counter()
        train_step([(ids[:, :-1], ids[:, 1:])])
        return time.perf_counter() - start

    return step


DISPATCH = {"grouped": (None, True), "grouped-routed": (None, False), "loop": (False, False)}


def set_dispatch(model: Transformer, dispatch: str) -> None:
    for m in model.modules():
        if isinstance(m, MoE):
            m.grouped_mm, m.pad_groups = DISPATCH[dispatch]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    ap.add_argument("--dispatch", choices=[*DISPATCH, "all"], default="all",
                    help="grouped: padded where the model pads; grouped-routed: the groups as routed; loop")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0 = torch's default); 1 is steadier on a CPU shared with others")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dense_cfg, moe_cfg = get_preset("trainwise-small"), get_preset("trainwise-moe-small")
    dense_n, moe_n = params(dense_cfg), params(moe_cfg)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"micro_batch {args.micro_batch} x seq_len {args.seq_len}, {args.reps} repetitions per model (median)")
    print(f"dense {dense_cfg.name}: {dense_n.total:,} params; moe {moe_cfg.name}: {moe_n.active:,} active "
          f"of {moe_n.total:,} ({moe_cfg.n_experts} experts x {moe_cfg.expert_ffn_hidden}, top-{moe_cfg.top_k})")
    torch.manual_seed(0)
    batch = torch.randint(0, dense_cfg.vocab_size, (args.micro_batch, args.seq_len + 1))
    dispatches = list(DISPATCH) if args.dispatch == "all" else [args.dispatch]
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    for precision in precisions:
        torch.manual_seed(0)
        runs = {"dense": make_step(build_model(dense_cfg), batch, precision)}
        for dispatch in dispatches:
            torch.manual_seed(0)
            moe = build_model(moe_cfg)
            set_dispatch(moe, dispatch)
            runs[f"moe {dispatch}"] = make_step(moe, batch, precision)
        times: dict[str, list[float]] = {name: [] for name in runs}
        # One model after the other, not interleaved: in 16 bits a CPU's matmuls keep kernels per shape in
        # one cache (oneDNN's, 1024 kernels) that the models share, and interleaved with the others the
        # padded MoE step read 1.10 s against 0.63 s alone (AMX Xeon, 2026-12-02)
        for name, step in runs.items():
            for _ in range(WARMUP):  # allocator, AdamW state, the padded group sizes' kernels
                step()
            times[name] = [step() for _ in range(args.reps)]
        dense_s = statistics.median(times["dense"])
        for name, ts in times.items():
            median = statistics.median(ts)
            print(f"{precision:5s} {name:16s} step {median * 1e3:8.1f} ms  (min {min(ts) * 1e3:7.1f}, max "
                  f"{max(ts) * 1e3:7.1f})  ratio to dense {median / dense_s:5.2f}x")


if __name__ == "__main__":
    main()
