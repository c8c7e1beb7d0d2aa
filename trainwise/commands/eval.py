"""`trainwise eval RUN --data PATH...`: loss, perplexity and bits per byte of a trained run on any text
(trainwise.evaluate)."""

from __future__ import annotations

import argparse
import json

from trainwise.evaluate import evaluate_run, explain_result, format_result


def register(sub, help_text: str) -> None:
    p = sub.add_parser(
        "eval", help=help_text,
        epilog="examples:\n  trainwise eval runs/run-1 --data held_out.txt\n"
               "  trainwise eval runs/run-1 --data 'books/**/*.txt' notes.jsonl --json\n\n"
               "bits per byte (summed nats / ln 2 / UTF-8 bytes) compare runs with different tokenizers;\n"
               "loss in nats/token does not.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN", help="a run directory (its latest checkpoint is evaluated)")
    p.add_argument("--data", nargs="+", metavar="PATH", required=True,
                   help="text files, directories or globs (.txt .md .jsonl .parquet), as for train")
    p.add_argument("--text-field", default="text", help="the field of .jsonl/.parquet records that holds the text")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto = the run's train.precision")
    p.add_argument("--json", action="store_true",
                   help="print the numbers as JSON: loss, perplexity, bpb, nats, tokens, bytes, ...")
    p.add_argument("--explain", action="store_true", help="show the formulas with the numbers substituted")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    result = evaluate_run(args.run_dir, args.data, text_field=args.text_field, device=args.device,
                          precision=args.precision, quiet=args.json)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(explain_result(result) if args.explain else format_result(result))
    return 0
