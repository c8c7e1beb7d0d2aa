"""`trainwise report DIR`: DIR/report.html, one self-contained page about a run (trainwise.report.html)."""

from __future__ import annotations

import argparse
import json

from trainwise.report.html import write_report


def cmd_report(args: argparse.Namespace) -> int:
    path = write_report(args.run_dir, out=args.out)
    if args.json:
        print(json.dumps({"report": str(path), "bytes": path.stat().st_size}))
    else:
        print(f"report written to {path} ({path.stat().st_size / 1e6:.2f} MB); open it in a browser")
    return 0


def register(sub, help_text: str) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("report", help=help_text,
                       epilog="examples:\n  trainwise report runs/run-1\n"
                              "  trainwise report runs/run-1 --out /tmp/r.html",
                       formatter_class=fmt)
    p.add_argument("run_dir")
    p.add_argument("--out", help="where to write the HTML (default DIR/report.html)")
    p.add_argument("--json", action="store_true", help="print the path and size as JSON")
    p.set_defaults(func=cmd_report)
