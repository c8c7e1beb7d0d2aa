"""The one FLOP counter: `torch.utils.flop_counter.FlopCounterMode` plus the formulas it lacks.

PyTorch counts matmuls (mm, addmm, bmm, baddbmm, conv) and the CUDA SDPA kernels, but counts 0 for
`_scaled_dot_product_flash_attention_for_cpu` (the CPU SDPA kernel, also used under enable_gqa) and its
backward, and for `_grouped_mm` (the MoE experts' kernel). We add those, to this counter only (torch's
global registry is left as it is). Convention (docs/ARCHITECTURE.md, "Counting FLOPs, MFU and HFU"; the
planner's `cost.flops`): model FLOPs count matmuls only, attention scores and values not halved for causal
masking, backward = 2 x forward. So the attention backward is counted as the four matmuls it needs
(dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q); PyTorch's own formula for the flash backward also counts
the kernel re-computing Q K^T (a fifth matmul), which is hardware work, not model work; we override it on
every SDPA backward so the CPU and CUDA paths count the same.

With activation checkpointing the recomputed forward runs inside backward and is counted: a step's
count is then hardware FLOPs (HFU), and model FLOPs are the count without checkpointing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from trainwise.runtime.step import TrainingStep

aten = torch.ops.aten


def sdpa_forward_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """softmax(Q K^T) V: 2 B nh T S d_qk + 2 B nh T S d_v (GQA: kv heads broadcast to nh)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                        **kwargs) -> int:
    """Four matmuls of the forward's sizes: 2 x forward (model FLOPs; no score recompute)."""
    return 2 * sdpa_flop_count(query_shape, key_shape, value_shape)


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch._grouped_mm (the MoE experts' kernel), which torch's counter has no formula for: 2 x rows x
    K x N. (S, K) x (E, K, N) and (K, S) x (S, N) with groups along S (its backward) are 2SKN;
    (E, M, K) x (E, K, N) is a batched matmul."""
    if len(a_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[-1]
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


# Formulas added to (or replacing) torch's registry; keyed by OpOverloadPacket as torch's registry is.
EXTRA_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: sdpa_forward_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flops,
    aten._scaled_dot_product_flash_attention_backward: sdpa_backward_flops,
    aten._scaled_dot_product_efficient_attention_backward: sdpa_backward_flops,
    aten._scaled_dot_product_cudnn_attention_backward: sdpa_backward_flops,
    **({aten._grouped_mm: grouped_mm_flops} if hasattr(aten, "_grouped_mm") else {}),
}


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode with trainwise's formulas; use as a context manager."""
    return FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS)


@dataclass
class FlopCount:
    """FLOPs of what ran inside the counter: total and per operator (aten op name -> FLOPs)."""

    total: int
    by_op: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_counter(cls, counter: FlopCounterMode) -> FlopCount:
        by_op: dict[str, int] = defaultdict(int)
        for op, flops in counter.get_flop_counts().get("Global", {}).items():
            by_op[str(op)] += int(flops)
        return cls(total=int(counter.get_total_flops()), by_op=dict(by_op))


def count_train_step(step: TrainingStep, batches: list) -> FlopCount:
    """FLOPs of one real training step (K micro-batches forward+backward, clip, optimizer step)."""
    with flop_counter() as counter:
        step(batches)
    return FlopCount.from_counter(counter)


def uncounted_ops(step: TrainingStep, batches: list) -> list[str]:
    """Ops of a forward+backward (`step` built without an optimizer) that look like matmuls or attention
    but have no formula: a check that the counter sees every FLOP-heavy op the model uses."""
    registry = flop_counter().flop_registry
    seen: set = set()

    class _Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func._overloadpacket)
            return func(*args, **(kwargs or {}))

    with _Seen():
        step(batches)
    heavy = ("mm", "bmm", "matmul", "attention", "conv", "linear", "einsum", "baddbmm")
    return sorted(str(op) for op in seen
                  if op not in registry and any(h in str(op).split(".")[-1] for h in heavy))
