"""Wrappers applied to a built model from outside: activation checkpointing (and, later, sharding).

The model does not know about them (torchtitan's "parallelize" step): its state dict keys stay the same,
so checkpoints load with or without them.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward):
    def run(*args, **kwargs):
        # use_reentrant=False: works with keyword arguments, and with inputs that need no grad.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """full: keep only each block's input and recompute the block in backward.
    selective: recompute only the attention core (softmax(q k^T) v), as in Korthikanti et al. 2022."""
    for block in model.blocks:
        if mode == "full":
            block.forward = _checkpointed(block.forward)
        else:
            block.attn.core = _checkpointed(block.attn.core)
