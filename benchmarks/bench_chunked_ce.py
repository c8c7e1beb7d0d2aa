"""Peak memory, loss and step time of the plain against the chunked cross-entropy, side by side.

    python benchmarks/bench_chunked_ce.py [--vocab 32768] [--seq-len 1024] [--micro-batch 2]
        [--chunk 256] [--precision both] [--reps 3] [--device cpu]

The same model (d_model 256, 2 layers, tied embeddings) twice, built from one seed: once with
model.loss_chunk_tokens = 0 (F.cross_entropy on the whole fp32 B x T x V logits) and once with
--chunk (trainwise.model.loss). One training step (forward + backward + clip + AdamW step, the
trainer's own step, trainwise.runtime.step) of each on the same batch, after one warm-up step so the optimizer states
exist. Peak memory is MemTracker's (trainwise.measure.memtrack: every tensor storage, CPU or CUDA),
beside the planner's prediction (plan_run(Run(...)).peak_bytes); the loss difference is that of the first
step; step times are medians of --reps interleaved untracked steps (plain, chunked, plain, ...).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainwise.config import ModelConfig, TrainConfig
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import Machine, Run
from trainwise.measure.memtrack import track_train_step
from trainwise.planner.plan import plan_run
from trainwise.runtime.step import build_model, build_step, random_batches

MIB = 2**20


def build(args, chunk: int, device: torch.device, precision: str):
    cfg = ModelConfig(vocab_size=args.vocab, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=args.seq_len, loss_chunk_tokens=chunk)
    torch.manual_seed(0)
    return cfg, build_step(build_model(cfg, device), TrainConfig(), device, precision)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(args, precision: str, device: torch.device) -> dict:
    batches = random_batches(args.vocab, args.micro_batch, args.seq_len, 1, device)
    runs = {}
    for name, chunk in (("plain", 0), ("chunked", args.chunk)):
        cfg, step = build(args, chunk, device, precision)
        first = step(batches).loss.item()  # fp32 master weights: same start
        tracked = track_train_step(step, batches)
        recipe = get_recipe("fp32" if precision == "fp32" else "amp")
        plan = plan_run(Run(cfg, micro_batch=args.micro_batch, seq_len=args.seq_len, recipe=recipe, tokens=1,
                            machine=Machine(peak_flops=1e12)))
        runs[name] = dict(step=step, loss=first, peak=tracked.peak_bytes, plan=plan.peak_bytes,
                          cuda=tracked.cuda_max_allocated_bytes, times=[])
    for _ in range(args.reps):
        for run in runs.values():
            sync(device)
            start = time.perf_counter()
            run["step"](batches)
            sync(device)
            run["times"].append(time.perf_counter() - start)
    plain, chunked = runs["plain"], runs["chunked"]
    print(f"\n{precision}: V={args.vocab} T={args.seq_len} B={args.micro_batch} chunk={args.chunk} on {device}")
    print(f"  {'':8} {'peak MiB':>10} {'planned MiB':>12} {'step s':>8} {'loss':>12}"
          + ("  cuda max_allocated MiB" if device.type == "cuda" else ""))
    for name, run in runs.items():
        cuda = f"  {run['cuda'] / MIB:22.1f}" if run["cuda"] is not None else ""
        print(f"  {name:8} {run['peak'] / MIB:10.1f} {run['plan'] / MIB:12.1f} "
              f"{statistics.median(run['times']):8.3f} {run['loss']:12.7f}{cuda}")
    saving = 1 - chunked["peak"] / plain["peak"]
    print(f"  peak: chunked / plain = {chunked['peak'] / plain['peak']:.3f} ({saving:.1%} lower); "
          f"|loss difference| = {abs(chunked['loss'] - plain['loss']):.2e}; "
          f"step time chunked / plain = {statistics.median(chunked['times']) / statistics.median(plain['times']):.2f}")
    return dict(precision=precision, saving=saving, loss_diff=abs(chunked["loss"] - plain["loss"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=256, help="model.loss_chunk_tokens of the chunked run")
    ap.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    ap.add_argument("--reps", type=int, default=3, help="timed steps of each, interleaved")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    results = [compare(args, p, device) for p in (["fp32", "bf16"] if args.precision == "both" else [args.precision])]
    for r in results:
        bar = "met" if r["saving"] >= 0.30 and (r["precision"] != "fp32" or r["loss_diff"] <= 1e-5) else "NOT met"
        print(f"bar ({r['precision']}: peak >= 30% lower{', loss to 1e-5' if r['precision'] == 'fp32' else ''}): {bar}")


if __name__ == "__main__":
    main()
