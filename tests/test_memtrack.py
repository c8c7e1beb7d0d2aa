"""Planner memory vs tracked memory of real CPU steps: states within 1%, peak within 10%."""

import pytest
import torch

from trainwise.config import ModelConfig, TrainConfig
from trainwise.cost.plan import plan_run
from trainwise.measure.memtrack import track_train_step
from trainwise.measure.step import random_batches, train_step
from trainwise.model import Transformer
from trainwise.train.optim import build_optimizer
from trainwise.train.parallelize import apply_activation_checkpointing

CPU = torch.device("cpu")
SIZES = {"xs": dict(d_model=32, n_layers=1), "s": dict(d_model=64, n_layers=2), "m": dict(d_model=96, n_layers=3)}


def measure(size: str, precision: str, checkpointing: str, micro_batch: int, seq_len: int = 32):
    cfg = ModelConfig(vocab_size=512, n_heads=4, n_kv_heads=2, max_seq_len=seq_len, **SIZES[size])
    return track_vs_plan(cfg, precision, checkpointing, micro_batch, seq_len)


def track_vs_plan(cfg: ModelConfig, precision: str, checkpointing: str, micro_batch: int, seq_len: int):
    """(plan, tracked memory) of one real CPU training step of `cfg` (after a step that creates the
    optimizer states)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    if checkpointing != "none":
        apply_activation_checkpointing(model, checkpointing)
    opt = build_optimizer(model, TrainConfig())
    batches = random_batches(cfg.vocab_size, micro_batch, seq_len, 1, CPU)
    train_step(model, opt, batches, CPU, precision)  # optimizer states exist from here on
    tracked = track_train_step(model, opt, batches, CPU, precision)
    plan = plan_run(cfg, tokens=1, seq_len=seq_len, micro_batch=micro_batch, peak_flops=1e12,
                    precision="fp32" if precision == "fp32" else "amp", checkpointing=checkpointing)
    return plan, tracked


def check(plan, tracked):
    s = plan.states
    assert tracked.params == pytest.approx(s.params, rel=0.01)
    assert tracked.grads == pytest.approx(s.grads, rel=0.01)
    assert tracked.optimizer == pytest.approx(s.optimizer, rel=0.01)
    assert tracked.peak_bytes == pytest.approx(plan.peak_bytes, rel=0.10)


@pytest.mark.parametrize("precision,checkpointing", [("fp32", "none"), ("bf16", "full")])
def test_grid_slice(precision, checkpointing):
    check(*measure("s", precision, checkpointing, 2))


@pytest.mark.slow
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("micro_batch", [1, 4])
def test_memory_grid(size, precision, checkpointing, micro_batch):
    check(*measure(size, precision, checkpointing, micro_batch))
