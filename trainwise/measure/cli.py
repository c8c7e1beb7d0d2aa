"""`trainwise verify` and `trainwise roofline`: a thin layer over trainwise.measure."""

from __future__ import annotations

import argparse
import json

from torch import device as torch_device


def register(subparsers: argparse._SubParsersAction) -> None:
    v = subparsers.add_parser("verify", help="recompute and print a run's predicted-vs-measured table",
                              epilog="example:\n  trainwise verify runs/run-1",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("run_dir")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_verify)

    r = subparsers.add_parser("roofline", help="every operator of one training step on the roofline",
                              epilog="examples:\n  trainwise roofline --model trainwise-small --plot roof.png\n"
                                     "  trainwise roofline --model llama-3-8b --gpu h100 --seq-len 2048\n"
                                     "  trainwise roofline --model trainwise-small --measure --plot roof.png",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--model", default="trainwise-small", help="preset, trainwise TOML or config.json")
    r.add_argument("--gpu", help="accelerator from `trainwise hardware` (default: this CPU, calibrated)")
    r.add_argument("--precision", choices=["fp32", "bf16"],
                   help="default: what the trainer picks there (bf16 on a GPU or a CPU with native bf16)")
    r.add_argument("--seq-len", type=int)
    r.add_argument("--micro-batch", type=int, default=1)
    r.add_argument("--checkpointing", choices=["none", "selective", "full"], default="none")
    r.add_argument("--measure", action="store_true",
                   help="also profile one real training step on this CPU (torch.profiler) and put each "
                        "operator's achieved FLOP/s beside its bound (models up to 200M parameters)")
    r.add_argument("--plot", metavar="FILE.png")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_roofline)


def cmd_verify(args: argparse.Namespace) -> int:
    from trainwise.measure.verify import format_table, verify_run

    result = verify_run(args.run_dir)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(format_table(result))
    if "per_rank" in result:
        from trainwise.train.distributed import format_per_rank

        print(format_per_rank(result["per_rank"]))
    return 0


def cmd_roofline(args: argparse.Namespace) -> int:
    from trainwise.cost.cli import load_model
    from trainwise.measure.roofline import plot_roofline, roofline_ops, roofline_table

    model, _ = load_model(args.model)
    if args.measure and args.gpu:
        from trainwise.errors import TrainwiseError

        raise TrainwiseError("--measure profiles a step on this CPU; it cannot be combined with --gpu.")
    from trainwise.cost.plan import resolve_hardware

    if args.precision is None:  # the trainer's choice on that device (train.precision = auto)
        if args.gpu:
            from trainwise.cost.hardware import get_accelerator

            args.precision = "bf16" if {"bf16", "fp16"} & set(get_accelerator(args.gpu).peak_flops) else "fp32"
        else:
            from trainwise.train.precision import resolve_precision

            args.precision = resolve_precision("auto", torch_device("cpu"))[0]
    hardware = resolve_hardware(args.gpu or "cpu", None, None, None, args.precision)
    peak, bw, hw = hardware.peak_flops, hardware.bandwidth_bytes_per_s, hardware.name
    seq = args.seq_len or min(model.max_seq_len, 2048)
    if args.measure:
        from trainwise.measure.roofline import check_measurable

        check_measurable(model, args.micro_batch, seq, [], peak, bw)  # size first: before the fake step
    points = roofline_ops(model, args.micro_batch, seq, args.precision, args.checkpointing, cuda=bool(args.gpu))
    measured = None
    if args.measure:
        from trainwise.measure.roofline import measure_ops

        check_measurable(model, args.micro_batch, seq, points, peak, bw)
        measured = measure_ops(model, args.micro_batch, seq, points, args.precision, args.checkpointing)
        if hardware.profile is not None:
            from trainwise.measure.roofline import predicted_by_name

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
            from trainwise.measure.roofline import measured_json

            out["measured"] = measured_json(measured, peak, bw)
        print(json.dumps(out, indent=1))
    else:
        print(f"{model.name}, B={args.micro_batch}, T={seq}, {args.precision}, on {hw}")
        print(roofline_table(points, peak, bw))
        if measured is not None:
            from trainwise.measure.roofline import measured_table

            print(measured_table(measured, peak, bw))
    if args.plot:
        what = "measured vs bound" if measured is not None else "training step"
        plot_roofline(points, peak, bw, args.plot, f"{model.name} (B={args.micro_batch}, T={seq}) {what} on {hw}",
                      measured=measured)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
