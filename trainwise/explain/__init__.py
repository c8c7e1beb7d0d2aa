"""`trainwise explain TOPIC`: each core idea of LLM training as a computation you can run.

Every topic computes a real example with PyTorch and with the planner's own functions (trainwise.cost),
prints the derivation step by step (formula = numbers substituted = result unit) and says where the idea
shows up in your run. `--lang zh` prints it in Chinese, `--json` prints the named values.
"""

from __future__ import annotations

import argparse
import json
import sys

from trainwise.errors import TrainwiseError
from trainwise.explain.topic import Topic

LANGS = ("en", "zh")
LISTING = {
    "en": ("trainwise explain TOPIC [--lang zh] [--json]: every concept of LLM training as a computation.",
           "run `trainwise explain TOPIC --help` for a topic's numbers you can change."),
    "zh": ("trainwise explain 主题 [--lang zh] [--json]：把 LLM 训练的每个概念变成一次可以运行的计算。",
           "运行 `trainwise explain 主题 --help` 查看可以修改的数值。"),
}


def topics() -> dict[str, Topic]:
    from trainwise.explain import amp, basics, compute, layers, tokens, training

    # in the order of the guide: the model's arithmetic, text, layers, compute and precision, training
    return {t.name: t for t in basics.TOPICS + tokens.TOPICS + layers.TOPICS + compute.TOPICS + amp.TOPICS
            + training.TOPICS}


def listing(lang: str = "en") -> str:
    all_topics = topics().values()
    w = max(len(t.name) for t in all_topics)
    head, tail = LISTING[lang]
    lines = [head, ""]
    for t in all_topics:
        term = "" if lang == "en" else f"{t.term_zh}："
        lines.append(f"  {t.name:<{w}}  {term}{t.summary[lang]}")
    lines += ["", tail]
    return "\n".join(lines)


def run_topic(name: str, lang: str = "en", **kwargs):
    """The Doc of one topic; kwargs are the topic's arguments (its function's keywords)."""
    if lang not in LANGS:
        raise TrainwiseError(f"--lang '{lang}' must be one of {', '.join(LANGS)}.")
    return topics()[name].run(lang=lang, **kwargs)


def _common(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("--lang", choices=LANGS, default=default, help="en (default) or zh (中文)")
    parser.add_argument("--json", action="store_true", default=default or False,
                        help="print the named values as JSON (SI units: bytes, FLOPs, seconds)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("explain", help="each concept of LLM training as a computation you can run",
                              description=LISTING["en"][0], epilog=listing("en"),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p, None)
    p.set_defaults(func=cmd_explain, topic=None)
    sub = p.add_subparsers(dest="topic", metavar="TOPIC")
    for t in topics().values():
        tp = sub.add_parser(t.name, help=t.summary["en"], description=f"{t.summary['en']}\n{t.term_zh}: {t.summary['zh']}",
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
    doc = run_topic(t.name, lang, **{a.dest: getattr(args, a.dest) for a in t.args})
    if args.json:
        print(json.dumps(doc.values, ensure_ascii=False, indent=2, default=str))
    else:
        print(doc.render())
    return 0


def main(argv: list[str] | None = None) -> int:
    """`trainwise explain` alone, for tests: main(["budget", "--json"])."""
    parser = argparse.ArgumentParser(prog="trainwise")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["explain", *(argv or [])])
    try:
        return args.func(args)
    except TrainwiseError as err:
        print(f"trainwise explain: error: {err}", file=sys.stderr)
        return 2


__all__ = ["listing", "main", "register", "run_topic", "topics"]
