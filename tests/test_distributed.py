"""torchrun with DDP, ZeRO-1 and FSDP2 (zero2, fsdp) on 2 CPU ranks (gloo): same losses as one process, clean failure,
resume."""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import set_args

from trainwise.api import load
from trainwise.cli import main

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def rank_env() -> dict:
    """The ranks' environment, read when they start: one thread per rank (2 ranks on 2 cores), and the
    session's cache (tests/conftest.py), so the 1-thread calibration and the link are measured once per session."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def sets(corpus: Path, *extra: str) -> list[str]:
    return set_args(corpus, "train.eval_every=0", *extra)


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, "-m", "trainwise", "train", "--quiet", *args], capture_output=True, text=True,
                          timeout=timeout, env=rank_env())


def test_collectives_are_calibrated_under_torchrun_and_used_by_the_plan():
    """`torchrun --nproc_per_node 2 -m trainwise hardware --calibrate` measures gloo's all-reduce,
    all-gather and reduce-scatter alone, fits the ring model's latency and bandwidth, then DDP's and FSDP2's
    collectives as real steps run them (two reference models against their unsharded steps),
    and caches both; the plan prices those strategies at the second. First in this file: the session's cache then
    holds the link the 2-rank runs below price their steps with, measured once."""
    from test_steptime import profile

    from trainwise.hardware.cache import cached_link
    from trainwise.measure.reference import STRATEGY_REFERENCES
    from trainwise.planner.machine import _use_measured_link

    proc = subprocess.run([*TORCHRUN, "-m", "trainwise", "hardware", "--calibrate"], env=rank_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gloo collectives over 2 ranks" in proc.stdout and "fsdp as its training steps run them" in proc.stdout \
        and "ddp as its training steps run them" in proc.stdout
    entry = cached_link("gloo", 2)
    p = profile()
    _use_measured_link(p, "gloo", 2)
    latency, bandwidth = entry["link"]
    assert 0 <= latency < 0.1 and 1e6 < bandwidth < 1e12
    assert p.link == [latency, bandwidth] and p.link_source.startswith("calibrated (gloo, 2 ranks, ")
    assert set(p.strategy_links) == {"ddp", "zero2", "fsdp"}
    for strategy, fit in entry["strategies"].items():
        assert len(fit["rows"]) == len(STRATEGY_REFERENCES) and all(r[2] > 0 for r in fit["rows"])
        assert 0 <= fit["link"][0] < 0.1 and fit["link"][1] > 1e6, (strategy, fit)  # 1e30: no per-byte term
    for strategy in ("zero2", "fsdp"):
        # a sharded step's collectives cost more than the same collectives on idle ranks (copies in and out,
        # waits at every block, gloo's threads on computing cores): the larger reference, priced both ways
        # (ddp's one all-reduce, 1-2x its price alone in a step, is left out: its margin is the machine's noise)
        fit = entry["strategies"][strategy]
        units, bytes_, _ = fit["rows"][-1]
        assert units * fit["link"][0] + bytes_ / fit["link"][1] > units * latency + bytes_ / bandwidth, strategy


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """The single-process run of a list of overrides, trained once for the strategies compared with it."""
    runs: dict[tuple[str, ...], Path] = {}

    def run(*overrides: str) -> Path:
        if overrides not in runs:
            runs[overrides] = tmp_path_factory.mktemp("single") / "run"
            assert main(["train", "--out", str(runs[overrides]), "--quiet", *sets(corpus, *overrides)]) == 0
        return runs[overrides]
    return run


@pytest.fixture(scope="module")
def two_ranks(corpus, tmp_path_factory):
    """Each strategy's 5-step run on 2 ranks (checkpoints at steps 3 and 5), launched once for the tests of it."""
    runs: dict[str, Path] = {}

    def run(strategy: str) -> Path:
        if strategy not in runs:
            runs[strategy] = tmp_path_factory.mktemp(strategy) / "run"
            extra = ("train.max_steps=5", "train.micro_batch=2", "train.checkpoint_every=3",
                     f"parallel.strategy={strategy}")
            proc = torchrun("--out", str(runs[strategy]), *sets(corpus, *extra))
            assert proc.returncode == 0, proc.stderr[-3000:]
        return runs[strategy]
    return run


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_two_ranks_equal_one_process_with_grad_accum(strategy, one_process, two_ranks):
    """micro-batch b on 2 ranks == micro-batch b x grad_accum 2 in one process, on the same data."""
    single = one_process("train.max_steps=5", "train.micro_batch=2", "train.grad_accum_steps=2")
    multi = two_ranks(strategy)
    assert losses(multi) == pytest.approx(losses(single), rel=1e-5)
    # the gathered checkpoint loads into one process and matches the single-process weights
    a = load_file(single / "checkpoints/step_00000005/model.safetensors")
    b = load_file(multi / "checkpoints/step_00000005/model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)
    assert load(multi).generate("The ", max_new_tokens=5, seed=0).startswith("The ")
    # per-rank model states against the planner's ZeRO math (DDP = replicated, zero1/zero2 = ZeRO-1/2, FSDP = ZeRO-3)
    per_rank = json.loads((multi / "verify.json").read_text())["per_rank"]
    assert per_rank["zero_stage_planned"] == {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}[strategy]
    for rank in per_rank["ranks"]:
        for name in ("params", "grads", "optimizer"):
            assert abs(rank[name]["error"]) < 0.01, (name, rank[name])
        # each rank's last step, measured as it ran, against cost.rank_memory.rank_peak
        assert abs(rank["peak_memory_bytes"]["error"]) < 0.10, rank["peak_memory_bytes"]
        # its messages, per collective, as cost.rank plans them (zero1's broadcasts: one per parameter tensor)
        assert rank["comm"] and all(c["calls"]["predicted"] == c["calls"]["measured"] > 0
                                    and c["bytes"]["predicted"] == c["bytes"]["measured"]
                                    for c in rank["comm"].values()), rank["comm"]
        assert ("broadcast" in rank["comm"]) == (strategy == "zero1")
    # the speed probe of rank 0 at the start (the others waiting), and the prediction for the machine as probed
    v = json.loads((multi / "verify.json").read_text())
    start = json.loads((multi / "plan.json").read_text())["time"]["probe"]
    probed = v["step_time_probed_s"]
    assert len(probed["probe"]["now_s"]) == 5 and probed["measured"] == v["step_time_s"]["measured"]
    # (rank 0 alone timed the step's new kernels at the start: its plan at the end prices the same kernels)
    if probed["probe"]["at"] == start["at"]:  # the start reading stood (else one at the end was nearer)
        assert probed["predicted"] == pytest.approx(start["step_seconds"])
    else:
        assert probed["probe"]["readings"][0] == pytest.approx(start["ratio"])
    assert main(["verify", str(multi)]) == 0
    assert f"Per rank: {strategy} on 2 ranks" in (multi / "report.html").read_text()
    # the metrics rows' throughput is both ranks' together: MFU against both ranks' peak (one rank's: 2x, > 1)
    peak = json.loads((multi / "plan.json").read_text())["hardware"]["peak_flops"]
    rows = [json.loads(line) for line in (multi / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["mfu"] == pytest.approx(row["flops_per_s"] / (2 * peak)) and row["mfu"] < 1
    # step_time_s is the steps' own: the peak meters start and stop outside them, the ranks leaving each together
    # (ddp's steps 3 and 5 read 0.38 and 0.31 s against a 0.03 s median when they were counted in)
    times = [row["step_time_s"] for row in rows[1:]]
    assert max(times) < 5 * statistics.median(times), times
    # steps 3 to 5 ran under the peak meter (not the first two: PEAK_STEPS): their rows say so
    assert [row.get("metered_steps") for row in rows] == [None, None, 1, 1, 1]


# fsdp (parameters resharded after the forward, gathered again under recompute) by default; zero2, the same
# FSDP2 code keeping them gathered, under -m slow
@pytest.mark.parametrize("strategy", [pytest.param("zero2", marks=pytest.mark.slow), "fsdp"])
def test_grad_accum_composes_with_fsdp_and_checkpointing(corpus, tmp_path, strategy, one_process):
    extra = ("train.max_steps=3", "train.micro_batch=1", "train.activation_checkpointing=full")
    single = one_process(*extra, "train.grad_accum_steps=4")
    multi = tmp_path / "multi"
    proc = torchrun("--out", str(multi),
                    *sets(corpus, *extra, "train.grad_accum_steps=2", f"parallel.strategy={strategy}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(multi) == pytest.approx(losses(single), rel=1e-5)


def test_strategy_none_with_more_than_one_rank_is_a_clear_error(corpus, tmp_path, monkeypatch, capsys):
    """Rank 0 of the environment torchrun sets for 2 ranks (read before any process group is joined, so the
    check runs in this process): exit 2, the strategies named, no run directory written."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["train", "--out", str(tmp_path / "run"), "--quiet", *sets(corpus, "train.max_steps=2")]) == 2
    err = capsys.readouterr().err
    assert "launched by torchrun as one of 2 ranks" in err and "parallel.strategy=ddp" in err
    assert not (tmp_path / "run").exists()


def _workers(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in out]


SIGNAL_RUN = ("train.max_steps=30", "train.micro_batch=2", "parallel.strategy=ddp", "train.checkpoint_every=5")
@pytest.fixture(scope="module")
def straight_losses(corpus, tmp_path_factory) -> list[float]:
    run = tmp_path_factory.mktemp("straight") / "run"
    assert torchrun("--out", str(run), *sets(corpus, *SIGNAL_RUN)).returncode == 0
    return losses(run)


def signal_one_rank_mid_run(run: Path, corpus: Path, sig: int) -> tuple[int, str]:
    """Start SIGNAL_RUN on 2 ranks, send `sig` to the rank started last after 12 steps; (exit code, stderr)."""
    proc = subprocess.Popen([*TORCHRUN, "-m", "trainwise", "train", "--quiet", "--out", str(run),
                             *sets(corpus, *SIGNAL_RUN)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_env())
    metrics = run / "metrics.jsonl"
    while proc.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) < 12):
        time.sleep(0.01)
    workers = _workers(proc.pid)
    assert len(workers) == 2
    os.kill(max(workers), sig)
    _, stderr = proc.communicate(timeout=180)
    return proc.returncode, stderr


def resume(run: Path) -> None:
    resumed = subprocess.run([*TORCHRUN, "-m", "trainwise", "train", "--quiet", "--resume", str(run)],
                             capture_output=True, text=True, timeout=300, env=rank_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]


def test_killing_one_rank_stops_the_job_and_resume_reproduces_the_losses(corpus, tmp_path, straight_losses):
    run = tmp_path / "killed"
    start = time.time()
    returncode, stderr = signal_one_rank_mid_run(run, corpus, signal.SIGKILL)
    assert returncode != 0
    assert time.time() - start < 180
    assert "lost contact with the other ranks" in stderr or "SIGKILL" in stderr or "Signal 9" in stderr
    resume(run)
    assert losses(run) == pytest.approx(straight_losses, rel=1e-6)


def test_sigterm_to_one_rank_stops_every_rank_at_one_step_with_a_checkpoint(corpus, tmp_path, straight_losses):
    """A preemption notice reaching one rank: the ranks agree (any_rank, over gloo) to stop after the
    same step, save it, and exit 0; the resume continues the uninterrupted run exactly."""
    run = tmp_path / "preempted"
    returncode, stderr = signal_one_rank_mid_run(run, corpus, signal.SIGTERM)
    assert returncode == 0, stderr[-3000:]
    steps = len(losses(run))
    assert 12 <= steps < 30 and (run / f"checkpoints/step_{steps:08d}").is_dir()
    resume(run)
    assert losses(run) == pytest.approx(straight_losses, rel=1e-6)


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_sharded_checkpoint_resumes_exactly_and_loads_in_one_process(tmp_path, strategy, two_ranks):
    """Sharded optimizer states (whole tensors on their owner ranks under ZeRO-1, FSDP2 shards under
    zero2): the checkpoint gathers them to rank 0 in the single-process format, and a resume hands
    each rank its own states back."""
    run = tmp_path / "run"
    shutil.copytree(two_ranks(strategy), run)  # a copy: the run's own tests read it as it ended
    straight = losses(run)
    optimizer = torch.load(run / "checkpoints/step_00000005/optimizer.pt", weights_only=True)
    names = {name for name, _ in load(run).model.named_parameters()}
    assert set(optimizer["state"]) == names  # every parameter's states, from both ranks, by name
    # lose the last checkpoint, resume from step 3: steps 4 and 5 come out the same
    for f in (run / "checkpoints/step_00000005").iterdir():
        f.unlink()
    (run / "checkpoints/step_00000005").rmdir()
    resume(run)
    assert losses(run) == pytest.approx(straight, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_three_ranks_per_rank_peak_within_ten_percent(corpus, tmp_path, strategy):
    """3 gloo ranks, grad accumulation 2: every rank's measured step peak (the median of steps 3 to 5:
    trainer.observer.steady_peak) within 10% of its plan."""
    run = tmp_path / strategy
    proc = subprocess.run([*TORCHRUN[:-1], "3", "-m", "trainwise", "train", "--quiet", "--out", str(run),
                           *sets(corpus, "train.max_steps=5", "train.micro_batch=2", "train.grad_accum_steps=2",
                                 f"parallel.strategy={strategy}")],
                          capture_output=True, text=True, timeout=600, env=rank_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads((run / "verify.json").read_text())["per_rank"]["ranks"]
    assert len(ranks) == 3
    for rank in ranks:
        assert abs(rank["peak_memory_bytes"]["error"]) < 0.10, rank["peak_memory_bytes"]
