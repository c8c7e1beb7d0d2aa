"""`trainwise tokenizer train|encode|decode`: a byte-level BPE tokenizer."""

from __future__ import annotations

import argparse
import json

from trainwise.config import DataConfig
from trainwise.data.corpus import prepare_tokenizer
from trainwise.errors import TrainwiseError
from trainwise.tokenizer import Tokenizer


def register(sub, help_text: str) -> None:
    p = sub.add_parser("tokenizer", help=help_text,
                       epilog="examples:\n  trainwise tokenizer train --data corpus/ --vocab-size 8192 --out tok.json\n"
                              "  trainwise tokenizer encode --tokenizer tok.json 'hello world'\n"
                              "  trainwise tokenizer decode --tokenizer tok.json 31373 995",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    tsub = p.add_subparsers(dest="action", metavar="<action>")
    tsub.required = True
    t = tsub.add_parser("train", help="train on a corpus (default: the built-in corpus)")
    t.add_argument("--data", nargs="+", metavar="PATH")
    t.add_argument("--text-field", default="text")
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--out", default="tokenizer.json")
    t = tsub.add_parser("encode", help="text -> token ids (JSON list)")
    t.add_argument("--tokenizer", required=True)
    t.add_argument("text")
    t = tsub.add_parser("decode", help="token ids -> text")
    t.add_argument("--tokenizer", required=True)
    t.add_argument("ids", nargs="+")
    p.set_defaults(func=cmd_tokenizer)


def cmd_tokenizer(args: argparse.Namespace) -> int:
    if args.action == "train":
        tok = prepare_tokenizer(DataConfig(paths=args.data or [], text_field=args.text_field), args.vocab_size)
        tok.save(args.out)
        print(f"trained a byte-level BPE tokenizer with {tok.vocab_size} tokens -> {args.out}")
    elif args.action == "encode":
        tok = Tokenizer.load(args.tokenizer)
        print(json.dumps(tok.encode(args.text)))
    else:
        tok = Tokenizer.load(args.tokenizer)
        try:
            ids = [int(i) for i in args.ids]
        except ValueError:
            raise TrainwiseError("decode takes token ids as integers, e.g. `decode 464 3290`.") from None
        if outside := [i for i in ids if not 0 <= i < tok.vocab_size]:
            raise TrainwiseError(f"token id{'s' if len(outside) > 1 else ''} {', '.join(map(str, outside[:5]))} "
                                 f"outside {args.tokenizer}'s vocabulary: its ids run from 0 to {tok.vocab_size - 1}.")
        print(tok.decode(ids))
    return 0
