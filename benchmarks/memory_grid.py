"""Planned vs measured peak memory of one real CPU training step over 72 cells:
K (grad accumulation) {1, 4} x checkpointing {none, selective, full} x {fp32, bf16, fp16} x compile
{off, on} x {dense, MoE}. Measured with trainwise.measure.memtrack.StepPeakMeter (the bytes resident
before the step + the CPU allocator's running total in torch.profiler: it sees compiled code too), on
the step trainwise runs (trainwise.runtime.step: autocast, loss / K, clip, AdamW; fp16 with a
GradScaler). Planned: trainwise.cost.memory via planner.plan.plan_run. error = measured / planned - 1.

fp16 runs here on the CPU (autocast float16 + GradScaler("cpu")) although `trainwise train` refuses
fp16 on a CPU (emulated, slow): the bytes are those of a CUDA fp16 run, which is what the cells check.

    python benchmarks/memory_grid.py [--compile off|on|both] [--arch dense|moe|both] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainwise.config import ModelConfig, TrainConfig  # noqa: E402
from trainwise.hardware.cache import cpu_model  # noqa: E402
from trainwise.measure.memtrack import StepPeakMeter  # noqa: E402
from trainwise.cost.layout import Layout  # noqa: E402
from trainwise.cost.memory import get_recipe  # noqa: E402
from trainwise.cost.run import Machine, Run  # noqa: E402
from trainwise.planner.plan import plan_run  # noqa: E402
from trainwise.runtime.step import build_model, build_step, random_batches  # noqa: E402

CPU = torch.device("cpu")
SEQ, MICRO_BATCH = 64, 4
ARCHS = {
    "dense": dict(vocab_size=2048, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ),
    "moe": dict(vocab_size=2048, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ,
                n_experts=4, top_k=2, expert_ffn_hidden=128),
}



def build(arch: str, checkpointing: str, compiled: bool, precision: str):
    torch.manual_seed(0)
    cfg = ModelConfig(**ARCHS[arch])
    step = build_step(build_model(cfg), TrainConfig(activation_checkpointing=checkpointing), CPU, precision,
                      compile=compiled)
    return cfg, step


def cell(cfg, step, precision: str, checkpointing: str, k: int, compiled: bool) -> dict:
    batches = random_batches(cfg.vocab_size, MICRO_BATCH, SEQ, k, CPU)
    step(batches)  # states exist; compiled graphs built
    meter = StepPeakMeter(CPU)
    meter.start()
    step(batches, hook=lambda phase: meter.resident(p.grad for p in step.params) if phase == "backward" else None)
    measured = meter.stop()
    recipe = get_recipe("fp32" if precision == "fp32" else "amp")
    plan = plan_run(Run(cfg, micro_batch=MICRO_BATCH, seq_len=SEQ, grad_accum=k, recipe=recipe,
                        checkpointing=checkpointing, compiled=compiled, layout=Layout(micro_batches=k), tokens=1,
                        machine=Machine(peak_flops=1e12)))
    return {"planned": plan.peak_bytes, "measured": measured, "error": measured / plan.peak_bytes - 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", choices=("off", "on", "both"), default="both")
    ap.add_argument("--arch", choices=("dense", "moe", "both"), default="both")
    ap.add_argument("--json", help="also write the cells to this JSON file")
    args = ap.parse_args()
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; B={MICRO_BATCH}, T={SEQ}; bytes in MiB (2^20)")
    print(f"{'arch':<6}{'compile':<8}{'prec':<6}{'ckpt':<10}{'K':>2}{'planned':>11}{'measured':>11}{'error':>9}"
          f"{'s':>7}")
    rows, pruned = [], []
    archs = list(ARCHS) if args.arch == "both" else [args.arch]
    for arch, compiled, precision, checkpointing in itertools.product(archs, compiles, ("fp32", "bf16", "fp16"),
                                                                      ("none", "selective", "full")):
        cfg, step = build(arch, checkpointing, compiled, precision)
        for k in (1, 4):
            start = time.perf_counter()
            try:
                r = cell(cfg, step, precision, checkpointing, k, compiled)
            except Exception as e:  # a combination torch cannot run: pruned, with the reason
                lines = [ln for ln in str(e).splitlines() if "Error" in ln] or str(e).splitlines() or [""]
                reason = lines[0].strip()[:160]
                print(f"{arch:<6}{'on' if compiled else 'off':<8}{precision:<6}{checkpointing:<10}{k:>2}  pruned: "
                      f"{type(e).__name__}: {reason}", flush=True)
                pruned.append(dict(arch=arch, compile=compiled, precision=precision, checkpointing=checkpointing,
                                   k=k, reason=reason))
                continue
            r.update(arch=arch, compile=compiled, precision=precision, checkpointing=checkpointing, k=k)
            rows.append(r)
            print(f"{arch:<6}{'on' if compiled else 'off':<8}{precision:<6}{checkpointing:<10}{k:>2}"
                  f"{r['planned'] / 2**20:>11.3f}{r['measured'] / 2**20:>11.3f}{r['error']:>+9.2%}"
                  f"{time.perf_counter() - start:>7.1f}", flush=True)
        torch._dynamo.reset()
    errors = [abs(r["error"]) for r in rows]
    print(f"{len(rows)} cells: median |error| {statistics.median(errors):.2%}, max |error| {max(errors):.2%}, "
          f"within 10%: {sum(e <= 0.10 for e in errors)}/{len(rows)}; pruned: {len(pruned)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cells": rows, "pruned": pruned}, indent=1))


if __name__ == "__main__":
    main()
