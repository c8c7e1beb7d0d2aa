"""The run directory: its file names, creating and checking one, and finding its checkpoints.

    DIR/config.toml        the fully resolved config (re-running it reproduces the run)
    DIR/tokenizer.json     HF tokenizers format (DIR/tokenizer_config.json: an imported tokenizer's own)
    DIR/plan.json          the plan made before training
    DIR/metrics.jsonl      one JSON object per logged step
    DIR/checkpoints/step_XXXXXXXX/   one checkpoint (trainwise.runtime.checkpoint writes and reads them);
                           checkpoints/best.json names the one with the lowest validation loss
    DIR/verify.json        predicted vs measured
    DIR/sample.txt, DIR/report.html

Plain files only: loading a checkpoint into a model is trainwise.runtime.checkpoint and
trainwise.inference.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from trainwise.config import RunConfig, save_config
from trainwise.errors import TrainwiseError
from trainwise.files import write_atomic, write_json_atomic

CONFIG = "config.toml"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
PLAN = "plan.json"
METRICS = "metrics.jsonl"
VERIFY = "verify.json"
SAMPLE = "sample.txt"
REPORT = "report.html"
CHECKPOINTS = "checkpoints"


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")


def is_run_dir(path: Path) -> bool:
    """A directory `trainwise train` created: it has config.toml."""
    return (Path(path) / CONFIG).is_file()


def check_run_dir(out: Path, resume: bool) -> None:
    """A run may resume in `out` (it holds a run) or start there (absent or empty): else TrainwiseError."""
    if resume:
        if not is_run_dir(out):
            raise TrainwiseError(
                f"cannot resume '{out}': it has no config.toml, so it is not a trainwise run directory. "
                "Pass the directory a previous `trainwise train --out DIR` wrote."
            )
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TrainwiseError(
            f"run directory '{out}' already exists and is not empty; nothing was written to it. Continue "
            f"it with `trainwise train --resume {out}` or choose a new --out."
        )


def create_run_dir(out: Path, cfg: RunConfig, tokenizer, plan: dict) -> None:
    """Write config.toml, tokenizer.json (`tokenizer.save(path)`) and plan.json into a hidden directory,
    then rename it to `out`: a run directory either has all three or does not exist."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_config(cfg, tmp / CONFIG)
    tokenizer.save(tmp / TOKENIZER)
    (tmp / PLAN).write_text(json.dumps(plan, indent=1), encoding="utf-8")
    if out.is_dir():  # an existing empty directory (check_run_dir refused a non-empty one)
        out.rmdir()
    os.rename(tmp, out)


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop the metrics rows logged after the checkpoint a run resumes from (a killed run may have logged
    past it)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return
    rows = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for row in rows:
        try:
            if json.loads(row)["step"] <= step:
                kept.append(row)
        except (ValueError, KeyError):
            break  # a torn last line
    if len(kept) != len(rows):
        write_atomic(path, "".join(kept))


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of metrics.jsonl, up to a torn last line."""
    rows = []
    path = Path(run_dir) / METRICS
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line of a run that is still writing
    return rows


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    for leftover in root.glob(".tmp-step_*"):
        warnings.warn(f"ignoring half-written checkpoint {leftover} (a save was interrupted)", stacklevel=2)
    return sorted(p for p in root.glob("step_*") if p.is_dir())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def remove_unfinished(run_dir: Path) -> None:
    """Delete the temporary directories of saves that were killed mid-way (never valid checkpoints), so
    that a run relaunched after a kill does not warn about them again."""
    root = checkpoint_dir(run_dir)
    for leftover in root.glob(".tmp-step_*") if root.is_dir() else ():
        shutil.rmtree(leftover, ignore_errors=True)


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, sparing the best one (best.json) if there is one."""
    if keep <= 0:
        return
    best = best_checkpoint(run_dir)
    for old in list_checkpoints(run_dir)[:-keep]:
        if best is None or old.name != best["name"]:
            shutil.rmtree(old, ignore_errors=True)


def best_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """{"name", "step", "val_loss"} of the best checkpoint by validation loss, if one was marked."""
    try:
        return json.loads((checkpoint_dir(run_dir) / "best.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def mark_best(run_dir: Path, step: int, val_loss: float) -> None:
    """Record step's (already saved) checkpoint as the best one, atomically."""
    path = checkpoint_dir(run_dir) / "best.json"
    write_json_atomic(path, {"name": checkpoint_name(step), "step": step, "val_loss": val_loss}, indent=None)
