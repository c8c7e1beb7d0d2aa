"""`trainwise explain [TOPIC] [--lang zh] [--json]`: LLM-training concepts as worked computations
(trainwise.explain)."""

from __future__ import annotations

import argparse
import json

from trainwise.errors import TrainwiseError
from trainwise.explain import LANGS, LISTING, listing, run_topic, topics


def _common(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("--lang", choices=LANGS, default=default, help="en (default) or zh (中文)")
    parser.add_argument("--json", action="store_true", default=default or False,
                        help="print the named values as JSON (SI units: bytes, FLOPs, seconds)")


def register(sub, help_text: str) -> None:
    p = sub.add_parser("explain", help=help_text,
                              description=LISTING["en"][0], epilog=listing("en"),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p, None)
    p.set_defaults(func=cmd_explain, topic=None)
    sub = p.add_subparsers(dest="topic", metavar="TOPIC")
    for t in topics().values():
        tp = sub.add_parser(t.name, help=t.summary["en"],
                            description=f"{t.summary['en']}\n{t.term_zh}: {t.summary['zh']}",
                            epilog=f"example:\n  {t.examples}" if t.examples else None,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        for arg in t.args:
            tp.add_argument(arg.flag, **arg.kwargs)
        # SUPPRESS: a --lang/--json given before the topic (`explain --lang zh moe`) is kept
        _common(tp, argparse.SUPPRESS)


def cmd_explain(args: argparse.Namespace) -> int:
    lang = args.lang or "en"
    if args.topic is None:
        if args.json:
            print(json.dumps({t.name: t.summary[lang] for t in topics().values()}, ensure_ascii=False, indent=2))
        else:
            print(listing(lang))
        return 0
    t = topics()[args.topic]
    given = {a.dest: getattr(args, a.dest) for a in t.args}
    try:
        doc = run_topic(t.name, lang, **given)
    except (ArithmeticError, ValueError, RuntimeError, LookupError) as err:
        # A topic computes with the values given; one it cannot compute with is the user's to change. At its
        # defaults every topic runs (tests/test_explain.py), so a failure there is a defect and raises.
        changed = [f"{a.flag} {given[a.dest]}" for a in t.args if given[a.dest] != a.kwargs.get("default")]
        if not changed:
            raise
        raise TrainwiseError(f"`trainwise explain {t.name}` cannot compute with {', '.join(changed)} "
                             f"({type(err).__name__}: {err}); `trainwise explain {t.name} --help` says what each "
                             "takes, and its defaults run.") from None
    if args.json:
        print(json.dumps(doc.values, ensure_ascii=False, indent=2, default=str))
    else:
        print(doc.render())
    return 0
