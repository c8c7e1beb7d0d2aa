"""`trainwise train --set section.key=value` as a property: every key of the config, drawn with a valid
value, a wrong type, an out-of-range value, a misspelling, or as half of an inconsistent pair, ends in
exit 0 (one step of a 2-layer model, a checkpoint and metrics) or exit 2 with one paragraph of error that
names the input and nothing written; never a traceback, never a nan or inf the user did not type."""

from __future__ import annotations

import io
import json
import math
import re
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from hypothesis import event, given, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

from trainwise.cli import main
from trainwise.config import (
    ACTIVATIONS,
    ATTENTIONS,
    CHECKPOINTING,
    GATINGS,
    NORMS,
    OPTIMIZERS,
    POSITIONS,
    PRECISIONS,
    RESUME_POLICIES,
    STRATEGIES,
    RunConfig,
    load_config,
)
from trainwise.config.run import PP_SCHEDULES

# Examples of the default-suite test and of the slow one: most draws are refused before any model is built;
# about one in ten is valid and trains one step of the tiny model.
DEFAULT_EXAMPLES = 30
SLOW_EXAMPLES = 300

# What every example starts from: one fp32 step of a 2-layer d_model 32 model on 32-token sequences, with
# nothing optional (no compile, one evaluation batch, a 4-token sample), so a valid draw stays cheap.
BASE = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32",
        "tokenizer.vocab_size=300", "train.seq_len=32", "train.micro_batch=2", "train.max_steps=1",
        "train.precision=fp32", "train.compile=false", "train.device=cpu", "train.eval_every=0",
        "train.eval_steps=1", "train.log_every=1", "train.warmup_steps=0", "train.checkpoint_every=0",
        "train.sample_tokens=4", "data.workers=1"]

# Every (section, key, type, field) of RunConfig, read from the dataclasses: a key added later is drawn too.
KEYS = [(section.name, f.name, get_type_hints(get_type_hints(RunConfig)[section.name])[f.name], f)
        for section in fields(RunConfig) for f in fields(get_type_hints(RunConfig)[section.name])]
SECTION_NAMES = [section.name for section in fields(RunConfig)]
ALL_DOTTED = {f"{s}.{k}" for s, k, _, _ in KEYS}

# The valid values of the keys that take a name from a fixed set; a key missing here draws its default.
# train.compile=true is left out: compiling costs tens of seconds, which is not what this test is about.
CHOICES = {
    "model.activation": ACTIVATIONS, "model.norm": NORMS, "model.position": POSITIONS,
    "model.attention": ATTENTIONS, "model.router_gating": GATINGS, "train.optimizer": OPTIMIZERS,
    "train.precision": PRECISIONS, "train.activation_checkpointing": CHECKPOINTING,
    "train.compile": ("auto", "false"), "train.on_nonfinite": ("skip", "stop"), "train.resume": RESUME_POLICIES,
    "train.memory_check": ("on", "warn", "off"), "train.device": ("auto", "cpu", "cuda"),
    "parallel.strategy": STRATEGIES, "parallel.pp_schedule": PP_SCHEDULES,
}

# Integers that size the work of a step (or of the run): valid draws stay among these small values and
# they are never drawn huge, so that a valid example trains in about a second. Every other integer key
# may be drawn as 2**62; a key added later that sizes work belongs here.
WORK = {
    "model.vocab_size": (260, 300, 320), "tokenizer.vocab_size": (260, 300, 320),
    "model.d_model": (16, 32, 48, 64), "model.n_layers": (1, 2, 3), "model.n_heads": (1, 2, 4, 8),
    "model.n_kv_heads": (0, 1, 2, 4), "model.head_dim": (0, 4, 8, 16), "model.ffn_hidden": (0, 32, 64, 128),
    "model.max_seq_len": (32, 64), "model.loss_chunk_tokens": (0, 16, 64), "model.n_experts": (0, 2, 4),
    "model.top_k": (0, 1, 2), "model.expert_ffn_hidden": (0, 32, 64), "model.n_shared_experts": (0, 1, 2),
    "model.q_lora_rank": (0, 16), "model.kv_lora_rank": (0, 16, 32), "model.qk_nope_head_dim": (0, 8, 16),
    "model.qk_rope_head_dim": (0, 8, 16), "model.v_head_dim": (0, 8, 16),
    "train.max_steps": (1, 2), "train.micro_batch": (1, 2, 4), "train.grad_accum_steps": (1, 2),
    "train.seq_len": (8, 16, 32), "train.eval_steps": (1, 2), "train.sample_tokens": (0, 4, 8),
    "data.workers": (0, 1, 2),
}
SMALL_INTS = (0, 1, 2, 3, 4, 8, 16, 32)
SMALL_FLOATS = (0.0, 1e-3, 0.1, 0.5, 0.9, 1.0)
HUGE_INT = 2**62
CORPUS = "<corpus>"  # a drawn path to the corpus, replaced by the session's corpus file when the run starts

# Pairs of values each fine alone that contradict each other (checks of config/model.py, config/run.py and
# the trainer's layout check): every one must be refused. Each lists the overrides; the error must name one.
INCONSISTENT = [
    ["model.n_heads=3"],  # does not divide d_model = 32
    ["model.n_heads=4", "model.n_kv_heads=3"],
    ["model.max_seq_len=32", "train.seq_len=64"],
    ["model.n_experts=2", "model.top_k=3"],
    ["model.n_experts=0", "model.top_k=2"],
    ["model.n_experts=4", "model.top_k=1", "model.router_groups=3"],
    ["model.n_experts=4", "model.top_k=2", "model.router_groups=2", "model.router_group_top_k=3"],
    ["model.d_model=36", "model.n_heads=4", "model.n_kv_heads=2"],  # head_dim 9: RoPE needs an even one
    ["model.head_dim=5"],
    ["model.attention=mla"],  # without its ranks
    ["model.attention=mla", "model.kv_lora_rank=16", "model.qk_rope_head_dim=8", "model.v_head_dim=32"],
    ["model.attention=mla", "model.kv_lora_rank=16", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
     "model.position=learned"],
    ["parallel.pp=2", "train.grad_accum_steps=1", "model.tie_embeddings=false"],
    ["model.n_experts=2", "model.top_k=1", "train.activation_checkpointing=op"],
    ["parallel.pp=3", "model.tie_embeddings=false", "train.grad_accum_steps=3"],  # 2 layers, 3 stages
    ["parallel.vpp=2", "parallel.pp_schedule=1f1b"],
    ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.vpp=1"],
    ["parallel.strategy=zero1", "parallel.tp=2"],
    ["parallel.tp=3"],  # does not divide n_heads = 4
    ["parallel.tp=2", "model.loss_chunk_tokens=16"],
    ["parallel.tp=2", "model.attention=mla", "model.kv_lora_rank=16", "model.qk_rope_head_dim=8",
     "model.v_head_dim=8"],
    ["data.sources=[{path = 'elsewhere.txt'}]"],  # next to data.paths
]


@dataclass
class Draw:
    """One mutation of the base run: its --set strings, what it is, the words an error about it must
    contain (one of them), and whether it must be refused."""

    overrides: list[str]
    kind: str
    names: list[str]
    must_fail: bool


def toml(value: Any) -> str:
    """A value as the TOML text a user types after `=`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + "}"


def default_of(f: Field) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()


def valid_values(dotted: str, hint: Any, f: Field) -> st.SearchStrategy:
    """Values of the key's own type that every check would take alone: small, so the step stays cheap."""
    if dotted in WORK:
        return st.sampled_from(WORK[dotted])
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.sampled_from(sorted({*SMALL_INTS, default_of(f)}))
    if hint is float:
        return st.sampled_from(sorted({*SMALL_FLOATS, default_of(f)}))
    if hint is str:
        return st.sampled_from(CHOICES.get(dotted, (default_of(f),)))
    if dotted == "data.paths":
        return st.just([CORPUS])
    if dotted == "data.sources":
        return st.just([{"path": CORPUS, "weight": 2}])
    return st.just(default_of(f))  # include, exclude and any list added later: empty


def wrong_types(hint: Any) -> list[str]:
    """TOML texts of another type than the key's (an empty value too, except for a string key)."""
    common = ["[1, 2]", "{a = 1}"]
    if hint is bool:
        return [*common, '""', "2", '"maybe"', "0.5"]
    if hint is int:
        return [*common, '""', '"ten"', "1.5", "true", "ten"]
    if hint is float:
        return [*common, '""', '"fast"', "true", "fast"]
    if hint is str:
        return common
    return ["3", "true", "1.5"]  # lists: a scalar of the wrong kind


def out_of_range(dotted: str, hint: Any) -> list[str]:
    if hint is int:
        return ["0", "-1", "-7", "nan", "inf"] + ([] if dotted in WORK else [str(HUGE_INT)])
    if hint is float:
        return ["0", "-1.0", "-1e-9", "1e30", "nan", "inf", "-inf"]
    if hint is str:
        return ['"bogus"', '"Auto"']
    return []


def misspell(word: str, how: int) -> str:
    """The word with one edit a hand makes: a letter dropped, doubled, or two swapped."""
    i = how % len(word)
    j = min(i + 1, len(word) - 1)
    return [word[:i] + word[i + 1:], word[:i] + word[i] + word[i:],
            word[:i] + word[j] + word[i] + word[j + 1:]][how // len(word) % 3]


@st.composite
def key_draw(draw) -> Draw:
    """One key of the config with a value of one of the kinds the module docstring lists."""
    section, key, hint, f = draw(st.sampled_from(KEYS))
    dotted = f"{section}.{key}"
    kinds = ["valid", "wrong type", "out of range", "unknown key"]
    kind = draw(st.sampled_from([k for k in kinds if k != "out of range" or out_of_range(dotted, hint)]))
    if kind == "valid":
        text = toml(draw(valid_values(dotted, hint, f)))
        paths = ["data.paths=[]"] if dotted == "data.sources" else []  # a mixture replaces data.paths
        return Draw([*paths, f"{dotted}={text}"], kind, [dotted], must_fail=False)
    if kind == "wrong type":
        text = draw(st.sampled_from(wrong_types(hint)))
        return Draw([f"{dotted}={text}"], kind, [dotted], must_fail=True)
    if kind == "out of range":
        text = draw(st.sampled_from(out_of_range(dotted, hint)))
        # non-finite and negative numbers are never a valid setting; 0 and 2**62 are for some keys (0 = off)
        must = text in ("nan", "inf") or text.startswith("-") or (hint is str and dotted in CHOICES)
        return Draw([f"{dotted}={text}"], f"{kind} {text}", [dotted], must_fail=must)
    how = draw(st.integers(0, 200))
    if draw(st.booleans()):
        wrong = misspell(section, how)
        if wrong in SECTION_NAMES:
            wrong += "s"
        return Draw([f"{wrong}.{key}=1"], "unknown section", [wrong], must_fail=True)
    wrong = misspell(key, how)
    if f"{section}.{wrong}" in ALL_DOTTED or not wrong:
        wrong += "_x"
    return Draw([f"{section}.{wrong}=1"], kind, [f"{section}.{wrong}"], must_fail=True)


def pair_draw() -> st.SearchStrategy:
    return st.sampled_from(INCONSISTENT).map(lambda sets: Draw(
        list(sets), "inconsistent pair", [s.split("=", 1)[0] for s in sets], must_fail=True))


def draws() -> st.SearchStrategy:
    """One or two mutations of the base run: keys of every kind, or an inconsistent pair."""
    return st.lists(st.one_of(key_draw(), pair_draw()), min_size=1, max_size=2)


def keys(mutation: Draw) -> list[str]:
    return [s.split("=", 1)[0] for s in mutation.overrides]


NONFINITE = re.compile(r"\b(nan|inf)\b", re.IGNORECASE)


def check_train(corpus: Path, runs: Path, mutations: list[Draw]) -> tuple[Path, str]:
    """Run `trainwise train` in this process on the base run plus the mutations; assert the contract.
    Returns the run directory and what the run printed."""
    overrides = [s.replace(CORPUS, str(corpus)) for m in mutations for s in m.overrides]
    out = runs / f"run-{len(list(runs.iterdir()))}"
    argv = ["train", "--out", str(out)]
    for item in [*BASE, f"data.paths=['{corpus}']", *overrides]:
        argv += ["--set", item]
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        rc = main(argv)  # an exception escaping here is the failure: a traceback instead of a message
    printed, err = stdout.getvalue() + stderr.getvalue(), stderr.getvalue().strip()
    typed = " ".join(overrides).lower()
    assert all(word.lower() in typed for word in NONFINITE.findall(printed)), printed
    assert rc in (0, 2), printed
    if currently_in_test_context():  # hypothesis's statistics: how many draws trained
        event("exit 0" if rc == 0 else "exit 2")
    if rc == 2:
        assert not out.exists() or not any(out.iterdir()), f"written before the error: {sorted(out.iterdir())}"
        assert err.startswith("trainwise train: error:") and "\n\n" not in err and "Traceback" not in err, err
        message = " ".join(err.split())
        names = [name for m in mutations for name in m.names]
        assert any(name in message for name in names), (names, message)
        return out, printed
    # a key set twice takes the later value: an invalid draw that a later one replaced need not be refused
    refused = [m for i, m in enumerate(mutations) if m.must_fail and not set(keys(m)) & {
        k for later in mutations[i + 1:] for k in keys(later)}]
    assert not refused, f"{overrides} should have been refused:\n{printed}"
    cfg = load_config(out / "config.toml")
    assert (out / "checkpoints" / f"step_{cfg.train.max_steps:08d}" / "model.safetensors").is_file()
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == cfg.train.max_steps
    assert math.isfinite(last["loss"]), last
    return out, printed


@pytest.fixture(scope="module")
def runs(tmp_path_factory, calibrated) -> Path:
    """One folder for every example's run directory; the session's calibration is measured once. W&B
    runs disabled: a drawn log.wandb=true goes through trainwise's logger without an account or network."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "disabled")
        yield tmp_path_factory.mktemp("runs")


@settings(max_examples=DEFAULT_EXAMPLES)
@given(mutations=draws())
def test_train_set_refuses_bad_values_cleanly_and_trains_good_ones(corpus, runs, mutations):
    """30 seeded examples (DEFAULT_EXAMPLES; conftest.py's profile derandomizes them): the contract of
    the module docstring for each."""
    check_train(corpus, runs, mutations)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES)
@given(mutations=draws())
def test_train_set_contract_over_many_examples(corpus, runs, mutations):
    """The same property over 300 examples (SLOW_EXAMPLES): `pytest -m slow`."""
    check_train(corpus, runs, mutations)


def test_a_run_that_overflows_its_weights_ends_without_a_traceback(corpus, runs):
    """weight_decay 1e30 validates (it is a finite number) and multiplies the weights by 1 - lr x 1e30: the
    run ends with its checkpoint and report, its sample saying why there is none, its losses 'not finite'."""
    out, printed = check_train(corpus, runs, [Draw(["train.weight_decay=1e30"], "out of range",
                                                   ["train.weight_decay"], False)])
    assert "val loss not finite" in printed
    assert (out / "sample.txt").read_text().startswith("(no sample: the model's next-token logits are not finite")
    assert (out / "report.html").is_file()
