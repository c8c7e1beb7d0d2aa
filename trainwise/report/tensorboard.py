"""Optional TensorBoard logging (`--set log.tensorboard=true`): the rows of metrics.jsonl, as scalars.

The same dict that the loop writes to metrics.jsonl is passed to `log`, so TensorBoard and the JSON
lines can never disagree. Events go to DIR/tensorboard/; view them with `tensorboard --logdir DIR`.
"""

from __future__ import annotations

from pathlib import Path

from trainwise.errors import TrainwiseError

# metrics.jsonl key -> TensorBoard tag; grouped so that train and validation loss share a panel
TAGS = {"loss": "loss/train", "val_loss": "loss/val", "lr": "optim/lr", "grad_norm": "optim/grad_norm",
        "val_bpb": "bpb/val", "tokens_per_s": "throughput/tokens_per_s", "flops_per_s": "throughput/flops_per_s",
        "mfu": "throughput/mfu", "hfu": "throughput/hfu", "step_time_s": "throughput/step_time_s",
        "tokens": "progress/tokens", "skipped_steps": "progress/skipped_steps"}


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
        """One metrics.jsonl row: every numeric field at x = the row's optimizer step."""
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(TAGS.get(key, f"other/{key}"), value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
