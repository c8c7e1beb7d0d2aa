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


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (torchtitan's per-block compile): the state dict keys stay the
    same, repeated blocks share one compiled graph, and fusing the norm/RoPE/activation element-wise
    work is where the speed comes from. The first steps pay the compile time."""
    for block in model.blocks:
        block.compile()


def remove_compile(model: nn.Module) -> None:
    """Back to eager blocks, e.g. before KV-cache generation, whose growing cache would recompile."""
    for block in model.blocks:
        block._compiled_call_impl = None
