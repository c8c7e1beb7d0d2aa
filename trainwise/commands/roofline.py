"""`trainwise roofline`: every operator of one training step on the roofline; `--measure` profiles a real
CPU step beside the bounds (trainwise.measure.roofline)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from trainwise.commands.args import plot_file
from trainwise.config import CHECKPOINTING
from trainwise.errors import TrainwiseError
from trainwise.hardware.table import get_accelerator
from trainwise.planner.machine import resolve_hardware
from trainwise.planner.plan import check_numbers
from trainwise.planner.spec import load_model
from trainwise.runtime.precision import resolve_precision
from trainwise.measure.roofline import (
    check_measurable,
    measure_ops,
    measured_json,
    measured_table,
    plot_roofline,
    predicted_by_name,
    roofline_ops,
    roofline_table,
)


def register(sub, help_text: str) -> None:
    r = sub.add_parser("roofline", help=help_text,
                       epilog="examples:\n  trainwise roofline --model trainwise-small --plot roof.png\n"
                              "  trainwise roofline --model llama-3-8b --gpu h100 --seq-len 2048\n"
                              "  trainwise roofline --model trainwise-small --measure --plot roof.png",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--model", default="trainwise-small", help="preset, trainwise TOML or config.json")
    r.add_argument("--gpu", help="accelerator from `trainwise hardware` (default: this CPU, calibrated)")
    r.add_argument("--precision", choices=["fp32", "bf16"],
                   help="default: what the trainer picks there (bf16 on a GPU or a CPU with native bf16)")
    r.add_argument("--seq-len", type=int, help="default: 2048 or the model's shorter context")
    r.add_argument("--micro-batch", type=int, default=1)
    r.add_argument("--checkpointing", choices=list(CHECKPOINTING), default="none")
    r.add_argument("--measure", action="store_true",
                   help="also profile one real training step on this CPU (torch.profiler) and put each "
                        "operator's achieved FLOP/s beside its bound (models up to 200M parameters)")
    r.add_argument("--plot", type=plot_file, metavar="FILE.png")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_roofline)


def cmd_roofline(args: argparse.Namespace) -> int:
    model, _ = load_model(args.model)
    check_numbers(("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch))
    if args.measure and args.gpu:
        raise TrainwiseError("--measure profiles a step on this CPU; it cannot be combined with --gpu.")
    if args.precision is None:  # the trainer's choice on that device (train.precision = auto)
        if args.gpu:
            args.precision = "bf16" if {"bf16", "fp16"} & set(get_accelerator(args.gpu).peak_flops) else "fp32"
        else:
            args.precision = resolve_precision("auto", torch.device("cpu"))[0]
    hardware = resolve_hardware(args.gpu or "cpu", None, None, None, args.precision)
    peak, bw, hw = hardware.peak_flops, hardware.bandwidth_bytes_per_s, hardware.name
    seq = args.seq_len or min(model.max_seq_len, 2048)
    model = replace(model, max_seq_len=max(seq, model.max_seq_len))  # as `plan` takes a longer --seq-len
    if args.measure:
        check_measurable(model, args.micro_batch, seq, [], peak, bw)  # size first: before the fake step
    points = roofline_ops(model, args.micro_batch, seq, args.precision, args.checkpointing, cuda=bool(args.gpu))
    measured = None
    if args.measure:
        check_measurable(model, args.micro_batch, seq, points, peak, bw)
        measured = measure_ops(model, args.micro_batch, seq, points, args.precision, args.checkpointing)
        if hardware.profile is not None:
            predicted = predicted_by_name(model, args.micro_batch, seq, args.precision, args.checkpointing,
                                          hardware.profile)
            for m in measured:
                m.predicted_s = predicted.get(m.point.name)
    if args.json:
        out = {"hardware": hw, "peak_flops": peak, "bandwidth_bytes_per_s": bw, "ridge": peak / bw,
               "ops": [{"op": p.name, "class": p.cls, "calls": p.calls, "flops": p.flops,
                        "bytes": p.bytes, "intensity": p.intensity(),
                        "bound": "compute" if p.intensity() >= peak / bw else "memory",
                        "min_time_s": p.bound_s(peak, bw)} for p in points]}
        if measured is not None:
            out["measured"] = measured_json(measured, peak, bw)
        print(json.dumps(out, indent=1))
    else:
        print(f"{model.name}, B={args.micro_batch}, T={seq}, {args.precision}, on {hw}")
        print(roofline_table(points, peak, bw))
        if measured is not None:
            print(measured_table(measured, peak, bw))
    if args.plot:
        what = "measured vs bound" if measured is not None else "training step"
        plot_roofline(points, peak, bw, args.plot, f"{model.name} (B={args.micro_batch}, T={seq}) {what} on {hw}",
                      measured=measured)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
