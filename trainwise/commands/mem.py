"""`trainwise mem --shape 8,1024,4096 --dtype bf16`: the bytes of one tensor, in bytes, MB and MiB."""

from __future__ import annotations

import argparse
import json
import math

from trainwise.cost.memory import tensor_bytes
from trainwise.errors import TrainwiseError


def register(sub, help_text: str) -> None:
    m = sub.add_parser("mem", help=help_text,
                       epilog="example:\n  trainwise mem --shape 8,1024,4096 --dtype bf16",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--shape", required=True, help="comma-separated sizes, e.g. 8,1024,4096")
    m.add_argument("--dtype", default="fp32")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_mem)


def cmd_mem(args: argparse.Namespace) -> int:
    try:
        sizes = [float(s) for s in args.shape.split(",")]
    except ValueError:
        sizes = []
    if not sizes or not all(math.isfinite(n) and n >= 1 and n == int(n) for n in sizes):
        raise TrainwiseError(f"--shape '{args.shape}' must be comma-separated whole numbers of at least 1, e.g. "
                             "8,1024,4096.")
    shape = [int(n) for n in sizes]
    t = tensor_bytes(shape, args.dtype)
    if args.json:
        print(json.dumps({"shape": list(t.shape), "dtype": t.dtype, "bytes": t.bytes, "MB": t.mb, "MiB": t.mib}))
    else:
        print(f"shape {tuple(t.shape)} {t.dtype}: {t.bytes:,} bytes = {t.mb:,.1f} MB = {t.mib:,.2f} MiB")
    return 0


