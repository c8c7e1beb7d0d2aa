"""The plan guards the run: a run whose planned peak exceeds the available memory stops before it writes
anything, proposing settings that fit; the proposed settings then train."""

import re

import pytest
from tiny import TINY, set_args

from trainwise.cli import main
from trainwise.config import RunConfig, apply_overrides
from trainwise.hardware.memory import ENV, available_bytes
from trainwise.cost.rank_memory import rank_peak
from trainwise.cost.run import Run
from trainwise.runtime.mesh import layout_for
from trainwise.runtime.parallelize import resolve_compile

BIG = ("train.max_steps=2", "train.eval_every=0", "train.micro_batch=16", "train.grad_accum_steps=1")


def one_process_run(cfg: RunConfig, precision: str = "fp32") -> Run:
    """The run as trainer.loop.train describes it in one process (compiled as the trainer decides)."""
    layout = layout_for(cfg.parallel, 1, cfg.train.grad_accum_steps)
    compiled, _ = resolve_compile(cfg.train.compile, cfg.model, cfg.train.max_steps, layout.strategy)
    return Run.of(cfg, precision, layout, compiled=compiled)


def tiny_peak(micro_batch: int) -> int:
    cfg = apply_overrides(RunConfig(), [*TINY, "model.vocab_size=300", "train.micro_batch=%d" % micro_batch])
    return rank_peak(one_process_run(cfg)).peak


def test_run_that_does_not_fit_stops_with_a_proposal_that_trains(corpus, tmp_path, monkeypatch, capsys):
    budget = (tiny_peak(16) + tiny_peak(2)) // 2  # micro-batch 16 does not fit, 2 does
    monkeypatch.setenv(ENV, str(budget))
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--quiet", *set_args(corpus, *BIG)]) == 2
    err = capsys.readouterr().err
    assert "exceeds" in err and ENV in err and "train.memory_check=warn" in err
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))  # nothing half-written
    proposed = re.search(r"fit: ((?:--set \S+ ?)+)", err).group(1).split()
    settings = dict(kv.split("=") for kv in proposed[1::2])
    b, k = int(settings["train.micro_batch"]), int(settings["train.grad_accum_steps"])
    assert b * k == 16 and tiny_peak(b) <= budget  # the same effective batch, within the budget
    assert main(["train", "--out", str(out), "--quiet", *set_args(corpus, *BIG), *proposed]) == 0
    assert (out / "verify.json").is_file()


def test_warn_and_off_let_the_run_go(monkeypatch):
    import torch

    from trainwise.runtime.distributed import Dist
    from trainwise.trainer.memcheck import check_memory

    monkeypatch.setenv(ENV, "1KiB")
    cfg = apply_overrides(RunConfig(), [*TINY, "model.vocab_size=300", "train.memory_check=warn"])
    said = []
    check_memory(one_process_run(cfg), cfg.train.memory_check, torch.device("cpu"), "fp32", Dist("none"), said.append)
    assert said and said[0].startswith("warning: the planned peak memory") and "1.02 KB" in said[0]
    check_memory(one_process_run(cfg), "off", torch.device("cpu"), "fp32", Dist("none"), said.append)
    assert len(said) == 1


def test_available_memory_is_read_from_the_machine(monkeypatch):
    import torch

    monkeypatch.delenv(ENV, raising=False)
    one, source = available_bytes(torch.device("cpu"))
    two, _ = available_bytes(torch.device("cpu"), local_ranks=2)
    assert one > 2**20 and "MemAvailable" in source or "cgroup" in source
    assert two == pytest.approx(one / 2, rel=0.05)  # ranks on one host share its RAM
