"""`trainwise hardware [--calibrate]`: the accelerator table, and this machine measured."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

import torch
import torch.distributed as dist

from trainwise.hardware.cache import busy_note
from trainwise.hardware.table import ACCELERATORS, NODES, lookup_cuda_device
from trainwise.measure.calibrate import calibrate, calibrate_link
from trainwise.runtime.distributed import exit_worker
from trainwise.units import fmt_bytes


def register(sub, help_text: str) -> None:
    h = sub.add_parser("hardware", help=help_text)
    h.add_argument("--json", action="store_true")
    h.add_argument("--calibrate", action="store_true",
                   help="measure this machine's matmul peak (fp32, bf16) and memory bandwidth, and cache it")
    h.set_defaults(func=cmd_hardware)


def cmd_hardware(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _cmd_calibrate(args)
    if args.json:
        print(json.dumps({k: {"name": a.name, "peak_flops": a.peak_flops,
                              "bandwidth_bytes_per_s": a.bandwidth_bytes_per_s,
                              "memory_bytes": a.memory_bytes, "node": a.node and asdict(NODES[a.node])}
                          for k, a in ACCELERATORS.items()}, indent=2))
        return 0
    print(f"{'key':<10} {'name':<18} {'16-bit TFLOP/s':>14} {'fp32 TFLOP/s':>12} {'GB/s':>7} {'memory':>26}  node")
    for k, a in ACCELERATORS.items():
        half = a.peak_flops.get("bf16", a.peak_flops.get("fp16"))
        fp32 = a.peak_flops.get("fp32")
        node = NODES[a.node] if a.node else None
        where = (f"{node.gpus} per node, {node.fabric}{' + bridged pairs' if node.pair_busbw else ''}" if node else
                 "one chip (no node in the table)")
        print(f"{k:<10} {a.name:<18} {_tflops(half):>14} {_tflops(fp32):>12} {a.bandwidth_bytes_per_s / 1e9:>7.0f} "
              f"{fmt_bytes(a.memory_bytes):>26}  {where}")
    print("16-bit: bf16, or fp16 where the device has no bf16 (V100); dense (no sparsity); '-': not published")
    return 0


def _tflops(flops: float | None) -> str:
    return "-" if flops is None else f"{flops / 1e12:.1f}"


def _cmd_calibrate(args) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: the collectives between the ranks
        return _cmd_calibrate_link(args)

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out = {}
    for dev in devices:
        out[dev] = calibrate(dev, refresh=True)
        if dev == "cuda":
            acc = lookup_cuda_device(torch.cuda.get_device_name())
            out[dev]["table"] = None if acc is None else {"name": acc.name, "peak_flops": acc.peak_flops,
                                                          "bandwidth_bytes_per_s": acc.bandwidth_bytes_per_s}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for dev, r in out.items():
        print(f"{r['machine']}")
        for dtype, p in r["peak_flops"].items():
            table = (r.get("table") or {}).get("peak_flops", {}).get(dtype)
            extra = f"  (table: {table / 1e12:,.1f} TFLOP/s)" if table else ""
            print(f"  {dtype:<5} matmul peak {p / 1e9:,.1f} GFLOP/s measured{extra}")
        print(f"  memory bandwidth {r['bandwidth_bytes_per_s'] / 1e9:,.2f} GB/s measured"
              + ("" if r.get("busy") else " (cached)"))
        if prof := r.get("profile"):  # what the step-time model prices operators with
            for dtype, (_, p, bw) in prof["matmul"].items():
                print(f"  {dtype:<5} large matmuls (1024-4096) t = F/P + Q/BW: P = {p / 1e9:,.1f} GFLOP/s, "
                      f"BW = {bw / 1e9:,.2f} GB/s (smaller ones: timed at their shape when a plan needs them)")
            for dtype, classes in prof["elementwise"].items():
                rates = ", ".join(f"{q / 2**20:.3g} MiB {r / 1e9:,.1f}" for q, r in classes["elementwise/other"])
                print(f"  {dtype:<5} element-wise x*y, bytes per call: GB/s: {rates}")
            att = prof["attention"].get("bf16", {})
            if att:
                print(f"  bf16  attention kernel: forward {att['forward'][1] / 1e9:,.1f}, backward "
                      f"{att['backward'][1] / 1e9:,.1f} GFLOP/s")
            print(f"  optimizer step {prof['optimizer'][0] * 1e6:,.1f} us per tensor + "
                  f"{prof['optimizer'][1] * 1e9:,.2f} ns per parameter; "
                  f"eager overhead {prof['overhead'][0] * 1e3:,.2f} ms per step + "
                  f"{prof['overhead'][1] * 1e6:,.1f} us per op; kernels in a real step "
                  + (", ".join(f"x{x:.3g} ({prec})" for prec, x in prof["in_step_by"].items()) if prof.get("in_step_by")
                     else f"x{prof.get('in_step', 1.0):.3g}") + " their time alone")
            if "calibration_s" in r:
                print(f"  calibration took {r['calibration_s']:.1f} s")
        if note := busy_note(r):
            print(f"  warning: {note}")
    return 0


def _cmd_calibrate_link(args) -> int:
    """`torchrun --nproc_per_node N -m trainwise hardware --calibrate`: latency and bandwidth of the
    collectives (gloo on CPU, NCCL on GPUs), cached for the step-time model's communication terms."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        r = calibrate_link()
    finally:
        dist.destroy_process_group()
    if r["rank"] == 0:
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"{r['backend']} collectives over {r['world']} ranks: latency {r['link'][0] * 1e6:,.1f} us per hop, "
                  f"bandwidth {r['link'][1] / 1e9:,.2f} GB/s (ring model, cached for `trainwise plan`)")
            for strategy, fit in r.get("strategies", {}).items():
                print(f"  {strategy} as its training steps run them: {fit['link'][0] * 1e6:,.1f} us per hop, "
                      f"{fit['link'][1] / 1e9:,.3g} GB/s")
    exit_worker(0)
