"""One training step exactly as `trainwise.train.loop` runs it, for the measurement tools to observe.

    for each of K micro-batches:  loss = model(x, y) under autocast;  (loss / K).backward()
    clip the gradient norm;  optimizer.step();  zero the gradients (set to None)
    (fp16: the loss scaled by a GradScaler, unscaled before clipping, scaler.step and update)

Hooks let a caller look at the step between its phases (memory after forward, after backward, ...)
without copying the loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainwise.train.precision import autocast

Hook = Callable[[str], None]


def _no_hook(phase: str) -> None:
    pass


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
               batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, precision: str,
               grad_clip: float = 1.0, hook: Hook = _no_hook, scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
    """Run forward+backward over `batches` (the K micro-batches), then clip and step. Returns the mean
    loss as a tensor (no .item(): the step also runs on fake tensors). `hook(phase)` is called after "forward" and "backward" of each micro-batch and after "step"."""
    k = len(batches)
    total = None
    for x, y in batches:
        with autocast(device, precision):
            loss = model(x, y)
        hook("forward")
        (loss / k if scaler is None else scaler.scale(loss / k)).backward()
        total = loss.detach() if total is None else total + loss.detach()
        del loss
        hook("backward")
    if optimizer is not None:
        params = [p for p in model.parameters() if p.grad is not None]
        if scaler is not None:  # fp16: unscale before clipping; the scaler skips a step with inf/NaN
            scaler.unscale_(optimizer)
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        hook("step")
        optimizer.zero_grad(set_to_none=True)
    return total / k


def random_batches(vocab_size: int, micro_batch: int, seq_len: int, grad_accum: int, device: torch.device,
                   seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K seeded (x, y) batches of token ids; FLOPs and memory depend only on their shapes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(grad_accum):
        ids = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), generator=g)
        out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out
