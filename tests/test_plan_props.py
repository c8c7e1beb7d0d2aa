"""`trainwise plan` as a user types it: every draw of its own flags ends in an answer (exit 0: finite, positive
memory and step time, an MFU below the peak of the precision its matmuls run in; "does not fit by N GiB" is
an answer too) or in exit 2 with a short error naming the input; never a traceback, never nan or inf.

The flags are read from plan's own argparse definitions, so a flag added later is drawn too; the accelerator
from the hardware table, the model from the presets. The default suite runs PROPERTY_EXAMPLES seeded draws
(tests/conftest.py derandomizes hypothesis); `-m slow` runs SLOW_EXAMPLES. `--gpu cpu` is left to the slow
run (it times kernels at each new shape on this machine) and `--simulate` is drawn with the small presets
only (one fake-tensor step of a 671B model takes minutes): both are exit-code properties all the same."""

import argparse
import contextlib
import io
import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainwise.cli import build_parser, main
from trainwise.hardware.table import ACCELERATORS
from trainwise.presets import preset_names

PROPERTY_EXAMPLES = 40
SLOW_EXAMPLES = 1500
SMALL = [m for m in preset_names() if m.startswith("trainwise-")] + ["gpt2"]
NOT_FINITE = re.compile(r"(?<![\w-])(nan|inf|infinity)(?![\w-]|\s+fabric)", re.IGNORECASE)  # not AMD's fabric


def plan_actions() -> list[argparse.Action]:
    """The optional arguments of `trainwise plan`, as its parser defines them (help aside)."""
    parser = build_parser(["plan"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["plan"]._actions if a.option_strings and a.dest != "help"]


def _value(action: argparse.Action, slow: bool) -> st.SearchStrategy[list[str]]:
    """Command-line words for one flag, good and bad, by what its definition says it takes."""
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return st.sampled_from([[flag], [f"--no-{flag[2:]}"]])
    if action.nargs == 0:  # store_true
        return st.just([flag])
    if action.choices is not None:
        return st.sampled_from([str(c) for c in action.choices] + ["bogus", "-1"]).map(lambda v: [flag, v])
    name = action.dest
    if name == "gpu":
        gpus = list(ACCELERATORS) + ["cuda", "h100", "not-a-gpu"] + (["cpu"] if slow else [])
        return st.sampled_from(gpus).map(lambda v: [flag, v])
    if name == "model":
        return st.sampled_from(preset_names() + ["not-a-model"]).map(lambda v: [flag, v])
    if name == "precision":
        return st.sampled_from(["bf16", "fp32", "amp", "megatron", "bf16-pure", "fp16", "fp8", "x"]).map(
            lambda v: [flag, v])
    if name in ("memory", "memory_budget"):
        return st.sampled_from(["80GiB", "24GB", "1e9", "0", "-5GiB", "lots"]).map(lambda v: [flag, v])
    if action.type is not None and action.type.__name__ == "whole_number":
        return st.sampled_from(["1", "2", "3", "4", "8", "16", "64", "256", "4096", "0", "-2", "1.5", "x"]).map(
            lambda v: [flag, v])
    if action.type is not None and action.type.__name__ in ("number", "int", "float"):
        return st.sampled_from(["1e10", "1e6", "0.4", "1.5", "100e12", "2e9", "1", "0", "-1", "nan", "inf",
                                "x"]).map(lambda v: [flag, v])
    return st.sampled_from(["1", "x"]).map(lambda v: [flag, v])


@st.composite
def plan_argv(draw, slow: bool = False) -> list[str]:
    """One command line: a preset model (or --params alone), then any of plan's flags, each with a value."""
    actions = [a for a in plan_actions() if a.dest not in ("model", "params", "simulate")]
    chosen = draw(st.lists(st.sampled_from(actions), max_size=8, unique_by=lambda a: a.dest))
    simulate = draw(st.integers(0, 19)) == 0
    if simulate:
        argv = ["plan", "--model", draw(st.sampled_from(SMALL)), "--simulate"]
    elif draw(st.integers(0, 9)) == 0:
        argv = ["plan", "--params", draw(st.sampled_from(["1e9", "7e9", "0", "-3", "nan"]))]
    else:
        argv = ["plan", *draw(_value(next(a for a in plan_actions() if a.dest == "model"), slow))]
    if not any(a.dest == "gpu" for a in chosen) and draw(st.integers(0, 3)) > 0:
        argv += ["--gpu", draw(st.sampled_from(list(ACCELERATORS)))]
    for action in chosen:
        if simulate and action.dest == "gpu":
            continue  # a fake-tensor step on a table GPU or this CPU: the default table GPU is enough
        argv += draw(_value(action, slow))
    return argv


def run_plan(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) in this process: (exit code, stdout, stderr); argparse's own exit is an exit code too.
    Any other exception propagates: a traceback is what the property forbids."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as stop:
            rc = stop.code
    return rc, out.getvalue(), err.getvalue()


def _given(argv: list[str]) -> set[str]:
    """What the user typed that an error may name: flags, values and the words inside them."""
    words = {w for w in argv[1:]}
    return words | {w.lstrip("-").replace("-", "_") for w in words} | {w.lstrip("-").replace("-", " ") for w in words}


def check_answer(argv: list[str], rc: int, out: str, err: str) -> None:
    assert rc in (0, 2), (argv, rc, out[-500:], err[-500:])
    assert "Traceback" not in out + err, (argv, err)
    typed = " ".join(argv)
    if not NOT_FINITE.search(typed):  # an error may echo the user's own nan
        assert not NOT_FINITE.search(out + err), (argv, NOT_FINITE.search(out + err), out[-800:], err[-500:])
    if rc == 2:
        message = err.strip()
        assert message and "error" in message, (argv, out[-300:])
        assert message.count("\n\n") == 0 and len(message) < 1500, (argv, message)  # one paragraph
        low = message.lower()
        assert any(w.lower() in low for w in _given(argv) if len(w) > 1), (argv, message)  # names the input
        return
    assert out.strip(), argv
    if "--json" in argv and "--simulate" not in argv:
        report = json.loads(out)
        if "--fit" in argv:
            for c in report["best"]:
                assert c["per_device_bytes"] > 0 and (c.get("step_seconds") is None or c["step_seconds"] > 0), c
        else:
            check_plan_json(argv, report)


def check_plan_json(argv: list[str], j: dict) -> None:
    """A plan's numbers: memory finite and positive; with hardware, a step time and an MFU in (0, 1)."""
    mem = j["memory"]
    assert mem["states_bytes"] > 0 and math.isfinite(mem["per_device_bytes"]) and mem["per_device_bytes"] > 0, argv
    if mem["fits"] is False:
        assert mem["over_budget_bytes"] > 0, argv
    t = j["time"]
    if j["hardware"]["name"] is not None:
        assert t["step_seconds"] > 0 and math.isfinite(t["step_seconds"]), (argv, t)
        assert 0 < t["mfu"] < 1, (argv, t["mfu"])
        assert (t["seconds"] is None) == (j["tokens"] is None), (argv, t)


def _with_json(argv: list[str]) -> list[str] | None:
    """The same plan again, read as JSON, when what was drawn printed a table or an explanation."""
    if any(f in argv for f in ("--json", "--simulate")):
        return None
    return argv + ["--json"]


def _property(argv: list[str]) -> None:
    rc, out, err = run_plan(argv)
    check_answer(argv, rc, out, err)
    if rc == 0 and (again := _with_json(argv)):
        rc2, out2, err2 = run_plan(again)
        assert rc2 == 0, (again, err2)
        check_answer(again, rc2, out2, err2)


@settings(max_examples=PROPERTY_EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(plan_argv())
def test_every_drawn_plan_is_an_answer_or_a_short_error(argv):
    _property(argv)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(plan_argv(slow=True))
def test_many_drawn_plans_are_answers_or_short_errors(calibrated, argv):
    _property(argv)


MODELS = ["gpt2", "llama-3-8b", "mixtral-8x7b", "deepseek-v3"]


@pytest.mark.parametrize("gpu", list(ACCELERATORS))
def test_every_accelerator_plans_one_device_and_answers_for_a_node(gpu):
    """Every accelerator of `trainwise hardware`: one device always plans (exit 0, a step time); 8 devices
    under ZeRO-3 give a step time, or for the TPUs (no node in the table) a short refusal naming the flags
    that describe one. The --fit over 16 devices of each is in the slow run."""
    for model in MODELS:
        argv = ["plan", "--model", model, "--gpu", gpu, "--tokens", "1e10", "--json"]
        rc, out, err = run_plan(argv)
        assert rc == 0, (argv, err)
        check_answer(argv, rc, out, err)
        argv += ["--gpus", "8", "--zero", "3"]
        rc, out, err = run_plan(argv)
        check_answer(argv, rc, out, err)
        if gpu.startswith("tpu"):
            assert rc == 2 and "--gpus-per-node" in err, err
        else:
            assert rc == 0, (argv, err)
            assert json.loads(out)["comm"]["all_gather"]["calls"] > 0  # ZeRO-3 gathers over the node's links


@pytest.mark.slow
@pytest.mark.parametrize("gpu", list(ACCELERATORS))
@pytest.mark.parametrize("model", MODELS)
def test_every_accelerator_fits_every_model_over_sixteen(gpu, model):
    argv = ["plan", "--model", model, "--gpu", gpu, "--tokens", "1e10", "--gpus", "16", "--global-batch", "256",
            "--fit"]
    rc, out, err = run_plan(argv)
    check_answer(argv, rc, out, err)
    assert rc == (2 if gpu.startswith("tpu") else 0), (argv, err)
    if rc == 0:
        assert out.startswith("fit:") and ("GiB" in out), out[-400:]
