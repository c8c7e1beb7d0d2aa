"""`trainwise data PATH...`: what a corpus holds, before any training (trainwise.data.inspect)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainwise import rundir
from trainwise.config import DataConfig, load_config
from trainwise.data.corpus import prepare_tokenizer
from trainwise.data.inspect import inspect_data, render
from trainwise.errors import TrainwiseError
from trainwise.tokenizer import Tokenizer

EPILOG = """examples:
  trainwise data corpus/                          # a folder: any files, any encodings
  trainwise data dump.jsonl.zst --text-field meta.body --json
  trainwise data corpus/ --run runs/demo          # counted with a run's tokenizer
  trainwise data --config mix.toml                # the [data] section of a config, mixtures included
"""


def register(sub, help_text: str) -> None:
    p = sub.add_parser("data", help=help_text,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", metavar="PATH", help="files, folders or globs (none: the built-in corpus)")
    p.add_argument("--config", help="a TOML config: its [data] section (a mixture too)")
    p.add_argument("--text-field", help="field of .jsonl/.csv/Parquet/Arrow records (nested: a.b)")
    p.add_argument("--encoding", help="auto (default), utf-8, or a codec name")
    p.add_argument("--include", action="append", metavar="GLOB", help="keep only files matching (repeatable)")
    p.add_argument("--exclude", action="append", metavar="GLOB", help="leave out files matching (repeatable)")
    p.add_argument("--tokenizer", metavar="FILE", help="a tokenizer.json to count tokens with")
    p.add_argument("--run", metavar="DIR", help="count tokens with this run's tokenizer")
    p.add_argument("--vocab-size", type=int, default=4096, help="without --tokenizer/--run: train one of this size")
    p.add_argument("--top", type=int, default=10, help="how many of the most frequent tokens to list")
    p.add_argument("--json", action="store_true", help="the report as JSON (bytes in bytes)")
    p.set_defaults(func=cmd_data)


def cmd_data(args: argparse.Namespace) -> int:
    data_cfg = load_config(args.config).data if args.config else DataConfig()
    if args.paths:
        data_cfg.paths, data_cfg.sources = list(args.paths), []
    for key in ("text_field", "encoding", "include", "exclude"):
        if getattr(args, key):
            setattr(data_cfg, key, getattr(args, key))
    data_cfg.validate()
    if args.tokenizer and args.run:
        raise TrainwiseError("give --tokenizer FILE or --run DIR, not both.")
    if args.run:
        path = Path(args.run) / rundir.TOKENIZER
        if not path.is_file():
            raise TrainwiseError(f"--run {args.run}: no tokenizer.json there; pass a run directory of trainwise train.")
        tokenizer = Tokenizer.load(path)
    elif args.tokenizer:
        tokenizer = Tokenizer.load(args.tokenizer)
    else:
        tokenizer = prepare_tokenizer(data_cfg, args.vocab_size)
    report = inspect_data(data_cfg, tokenizer, top=args.top)
    print(json.dumps(report, ensure_ascii=False, indent=1) if args.json else render(report))
    return 0
