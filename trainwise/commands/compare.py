"""`trainwise compare RUN RUN...`: runs side by side, a terminal table and one HTML page
(trainwise.report.compare)."""

from __future__ import annotations

import argparse
import json

from trainwise.report.compare import differing_keys, format_table, write_compare


def register(sub, help_text: str) -> None:
    p = sub.add_parser(
        "compare", help=help_text,
        epilog="examples:\n  trainwise compare runs/fp32 runs/bf16\n"
               "  trainwise compare runs/dense runs/moe runs/moe-ckpt --out moe.html --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN", help="two or more run directories")
    p.add_argument("--out", default="compare.html", help="the HTML page to write (default compare.html)")
    p.add_argument("--json", action="store_true", help="print each run's numbers and the differing keys as JSON")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    path, runs = write_compare(args.run_dirs, args.out)
    if args.json:
        print(json.dumps({"page": str(path), "runs": [r.summary() for r in runs],
                          "config_differs": {k: [r.config.get(k) for r in runs] for k in differing_keys(runs)}}))
    else:
        print(format_table(runs))
        print(f"\ncompare page written to {path} ({path.stat().st_size / 1e6:.2f} MB); open it in a browser")
    return 0
