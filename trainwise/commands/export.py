"""`trainwise export DIR --format hf --out OUT`: a run as a Hugging Face transformers model directory."""

from __future__ import annotations

import argparse
import json

from trainwise.errors import TrainwiseError
from trainwise.export.hf import export_hf


def register(sub, help_text: str) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("export", help=help_text,
                       epilog="examples:\n  trainwise export runs/run-1 --format hf --out hf/run-1\n"
                              "  python -c \"from transformers import AutoModelForCausalLM as M; "
                              "M.from_pretrained('hf/run-1')\"",
                       formatter_class=fmt)
    p.add_argument("run_dir")
    p.add_argument("--format", default="hf", choices=["hf"], help="hf = Hugging Face transformers (default)")
    p.add_argument("--out", required=True, help="directory to create")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
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
