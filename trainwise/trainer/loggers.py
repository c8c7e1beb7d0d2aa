"""Where a run's metrics rows go: metrics.jsonl, and optionally TensorBoard and Weights & Biases.

The loop hands every row to one `RunLog`, which writes it to each sink it opened, so metrics.jsonl,
TensorBoard and W&B can never disagree. TensorBoard (`--set log.tensorboard=true`) writes events to
DIR/tensorboard/ (view them with `tensorboard --logdir DIR`); W&B (`--set log.wandb=true`) logs to
project `log.wandb_project` with the run's config as the W&B run config, files in DIR/wandb/ (without a
network set WANDB_MODE=offline: `wandb sync DIR/wandb/offline-run-*` uploads it later). Both use the
tags below, grouped so that train and validation loss share a panel.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from trainwise import rundir
from trainwise.config import RunConfig, config_to_dict
from trainwise.errors import TrainwiseError

# metrics.jsonl key -> TensorBoard / W&B tag
TAGS = {"loss": "loss/train", "val_loss": "loss/val", "lr": "optim/lr", "grad_norm": "optim/grad_norm",
        "val_bpb": "bpb/val", "tokens_per_s": "throughput/tokens_per_s", "flops_per_s": "throughput/flops_per_s",
        "mfu": "throughput/mfu", "hfu": "throughput/hfu", "step_time_s": "throughput/step_time_s",
        "tokens": "progress/tokens", "skipped_steps": "progress/skipped_steps"}


def scalars(row: dict) -> dict[str, float]:
    """{tag: value} of a metrics row's numeric fields (the step is the x axis, not a scalar)."""
    return {TAGS.get(key, f"other/{key}"): value for key, value in row.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoardLogger:
    def __init__(self, run_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrainwiseError(
                "log.tensorboard = true needs the tensorboard package: pip install 'trainwise[tensorboard]' "
                "(or pip install tensorboard), or set log.tensorboard=false."
            ) from None
        self.log_dir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, row: dict) -> None:
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def require_wandb():
    """The wandb module, or a TrainwiseError saying how to install it (train() asks before it writes)."""
    try:
        import wandb
    except ImportError:
        raise TrainwiseError(
            "log.wandb = true needs the wandb package: pip install 'trainwise[wandb]' (or pip install "
            "wandb), or set log.wandb=false."
        ) from None
    return wandb


class WandbLogger:
    def __init__(self, run_dir: str | Path, cfg: RunConfig):
        wandb = require_wandb()
        run_dir = Path(run_dir)
        log_dir = run_dir / "wandb"
        log_dir.mkdir(exist_ok=True)
        # One W&B run per run directory: a resumed training continues the W&B run it started.
        id_file = log_dir / "trainwise-run-id"
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(8), encoding="utf-8")  # W&B ids: [a-z0-9]
        try:
            self.run = wandb.init(project=cfg.log.wandb_project, name=run_dir.resolve().name, dir=str(run_dir),
                                  id=id_file.read_text(encoding="utf-8").strip(), resume="allow",
                                  config=config_to_dict(cfg))  # WANDB_MODE etc. are read by wandb itself
        except wandb.errors.UsageError as err:  # no API key, most often: the user's to fix, and said so
            raise TrainwiseError(f"log.wandb = true, and W&B did not start: {str(err).rstrip('.')}. Run `wandb "
                                 "login`, or set WANDB_MODE=offline to keep the W&B run in the run directory, or set "
                                 "log.wandb=false; then run the same command again.") from None

    def log(self, row: dict) -> None:
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


class MetricsFile:
    """DIR/metrics.jsonl, appended one JSON row per log step (flushed: a killed run keeps its rows)."""

    def __init__(self, run_dir: Path):
        self.file = open(Path(run_dir) / rundir.METRICS, "a", encoding="utf-8")

    def log(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class RunLog:
    """The fan-out: each row to metrics.jsonl and to the trackers the config turns on. Rank 0 logs;
    on the other ranks (`enabled` False) it holds no sink. Use as a context manager."""

    def __init__(self, run_dir: Path, cfg: RunConfig, enabled: bool = True):
        self.sinks = []
        if not enabled:
            return
        try:
            self.sinks.append(MetricsFile(run_dir))
            if cfg.log.tensorboard:
                self.sinks.append(TensorBoardLogger(run_dir))
            if cfg.log.wandb:
                self.sinks.append(WandbLogger(run_dir, cfg))
        except BaseException:
            self.close()
            raise

    def log(self, row: dict) -> None:
        for sink in self.sinks:
            sink.log(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
