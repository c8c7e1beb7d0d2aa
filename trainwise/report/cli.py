"""`trainwise report DIR` and `trainwise export DIR --format hf --out OUT`."""

from __future__ import annotations

import argparse
import json

from trainwise.errors import TrainwiseError


def cmd_report(args: argparse.Namespace) -> int:
    from trainwise.report.html import write_report

    path = write_report(args.run_dir, out=args.out)
    if args.json:
        print(json.dumps({"report": str(path), "bytes": path.stat().st_size}))
    else:
        print(f"report written to {path} ({path.stat().st_size / 1e6:.2f} MB); open it in a browser")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from trainwise.export.hf import export_hf

    if args.format != "hf":
        raise TrainwiseError(f"--format {args.format} is not supported; use --format hf.")
    summary = export_hf(args.run_dir, args.out)
    if args.json:
        print(json.dumps(summary))
        return 0
    rows = [("architecture", summary["architecture"]), ("model_type", summary["model_type"]),
            ("parameters", f"{summary['params']:,}"), ("directory", summary["out"]),
            ("files", ", ".join(summary["files"]))]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(f"load it with: AutoModelForCausalLM.from_pretrained({summary['out']!r})")
    return 0


def register(sub) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("report", help="write DIR/report.html: loss, LR, throughput, plan vs measured, memory, roofline",
                       epilog="examples:\n  trainwise report runs/run-1\n  trainwise report runs/run-1 --out /tmp/r.html",
                       formatter_class=fmt)
    p.add_argument("run_dir")
    p.add_argument("--out", help="where to write the HTML (default DIR/report.html)")
    p.add_argument("--json", action="store_true", help="print the path and size as JSON")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("export", help="export a run as a Hugging Face transformers model directory",
                       epilog="examples:\n  trainwise export runs/run-1 --format hf --out hf/run-1\n"
                              "  python -c \"from transformers import AutoModelForCausalLM as M; "
                              "M.from_pretrained('hf/run-1')\"",
                       formatter_class=fmt)
    p.add_argument("run_dir")
    p.add_argument("--format", default="hf", choices=["hf"], help="hf = Hugging Face transformers (default)")
    p.add_argument("--out", required=True, help="directory to create")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_export)
