"""Each core idea of LLM training as a computation you can run.

Every topic computes a real example with PyTorch and with the planner's own functions (trainwise.cost),
prints the derivation step by step (formula = numbers substituted = result unit) and says where the idea
shows up in your run. `--lang zh` prints it in Chinese, `--json` prints the named values.
"""

from __future__ import annotations

from trainwise.errors import TrainwiseError
from trainwise.explain import amp, basics, compute, layers, tokens, training
from trainwise.explain.topic import Topic

LANGS = ("en", "zh")
LISTING = {
    "en": ("trainwise explain TOPIC [--lang zh] [--json]: every concept of LLM training as a computation.",
           "run `trainwise explain TOPIC --help` for a topic's numbers you can change."),
    "zh": ("trainwise explain 主题 [--lang zh] [--json]：把 LLM 训练的每个概念变成一次可以运行的计算。",
           "运行 `trainwise explain 主题 --help` 查看可以修改的数值。"),
}


def topics() -> dict[str, Topic]:
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


__all__ = ["LANGS", "listing", "run_topic", "topics"]
