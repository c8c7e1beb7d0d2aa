"""Relaunch = resume: the very same command, run again after a kill (a requeued job), continues its run
bitwise; killed before its first checkpoint it starts again from step 0; another config is refused by
name; two torchrun launches with a c10d rendezvous on 127.0.0.1 (two "nodes") train one run together."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainwise.cli import main
from tiny import set_args

STEPS = 12
RUN = ("train.micro_batch=4", "train.eval_every=0", "model.dropout=0.1", f"train.max_steps={STEPS}")


def command(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainwise", "train", "--out", str(out), *set_args(corpus, *RUN, *extra)]


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_weights(run: Path) -> dict:
    return load_file(run / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors")


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory) -> Path:
    """The uninterrupted run (saving makes no difference to the numbers, so it saves only at the end)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert main(command(corpus, out, "train.checkpoint_every=0")[3:] + ["--quiet"]) == 0
    return out


def kill_when(cmd: list[str], ready) -> None:
    """Start `cmd`, SIGKILL it as soon as `ready()` holds (polled every 10 ms)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and not ready():
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def rows(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def assert_same_as(run: Path, straight: Path) -> None:
    assert losses(run) == losses(straight)
    a, b = final_weights(straight), final_weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigkilled_run_relaunched_with_the_same_command_resumes_bitwise(corpus, tmp_path, straight):
    run = tmp_path / "run"
    cmd = command(corpus, run, "train.checkpoint_every=3")
    kill_when(cmd, lambda: (run / "checkpoints" / "step_00000003").is_dir())
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert saved and saved[-1] < f"step_{STEPS:08d}"
    again = subprocess.run(cmd, capture_output=True, text=True)  # the very same command line
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed {run} from {saved[-1]}" in again.stdout
    assert_same_as(run, straight)


def test_killed_before_its_first_checkpoint_it_starts_again_from_step_0(corpus, tmp_path, straight, capsys):
    run = tmp_path / "run"
    cmd = command(corpus, run, "train.checkpoint_every=0")  # no checkpoint before the last step
    kill_when(cmd, lambda: rows(run) >= 2)
    assert not list((run / "checkpoints").glob("step_*"))
    # the half state a kill can leave: a torn metrics row, a checkpoint save cut off mid-way
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    half = run / "checkpoints" / ".tmp-step_00000003-99999"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"\0" * 64)
    assert main(cmd[3:]) == 0  # the same command line, in this process this time (saves a start-up)
    assert "starting again from step 0" in capsys.readouterr().out
    assert not half.exists()
    assert_same_as(run, straight)


def test_another_config_is_refused_naming_the_keys_and_policies_hold(corpus, tmp_path, straight, capsys):
    before = {p: p.stat().st_mtime_ns for p in straight.rglob("*")}
    args = command(corpus, straight, "train.checkpoint_every=0", "train.lr=0.01", "model.n_layers=3")[3:] + ["--quiet"]
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "different config" in err and "train.lr 0.01 vs 0.002" in err and "model.n_layers 3 vs 2" in err
    assert f"--resume {straight}" in err
    same = command(corpus, straight, "train.checkpoint_every=0")[3:] + ["--quiet"]
    assert main(same + ["--set", "train.resume=never"]) == 2
    assert "train.resume = never" in " ".join(capsys.readouterr().err.split())
    assert main(command(corpus, tmp_path / "new", "train.resume=always")[3:] + ["--quiet"]) == 2
    assert "holds no trainwise run" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "new").exists()
    assert {p: p.stat().st_mtime_ns for p in straight.rglob("*")} == before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_train_one_run_together(corpus, tmp_path):
    """Two torchrun launches, as on two machines (--nnodes 2, a c10d rendezvous at HOST:PORT), one rank
    each, the run directory shared: they form one world of 2 ranks and train one DDP run."""
    run = tmp_path / "shared"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "relaunch-test",
              "--local-addr", "127.0.0.1", "-m", "trainwise", "train", "--quiet", "--out", str(run),
              *set_args(corpus, "train.micro_batch=2", "train.max_steps=3", "train.eval_every=0",
                        "parallel.strategy=ddp")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per rank: 2 ranks on 2 cores
    nodes = [subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    for node in nodes:
        _, stderr = node.communicate(timeout=300)
        assert node.returncode == 0, stderr[-3000:]
    per_rank = json.loads((run / "verify.json").read_text())["per_rank"]
    assert per_rank["strategy"] == "ddp" and per_rank["world_size"] == 2 and len(per_rank["ranks"]) == 2
    assert len(losses(run)) == 3 and (run / "checkpoints" / "step_00000003").is_dir()


@pytest.mark.slow
def test_torchrun_restarting_its_ranks_after_a_kill_continues_the_run(corpus, tmp_path):
    """torchrun --max-restarts relaunches every rank with the same command after one dies: each rank
    decides on its own to continue from the last checkpoint, and the run ends with the losses of an
    uninterrupted one."""
    extra = ("train.micro_batch=2", "train.max_steps=10", "train.eval_every=0", "train.checkpoint_every=2",
             "parallel.strategy=ddp")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "--max-restarts", "1", "-m", "trainwise", "train", "--quiet"]
    # torchrun (torch >= 2.5) shares its rendezvous TCPStore with the ranks across restarts; the restarted
    # ranks' gloo group then reads the dead ranks' addresses from it ("connectFullMesh failed"; NCCL alike,
    # pytorch/pytorch#135712). One store per round, as before 2.5, fixes it.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    straight = tmp_path / "straight"
    done = subprocess.run([*launch, "--out", str(straight), *set_args(corpus, *extra)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    proc = subprocess.Popen([*launch, "--out", str(run), *set_args(corpus, *extra)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    while proc.poll() is None and not (run / "checkpoints" / "step_00000004").is_dir():
        time.sleep(0.01)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    os.kill(max(int(w) for w in workers), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert losses(run) == pytest.approx(losses(straight), rel=1e-6)
