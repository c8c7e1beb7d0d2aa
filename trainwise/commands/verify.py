"""`trainwise verify DIR`: a run's predicted-vs-measured table, recomputed (trainwise.verify)."""

from __future__ import annotations

import argparse
import json

from trainwise.verify.per_rank import format_per_rank
from trainwise.verify.verify import format_table, verify_run


def register(sub, help_text: str) -> None:
    v = sub.add_parser("verify", help=help_text, epilog="example:\n  trainwise verify runs/run-1",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("run_dir")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    result = verify_run(args.run_dir)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(format_table(result))
    if "per_rank" in result:
        print(format_per_rank(result["per_rank"]))
    return 0
