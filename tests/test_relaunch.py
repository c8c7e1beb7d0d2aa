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
from tiny import set_args

from trainwise.cli import main
from trainwise.config import save_config

STEPS = 12
RUN = ("train.micro_batch=4", "train.eval_every=0", "model.dropout=0.1", f"train.max_steps={STEPS}")


def command(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainwise", "train", "--out", str(out), *set_args(corpus, *RUN, *extra)]


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_weights(run: Path) -> dict:
    return load_file(run / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors")


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


def test_sigkilled_runs_relaunched_with_the_same_command_end_bitwise_equal(corpus, tmp_path, capsys):
    """Run A is killed before its first checkpoint: the same command again starts it over from step 0,
    so A is an uninterrupted run, whatever half state the kill left. Run B is killed after a checkpoint:
    the same command again resumes it, and B ends bitwise equal to A (losses and weights; saving more
    often changes no number, and dropout is on, so every RNG state must be restored)."""
    a = tmp_path / "a"
    cmd_a = command(corpus, a, "train.checkpoint_every=0")  # no checkpoint before the last step
    kill_when(cmd_a, lambda: rows(a) >= 2)
    assert (a / "config.toml").is_file() and not list((a / "checkpoints").glob("step_*"))
    # the half state a kill can leave: a torn metrics row, a checkpoint save cut off mid-way
    with open(a / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    half = a / "checkpoints" / ".tmp-step_00000003-99999"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"\0" * 64)
    assert main(cmd_a[3:]) == 0  # the same command line, in this process this time (saves a start-up)
    assert "starting again from step 0" in capsys.readouterr().out
    assert not half.exists() and [json.loads(r)["step"] for r in (a / "metrics.jsonl").read_text().splitlines()] \
        == list(range(1, STEPS + 1))

    b = tmp_path / "b"
    cmd_b = command(corpus, b, "train.checkpoint_every=3")
    kill_when(cmd_b, lambda: (b / "checkpoints" / "step_00000003").is_dir())
    saved = sorted(p.name for p in (b / "checkpoints").glob("step_*"))
    assert saved and saved[-1] < f"step_{STEPS:08d}"
    again = subprocess.run(cmd_b, capture_output=True, text=True)  # the very same command line
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed {b} from {saved[-1]}" in again.stdout

    assert losses(b) == losses(a)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_another_config_is_refused_naming_the_keys_and_policies_hold(corpus, tmp_path, capsys):
    """Only DIR/config.toml decides (nothing else is read before the refusal), so a saved config is the
    whole fixture: a run of it, as `train` resolves and writes it."""
    from trainwise.cli import build_parser
    from trainwise.commands.train import build_config

    run = tmp_path / "run"
    run.mkdir()
    args = command(corpus, run)[3:] + ["--quiet"]
    save_config(build_config(build_parser(args).parse_args(args)), run / "config.toml")
    assert main(args + ["--set", "train.lr=0.01", "--set", "model.n_layers=3", "--set", "train.max_steps=99"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "different config" in err and "2 key(s) differ" in err  # max_steps may change, as with --resume
    assert "train.lr 0.01 vs 0.002" in err and "model.n_layers 3 vs 2" in err and f"--resume {run}" in err
    assert main(args + ["--set", "train.resume=never"]) == 2
    assert "train.resume = never" in " ".join(capsys.readouterr().err.split())
    assert main(command(corpus, tmp_path / "new", "train.resume=always")[3:] + ["--quiet"]) == 2
    assert "holds no trainwise run" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "new").exists() and [p.name for p in run.iterdir()] == ["config.toml"]


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
