"""The training run end to end: run directory contract, resume, sampling, and bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import TINY, set_args

from trainwise.cli import main
from trainwise.config import RunConfig, apply_overrides, load_config
from trainwise.runtime.optim import lr_at
from trainwise.trainer.loop import train
from trainwise.verify.verify import steady_step_time

TRAIN = [*TINY, "train.micro_batch=4", "train.eval_every=5", "train.eval_steps=2", "train.checkpoint_every=4"]
METRIC_KEYS = {"step", "tokens", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "flops_per_s", "mfu"}


def tiny_config(corpus: Path, *extra: str) -> RunConfig:
    return apply_overrides(RunConfig(), TRAIN + [f"data.paths=['{corpus}']", *extra])


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_run_directory_contract(corpus, tmp_path):
    out = tmp_path / "run"
    result = train(tiny_config(corpus, "train.max_steps=20"), out=out, quiet=True)
    for name in ("config.toml", "tokenizer.json", "plan.json", "metrics.jsonl"):
        assert (out / name).is_file(), name
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(METRIC_KEYS <= row.keys() for row in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [5, 10, 15, 20]
    assert rows[-1]["loss"] < rows[0]["loss"]
    checkpoints = sorted((out / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["step_00000016", "step_00000020"]  # keep_checkpoints = 2
    manifest = json.loads((checkpoints[-1] / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.pt", "rng.pt", "trainer.json"}
    resolved = load_config(out / "config.toml")
    assert resolved.model.vocab_size == result_vocab(out)
    assert resolved.train.max_steps == 20
    plan = json.loads((out / "plan.json").read_text())
    weights = load_file(checkpoints[-1] / "model.safetensors")
    assert plan["model"]["params_total"] == sum(t.numel() for t in weights.values())
    assert result.val_loss == pytest.approx(rows[-1]["val_loss"])


def result_vocab(out: Path) -> int:
    from trainwise.tokenizer import Tokenizer

    return Tokenizer.load(out / "tokenizer.json").vocab_size


# bf16, the default recipe, by default; fp32 under -m slow (exact resume is also held by tests/test_relaunch.py
# and tests/test_faults.py in the default suite)
@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "bf16"])
def test_sigterm_then_resume_reproduces_the_uninterrupted_run(corpus, tmp_path, precision, capsys):
    """SIGTERM mid-run: the step finishes, a checkpoint is saved, exit 0; resuming gives bitwise the
    same losses and weights as a run that was never interrupted (dropout on, so RNG state matters)."""
    extra = ["train.max_steps=60", f"train.precision={precision}", "model.dropout=0.1", "train.eval_every=0",
             "train.checkpoint_every=0"]
    sets = set_args(corpus, *TRAIN[len(TINY):], *extra)
    straight = tmp_path / "straight"
    assert main(["train", "--out", str(straight), "--quiet", *sets]) == 0

    split = tmp_path / "split"
    proc = subprocess.Popen([sys.executable, "-m", "trainwise", "train", "--out", str(split), *sets],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = split / "metrics.jsonl"
    while proc.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    stopped_at = len(read_metrics(split))
    assert stopped_at < 60, "the run finished before the signal arrived"
    assert f"trainwise train --resume {split}" in stdout
    assert main(["train", "--resume", str(split), "--quiet"]) == 0

    assert [r["loss"] for r in read_metrics(split)] == [r["loss"] for r in read_metrics(straight)]
    a = load_file(straight / "checkpoints/step_00000060/model.safetensors")
    b = load_file(split / "checkpoints/step_00000060/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a --max-steps behind the run's step, and an --out beside --resume: one error each, nothing rewritten
    files = {p.name: p.read_bytes() for p in split.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(split), "--max-steps", "30", "--quiet"]) == 2
    assert "is at step 60, past train.max_steps = 30" in " ".join(capsys.readouterr().err.split())
    assert main(["train", "--resume", str(split), "--out", str(tmp_path / "other"), "--quiet"]) == 2
    assert "drop --out" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in split.iterdir() if p.is_file()} == files
    assert not (tmp_path / "other").exists()


def test_sample_is_reproducible_with_a_seed(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_config(corpus, "train.max_steps=4"), out=out, quiet=True)
    args = ["sample", str(out), "--prompt", "The ", "--max-new-tokens", "12", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert first.startswith("The ")


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainwise", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ})


def assert_clean_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "error:" in proc.stderr
    flat = " ".join(proc.stderr.split())  # the message wraps at 100 columns, wherever a long path puts the breaks
    for word in words:
        assert word in flat, (word, proc.stderr)


def bad_inputs(tmp_path: Path, corpus: Path) -> dict:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "no_text").mkdir()
    (tmp_path / "no_text" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text(corpus.read_text())
    (mixed / "b.txt").write_bytes(b"\x00\x01\x02ELF" + bytes(range(256)) * 8)
    return {
        "empty corpus": (["--data", str(tmp_path / "empty.txt")], ["empty.txt"]),
        "missing path": (["--data", str(tmp_path / "nope.txt")], ["nope.txt"]),
        "no text files": (["--data", str(tmp_path / "no_text")], ["no_text"]),
        "binary file": (["--data", str(mixed / "b.txt")], ["b.txt", "binary"]),  # named itself: an error
        "only binaries": (["--data", str(tmp_path / "no_text")], ["image.png", "binary"]),
        "config typo": (["--set", "train.max_step=3"], ["train.max_step", "train.max_steps"]),
        "seq_len too long": (["--set", "train.seq_len=512"], ["train.seq_len", "max_seq_len"]),
    }


@pytest.mark.parametrize("case", ["empty corpus", "missing path", "no text files", "binary file", "only binaries",
                                  "config typo", "seq_len too long"])
def test_bad_input_is_a_clean_error_and_writes_nothing(corpus, tmp_path, case, capsys):
    args, words = bad_inputs(tmp_path, corpus)[case]
    out = tmp_path / "run"
    code = main(["train", "--out", str(out), "--quiet", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert "error:" in err and all(w in err for w in words), err
    assert not out.exists()


def test_cli_error_has_no_traceback_and_existing_run_is_untouched(corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_cli("train", "--out", str(out), "--data", str(corpus), cwd=tmp_path)
    assert_clean_error(proc, "already exists", "--resume")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    proc = run_cli("train", "--set", "trian.seed=1", cwd=tmp_path)
    assert_clean_error(proc, "trian", "'train'")


def test_a_min_lr_above_the_lr_is_refused_naming_both(corpus, tmp_path, capsys):
    """A learning rate set below the default min_lr, min_lr left alone, rose over the run from lr to min_lr instead
    of decaying; now one error before anything is written, and a min_lr at most the lr decays to it."""
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data", str(corpus), "--set", "train.lr=1e-4"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "train.min_lr = 0.0002 is above train.lr = 0.0001" in err and "train.min_lr=1e-05" in err, err
    assert not out.exists()
    cfg = apply_overrides(RunConfig(), ["train.lr=1e-4", "train.min_lr=1e-5"])
    cfg.train.validate()
    assert lr_at(cfg.train.max_steps, cfg.train) == pytest.approx(1e-5)


def test_compile_setting_auto_compiles_only_long_dense_single_process_or_ddp_runs():
    from trainwise.config import ModelConfig
    from trainwise.runtime.parallelize import COMPILE_MIN_STEPS, resolve_compile

    dense, moe = ModelConfig(), ModelConfig(n_experts=4, top_k=2)
    assert resolve_compile("auto", dense, COMPILE_MIN_STEPS, "none")[0]
    assert resolve_compile("auto", dense, COMPILE_MIN_STEPS, "ddp")[0]
    assert not resolve_compile("auto", dense, COMPILE_MIN_STEPS - 1, "none")[0]
    assert not resolve_compile("auto", moe, 10 * COMPILE_MIN_STEPS, "none")[0]
    assert not any(resolve_compile("auto", dense, 10 * COMPILE_MIN_STEPS, s)[0] for s in ("zero2", "fsdp"))
    assert resolve_compile("true", dense, 1, "none") == (True, "set in the config")
    assert resolve_compile("false", dense, 10 * COMPILE_MIN_STEPS, "none")[0] is False
    # --set train.compile=true (a TOML bool) means "true"; anything else names the choices
    assert apply_overrides(RunConfig(), ["train.compile=true"]).train.compile == "true"
    assert apply_overrides(RunConfig(), ["train.compile=false"]).train.compile == "false"
    checkpointing = apply_overrides(RunConfig(), ["train.activation_checkpointing=true"]).train.activation_checkpointing
    assert checkpointing == "full"
    from trainwise.errors import TrainwiseError

    with pytest.raises(TrainwiseError, match="train.compile = 'sometimes' is not one of auto, true, false"):
        apply_overrides(RunConfig(), ["train.compile=sometimes"]).validate()


def test_compiled_run_trains_evaluates_eagerly_and_samples(corpus, tmp_path, capsys):
    """train.compile=true end to end: the whole-model compile trains to the eager run's losses (bf16 autocast:
    within 1e-3, bf16's rounding of activations the compiled kernels compute in another order; 1.6e-5 seen),
    evaluation and the final sample run eager (no second compile), and the run directory is the same as an eager
    run's. (tests/test_model.py compares the compiled model's gradients with eager's, per block here and for the
    whole model under -m slow.)"""
    out = tmp_path / "run"
    result = train(tiny_config(corpus, "train.max_steps=5", "train.compile=true", "train.precision=bf16"), out=out)
    printed = capsys.readouterr().out
    assert "compile: on (set in the config" in printed
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "val_loss" in r] == [5] and rows[-1]["loss"] < rows[0]["loss"]
    assert result.val_loss == result.val_loss and result.sample
    assert (out / "checkpoints" / "step_00000005" / "model.safetensors").is_file()
    eager = tmp_path / "eager"
    train(tiny_config(corpus, "train.max_steps=5", "train.compile=false", "train.precision=bf16"), out=eager,
          quiet=True)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in read_metrics(eager)], rel=1e-3)


def test_step_time_leaves_out_checkpoint_saves(corpus, tmp_path):
    """metrics.jsonl's step_time_s (and verify.json's measured step time) is the steps' own time: a run
    that saves a checkpoint after every step logs about the step time of one that never saves (a save,
    with its fsyncs and checksums, took ~3x a tiny step here and was counted in the next interval), and the
    last step, whose peak verify measures, logs about the others' (the CPU peak meter's start and stop took
    0.3 s each, 10-30 tiny steps, and were counted in it)."""
    import statistics

    medians = []
    for every in (0, 1):
        out = tmp_path / f"every{every}"
        train(tiny_config(corpus, "train.max_steps=12", "train.eval_every=0", f"train.checkpoint_every={every}"),
              out=out, quiet=True)
        rows = read_metrics(out)
        times = [r["step_time_s"] for r in rows[1:]]
        medians.append(statistics.median(times))
        # 0.1 s beside a tiny step's 5x: what a busy machine adds to one step (0.055 s against a 7.5 ms median seen
        # with the other test worker launching ranks); the meter's start and stop (about 0.3 s together) stay out
        assert times[-1] < 5 * medians[-1] + 0.1, times
        # the last step ran under the meter's profiler: its row says so, and verify's step time leaves it out
        assert [r.get("metered_steps") for r in rows] == [None] * 11 + [1]
        assert steady_step_time(out) == (pytest.approx(statistics.fmean(times[:-1])), 10)
    assert medians[1] < 2.5 * medians[0], medians


def test_auto_precision_on_a_cpu_is_bf16_where_it_multiplies_bf16_natively():
    """On an x86 CPU, bf16 exactly where the kernel lists AVX512-BF16 or AMX-BF16 among the CPU's flags: oneDNN
    also runs bf16 on plain AVX-512, several times slower than fp32, and says it supports it there."""
    import platform

    from trainwise.runtime.precision import resolve_precision

    precision, why = resolve_precision("auto", torch.device("cpu"))
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split())
        assert precision == ("bf16" if {"avx512_bf16", "amx_bf16"} & flags else "fp32"), (precision, why)
    else:
        assert precision == ("bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32")
    assert resolve_precision("fp32", torch.device("cpu")) == ("fp32", "set in the config")
