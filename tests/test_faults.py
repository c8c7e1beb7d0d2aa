"""Runs that survive: kills, corrupt and malicious checkpoints, full disks, non-finite steps."""

import json
import os
import pickle
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_relaunch import rows
from tiny import set_args

from trainwise import rundir
from trainwise.api import load
from trainwise.cli import main
from trainwise.errors import TrainwiseError
from trainwise.runtime import checkpoint as ckpt

FAULTS = ["train.micro_batch=4", "train.eval_every=0", "model.dropout=0.1"]


def sets(corpus: Path, *extra: str) -> list[str]:
    return set_args(corpus, *FAULTS, *extra)


def weights(run: Path, step: int) -> dict:
    return load_file(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors")


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "done"
    assert main(["train", "--out", str(out), "--quiet", *sets(corpus, "train.max_steps=6")]) == 0
    return out


def sigkill_trials(corpus: Path, tmp_path: Path, trials: int, max_steps: int, seed: int) -> None:
    """Kill a run with SIGKILL at random moments (during checkpoint writes too: one every step),
    resume after each kill, and end with weights bitwise equal to an uninterrupted run."""
    extra = (f"train.max_steps={max_steps}", "train.checkpoint_every=1", "train.keep_checkpoints=2")
    straight = tmp_path / "straight"
    assert main(["train", "--out", str(straight), "--quiet", *sets(corpus, *extra)]) == 0
    run = tmp_path / "killed"
    rng = random.Random(seed)
    cmd = [sys.executable, "-m", "trainwise", "train", "--quiet"]
    first = True
    for _ in range(trials):
        args = cmd + (["--out", str(run), *sets(corpus, *extra)] if first else ["--resume", str(run)])
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Start-up (the imports alone) takes seconds, a step and its checkpoint a fraction of one: the kill
        # comes at a random moment after the run logs its next step, so it lands in a step or in a checkpoint
        # write (every step saves), not in the interpreter's start-up.
        logged, deadline = rows(run), time.monotonic() + 60
        while rows(run) == logged and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.25))
        proc.kill()
        proc.wait()
        first = first and not (run / "config.toml").exists()
    final = subprocess.run(cmd + ["--resume", str(run)] if not first else
                           cmd + ["--out", str(run), *sets(corpus, *extra)], capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    a, b = weights(straight, max_steps), weights(run, max_steps)
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses == [json.loads(x)["loss"] for x in (straight / "metrics.jsonl").read_text().splitlines()]


def test_sigkill_at_random_moments_then_resume_is_bitwise_exact(corpus, tmp_path):
    sigkill_trials(corpus, tmp_path, trials=2, max_steps=30, seed=0)


@pytest.mark.slow
def test_sigkill_twenty_trials(corpus, tmp_path):
    sigkill_trials(corpus, tmp_path, trials=20, max_steps=150, seed=1)


def test_half_written_checkpoint_is_ignored_with_a_warning(finished_run, tmp_path):
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished_run), str(run)], check=True)
    half = run / "checkpoints" / ".tmp-step_00000099-123"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.warns(UserWarning, match="half-written"):
        assert rundir.latest_checkpoint(run).name == "step_00000006"
    load(run)  # still loadable


def test_bit_flipped_checkpoint_is_refused(finished_run, tmp_path):
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished_run), str(run)], check=True)
    weights_file = run / "checkpoints" / "step_00000006" / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights_file.write_bytes(bytes(data))
    with pytest.raises(TrainwiseError, match="SHA-256"):
        load(run)
    code = main(["train", "--resume", str(run), "--max-steps", "8", "--quiet"])
    assert code == 2


def test_truncated_checkpoint_is_refused(finished_run, tmp_path):
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished_run), str(run)], check=True)
    opt = run / "checkpoints" / "step_00000006" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[:100])
    with pytest.raises(TrainwiseError, match="truncated or corrupted"):
        ckpt.verify_checkpoint(opt.parent)


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['EXPLOIT_MARKER']}",))


def test_checkpoint_crafted_to_run_code_is_refused(finished_run, tmp_path, monkeypatch):
    """A pickle that would run a shell command on load, with a manifest forged to match it."""
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished_run), str(run)], check=True)
    marker = tmp_path / "pwned"
    monkeypatch.setenv("EXPLOIT_MARKER", str(marker))
    step_dir = run / "checkpoints" / "step_00000006"
    with open(step_dir / "optimizer.pt", "wb") as f:
        pickle.dump({"state": _Exploit()}, f)
    torch.save({"state": {}, "param_groups": [], "x": _Exploit()}, step_dir / "rng.pt")
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for name in ("optimizer.pt", "rng.pt"):
        manifest["files"][name] = {"sha256": ckpt._sha256(step_dir / name), "bytes": (step_dir / name).stat().st_size}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    model = load(run).model
    with pytest.raises(TrainwiseError, match="refusing to load"):
        ckpt.load_checkpoint(step_dir, model)
    assert not marker.exists()
    assert main(["train", "--resume", str(run), "--max-steps", "8", "--quiet"]) == 2
    assert not marker.exists()


def test_tokenizer_that_does_not_match_the_checkpoint_is_refused(finished_run, tmp_path, corpus):
    from trainwise.tokenizer import Tokenizer

    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished_run), str(run)], check=True)
    Tokenizer.train([corpus.read_text()], vocab_size=1000).save(run / "tokenizer.json")
    with pytest.raises(TrainwiseError, match="does not belong"):
        load(run)
    assert main(["train", "--resume", str(run), "--max-steps", "8", "--quiet"]) == 2


def test_incompatible_config_is_refused(finished_run, tmp_path):
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished_run), str(run)], check=True)
    text = (run / "config.toml").read_text().replace("d_model = 32", "d_model = 64")
    (run / "config.toml").write_text(text)
    with pytest.raises(TrainwiseError, match="different \\[model\\] config"):
        load(run)


def test_disk_full_while_saving_keeps_the_previous_checkpoint(finished_run, tmp_path):
    """The kernel refuses writes past RLIMIT_FSIZE (EFBIG), like a full disk refuses them (ENOSPC)."""
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(finished_run), str(run)], check=True)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints" / "step_00000006").iterdir()}

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    proc = subprocess.run([sys.executable, "-m", "trainwise", "train", "--resume", str(run), "--max-steps", "8",
                           "--quiet"], capture_output=True, text=True, preexec_fn=limit)
    assert proc.returncode == 2, proc.stderr
    assert "could not write checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    after = {p.name: p.read_bytes() for p in (run / "checkpoints" / "step_00000006").iterdir()}
    assert after == before
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000006"]
    load(run)


def test_nonfinite_steps_are_skipped_and_never_saved(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--quiet", *sets(corpus, "train.max_steps=6", "train.lr=1e30",
                                                                   "train.grad_clip=0")]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1].get("skipped_steps", 0) >= 1
    for tensor in weights(out, 6).values():
        assert torch.isfinite(tensor).all()


def test_nonfinite_stop_names_the_step(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--out", str(out), "--quiet", *sets(corpus, "train.max_steps=6", "train.lr=1e30",
                                                              "train.grad_clip=0", "train.on_nonfinite=stop")])
    assert code == 2
    assert "non-finite values at step" in capsys.readouterr().err


def test_keep_best_spares_the_checkpoint_with_the_lowest_validation_loss(corpus, tmp_path):
    out = tmp_path / "run"
    # a learning rate that first helps and then hurts, so the best checkpoint is not the last one
    args = sets(corpus, "train.max_steps=12", "train.eval_every=2", "train.eval_steps=2", "train.keep_best=true",
                "train.keep_checkpoints=1", "train.checkpoint_every=0", "train.warmup_steps=1", "train.lr=0.3",
                "train.min_lr=0.3")
    assert main(["train", "--out", str(out), "--quiet", *args]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    best_step = min(evals, key=evals.get)
    best = rundir.best_checkpoint(out)
    assert best["step"] == best_step and best["val_loss"] == evals[best_step]
    kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert f"step_{best_step:08d}" in kept and "step_00000012" in kept
    assert len(kept) == (1 if best_step == 12 else 2)
