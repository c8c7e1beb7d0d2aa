"""Optional Weights & Biases logging (`--set log.wandb=true`): the rows of metrics.jsonl, beside TensorBoard.

The loop hands the same dict it writes to metrics.jsonl to `log`, so W&B, TensorBoard and the JSON lines
never disagree; the names are TensorBoard's tags (loss/train, loss/val, throughput/mfu, ...). The config
goes in as the W&B run config, so W&B's own run table can sort and group by any key. Files go to
DIR/wandb/. Without a network (or an account) set WANDB_MODE=offline: the run is kept on disk and
`wandb sync DIR/wandb/offline-run-*` uploads it later.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from trainwise.config import RunConfig, config_to_dict
from trainwise.errors import TrainwiseError
from trainwise.report.tensorboard import TAGS


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
        self.run = wandb.init(project=cfg.log.wandb_project, name=run_dir.resolve().name, dir=str(run_dir),
                              id=id_file.read_text(encoding="utf-8").strip(), resume="allow",
                              config=config_to_dict(cfg))  # WANDB_MODE etc. are read by wandb itself

    def log(self, row: dict) -> None:
        """One metrics.jsonl row: every numeric field at x = the row's optimizer step."""
        values = {TAGS.get(key, f"other/{key}"): value for key, value in row.items()
                  if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        self.run.log(values, step=row["step"])

    def close(self) -> None:
        self.run.finish()
