"""Optimizers and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainwise.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases and embeddings keep weight_decay 0 (as in GPT-3 / Llama
    practice), since shrinking a gain or an embedding row towards zero is not regularisation. A tied
    table is the embedding, also where the last pipeline stage holds it as its LM head (runtime.pipeline)."""
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = "embed" in name or (tied and name == "lm_head.weight")
        (decay if p.ndim >= 2 and not is_embedding else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # A fused or foreach kernel takes the tensors of one kind in a call: plain tensors, or DTensors on one mesh.
    # Where kinds meet (divided experts beside the dense weights DDP or replicate holds, runtime.expert_parallel)
    # each kind gets groups of its own, in order of first appearance (the same on every rank)
    split = []
    for group in groups:
        kinds: dict = {}
        for p in group["params"]:
            kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        split += [{**group, "params": kind} for kind in kinds.values()] if len(kinds) > 1 else [group]
    return split


def build_optimizer(model: nn.Module, cfg: TrainConfig, shard_states: bool = False) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay (Loshchilov & Hutter 2019) or SGD with momentum. The fused
    kernels (CUDA and CPU) do each parameter's whole update in one pass over it and take step_if_finite's
    skip flag; foreach makes ~10 passes over all parameters (one per multi-tensor op), which cost 2-5x the
    fused step on a CPU (benchmarks/RESULTS.md). shard_states (ZeRO-1, under torchrun):
    torch.distributed.optim.ZeroRedundancyOptimizer keeps each parameter's states on one rank only and
    broadcasts the updated parameters after the step."""
    groups = param_groups(model, cfg.weight_decay)
    devices = {p.device.type for group in groups for p in group["params"]}
    kernel = {"fused": True} if devices <= {"cuda", "cpu"} else {"foreach": True}
    if cfg.optimizer == "sgd":
        cls, kwargs = torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.momentum, **kernel)
    else:
        cls, kwargs = torch.optim.AdamW, dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kernel)
    if shard_states:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)
    return cls(groups, **kwargs)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states and runs the update (ZeRO-1 wraps one)."""
    return getattr(optimizer, "optim", optimizer)


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
    """optimizer.step(), except that weights, moments and step counts stay as they were when grad_norm
    is NaN or inf. A fused optimizer decides on the device: its kernels take a found_inf flag (the
    mechanism GradScaler uses for fp16), so the step loop never waits for a GPU to learn whether to
    step. Otherwise (foreach, on CPU) the norm is read on the host, which on a CPU waits for nothing.
    Returns the flag as a 0-dim fp32 tensor on grad_norm's device, 1.0 = skipped."""
    found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
    local = local_optimizer(optimizer)
    if local.defaults.get("fused"):
        local.found_inf = found_inf
        try:
            optimizer.step()
        finally:
            del local.found_inf
    elif not found_inf.item():
        optimizer.step()
    return found_inf


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup from lr/warmup to lr over warmup_steps, then cosine decay to min_lr at max_steps.
    `step` counts optimizer steps from 0."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
