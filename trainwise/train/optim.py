"""Optimizers and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainwise.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases and embeddings keep weight_decay 0 (as in GPT-3 / Llama
    practice), since shrinking a gain or an embedding row towards zero is not regularisation."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = "embed" in name
        (decay if p.ndim >= 2 and not is_embedding else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig, shard_states: bool = False) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay (Loshchilov & Hutter 2019) or SGD with momentum, both with
    PyTorch's fused kernels (one launch per parameter group, on CPU and CUDA alike): the fused step
    also takes the on-device skip flag that step_if_finite relies on. shard_states (ZeRO-1, under
    torchrun): torch.distributed.optim.ZeroRedundancyOptimizer keeps each parameter's states on one
    rank only and broadcasts the updated parameters after the step."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        cls, kwargs = torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.momentum, fused=True)
    else:
        cls, kwargs = torch.optim.AdamW, dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)
    if shard_states:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)
    return cls(groups, **kwargs)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states and runs the update (ZeRO-1 wraps one)."""
    return getattr(optimizer, "optim", optimizer)


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
    """optimizer.step(), except that weights, moments and step counts stay as they were when grad_norm
    is NaN or inf, decided on the device: the fused kernels take a found_inf flag (the mechanism
    GradScaler uses for fp16), so the step loop never waits for the device to learn whether to step.
    Returns the flag as a 0-dim fp32 tensor, 1.0 = skipped."""
    found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
    local = local_optimizer(optimizer)
    local.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del local.found_inf
    return found_inf


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup from lr/warmup to lr over warmup_steps, then cosine decay to min_lr at max_steps.
    `step` counts optimizer steps from 0."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
