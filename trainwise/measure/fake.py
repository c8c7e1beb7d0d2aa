"""Running a training step on fake tensors: every tensor has a shape, dtype and device but no storage,
so an 8B-parameter model "trains" one step in a few hundred MB (the operator recorder and
`plan --simulate` run the trainer's step this way).

Two things a fake tensor cannot answer are given values that change nothing of what the step runs:
Adam's step count read as a number (its bias correction), and MoE routing, whose counts depend on the
data: every expert gets an equal share of the tokens (the planner's uniform-routing assumption). One
kernel torch does not give fake tensors, the fused SGD update, is registered here (below).
"""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily


def _balanced_bincount(x: torch.Tensor, weights=None, minlength: int = 0) -> torch.Tensor:
    """MoE routing counts on fake tensors: the tokens' choices are unknown, so every expert gets an equal
    share (the planner's uniform-routing assumption). A real tensor: the step's .tolist() can read it."""
    with unset_fake_temporarily():
        n = x.numel()
        counts = torch.full((minlength,), n // minlength, dtype=torch.int64)
        counts[: n % minlength] += 1
    return counts


def _one(x) -> float:
    return 1.0


def _update_in_place(*args, **kwargs) -> None:
    """The fused SGD update on fake tensors: in place, so nothing to compute, allocate or return."""


# torch registers no Meta kernel for the fused SGD update (it does for Adam's and AdamW's). Without one,
# FakeTensorMode falls back to the CPU kernel on real zero-filled copies of every parameter, gradient and momentum
# buffer: a large model's step would allocate the tens of GB the fake step exists to avoid (or be killed for it).
# The Library object keeps the registration alive for the process.
_FUSED_SGD_META = None
if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_sgd_", "Meta"):
    _FUSED_SGD_META = torch.library.Library("aten", "IMPL")
    for _overload in ("_fused_sgd_", "_fused_sgd_.tensor_lr"):
        _FUSED_SGD_META.impl(_overload, _update_in_place, "Meta")


@contextlib.contextmanager
def fake_step_mode():
    """FakeTensorMode (real inputs allowed) with Adam's step count read as 1 and balanced MoE routing."""
    adam = importlib.import_module("torch.optim.adam")
    with FakeTensorMode(allow_non_fake_inputs=True), mock.patch.object(adam, "_get_value", _one), \
            mock.patch.object(torch, "bincount", _balanced_bincount):
        yield
