"""The operator list of one training step: every aten op the trainer runs, with FLOPs and bytes.

One list serves the roofline (`trainwise roofline`) and the step-time model (cost.steptime): one FLOP
count, one byte count. It is recorded by running the trainer's own step on fake tensors
(trainwise.measure.record); here is what a record holds and the pure views of a list: each operator's
class (matmul, attention, norm, ...), the kernels a CUDA device runs instead of the CPU ones, the
roofline's per-name sums.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

CLASSES = (("attention", ("attention",)), ("matmul", ("mm", "bmm", "addmm", "baddbmm")),
           ("norm", ("rsqrt", "layer_norm", "pow", "mean", "rms")),
           ("softmax/cross-entropy", ("softmax", "nll_loss", "log_softmax")),
           ("activation", ("silu", "gelu", "relu")),
           ("optimizer", ("_fused_adam", "_fused_sgd", "_foreach", "lerp", "addcdiv", "addcmul", "sqrt")))
PHASES = ("forward", "backward", "optimizer")
# Autocast's cast of a parameter to the compute dtype (measure.record names it apart from other casts): a stack
# whose mixed-precision policy gathers the parameters in the compute dtype (FSDP2, FSDP1's param_dtype) runs
# none, its step recorded on 16-bit weights (cost.recipe.Recipe.record_precision).
WEIGHT_CAST = "aten._to_copy(weight)"
# The data-parallel strategies whose parameters FSDP2 gathers for each pass (trainwise's zero2 and fsdp; ZeRO-3
# elsewhere): under a mixed-precision policy in the compute dtype, its step recorded on 16-bit weights.
GATHERED = ("zero2", "fsdp")


def op_class(name: str) -> str:
    short = name.split(".")[1] if "." in name else name
    for cls, keys in CLASSES:
        if any(k in short for k in keys):
            return cls
    return "elementwise/other"


@dataclass(frozen=True)
class Op:
    """Calls of one aten op in one phase with one dtype and one shape: a matmul's (batch, M, K, N), an
    attention kernel's (batch, heads, kv heads, T, head dim); any other op's calls all move the same
    bytes per call (the time model prices element-wise work by its size: in cache, from memory, or
    written to fresh pages)."""

    name: str
    cls: str
    phase: str
    dtype: str  # "fp32" | "bf16" | "fp16" | "other": of the first floating-point input
    shape: tuple[int, ...] | None
    calls: int
    flops: float  # all calls together
    bytes: float  # all calls together
    layout: str = ""  # a matmul's operands: N (row-major) or T (transposed) each, e.g. "NT" for x @ W.t()
    kernel: str = ""  # an attention op's implementation on a GPU (cost.gpu.attention_rate); "": flash
    # Bytes of all calls when a fusing stack runs the step (Transformer Engine's and Megatron's fused kernels,
    # torch.compile): only tensors that must be in memory are read and written (measure.record: a matmul's or
    # attention's operand or result, a tensor kept for another phase, a step output); None: as `bytes`.
    fused: float | None = None
    # Of `bytes` and `fused`, what does not grow with the micro-batch (weight-sized work: a weight's cast, a
    # gradient's; measure.record._fixed_bytes), for pricing the op at another micro-batch size (cost.steptime
    # .scale_batch). 0 where not recorded.
    fixed: float = 0.0
    fused_fixed: float = 0.0

    def scaled(self, factor: int) -> Op:
        return replace(self.resized(factor, factor), calls=self.calls * factor)

    def resized(self, flops: float, nbytes: float) -> Op:
        """The same calls doing `flops` x the FLOPs and moving `nbytes` x the bytes (fused bytes too)."""
        return replace(self, flops=self.flops * flops, bytes=self.bytes * nbytes,
                       fused=None if self.fused is None else self.fused * nbytes, fixed=self.fixed * nbytes,
                       fused_fixed=self.fused_fixed * nbytes)

    def batched(self, factor: float) -> Op:
        """The same calls on a micro-batch `factor` x as large: FLOPs and the bytes that grow with the tokens
        scale, the fixed bytes stay (the shape is the caller's: cost.steptime.scale_batch)."""
        grow = lambda total, fixed: fixed + (total - fixed) * factor  # noqa: E731
        return replace(self, flops=self.flops * factor, bytes=grow(self.bytes, self.fixed),
                       fused=None if self.fused is None else grow(self.fused, self.fused_fixed))

    def moved(self, fused: bool) -> float:
        """Bytes of all calls, eager or under a fusing stack."""
        return self.fused if fused and self.fused is not None else self.bytes

    def per_call_bytes(self) -> float:
        return self.bytes / self.calls if self.calls else 0.0


# The kernels a CUDA device runs instead of the CPU ones the fake step records (the trainer's choices:
# SDPA picks flash attention; runtime.optim.build_optimizer picks fused AdamW on CUDA).
CUDA_KERNELS = {
    "aten._scaled_dot_product_flash_attention_for_cpu": "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": "aten._scaled_dot_product_flash_attention_backward",
}


def for_cuda(ops: list[Op]) -> list[Op]:
    """The same step as a CUDA device runs it: flash attention kernels, and the optimizer's foreach ops
    as one fused AdamW update (same bytes; one kernel per parameter group, here counted as one call)."""
    out, fused = [], None
    for op in ops:
        if op.phase == "optimizer" and op.cls == "optimizer":
            fused = [op.flops, op.bytes] if fused is None else [fused[0] + op.flops, fused[1] + op.bytes]
            continue
        name = CUDA_KERNELS.get(op.name, op.name)
        out.append(replace(op, name=name, cls=op_class(name)))
    if fused is not None:
        out.append(Op("aten._fused_adamw_", "optimizer", "optimizer", "fp32", None, 2, fused[0], fused[1]))
    return sorted(out, key=lambda o: -o.flops)


def by_name(ops: list[Op]) -> dict[str, list[float]]:
    """{op name: [calls, FLOPs, bytes]} over phases, dtypes and shapes (the roofline's view)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for op in ops:
        rec = out[op.name]
        rec[0] += op.calls
        rec[1] += op.flops
        rec[2] += op.bytes
    return dict(out)
