"""The operator list of one training step: every aten op the trainer runs, with FLOPs and bytes.

One list serves the roofline (`trainwise roofline`) and the step-time model (cost.time.predict_step):
one FLOP count, one byte count. The step (trainwise.measure.step.train_step, the trainer's own loop)
runs on fake tensors (no memory, no compute) under a dispatch mode that records each op:
FLOPs from the one FLOP counter's formulas (trainwise.measure.flopcount) for matmuls and attention, one
FLOP per output element for everything else; bytes = tensor inputs read + outputs written (no cache
reuse). Each record keeps its phase (forward, backward incl. recompute, optimizer), its dtype and, for
matmuls, its shape, which the time model needs: a skinny matmul runs far below peak.

One micro-batch is recorded; a step of K micro-batches repeats its forward and backward K times.
`compiled=True` records the step as torch.compile runs it on a CPU: attention as two bf16 matmuls
around a softmax (trainwise.model.transformer.explicit_attention) instead of the SDPA kernel.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from dataclasses import dataclass, replace
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CLASSES = (("attention", ("attention",)), ("matmul", ("mm", "bmm", "addmm", "baddbmm")),
           ("norm", ("rsqrt", "layer_norm", "pow", "mean", "rms")),
           ("softmax/cross-entropy", ("softmax", "nll_loss", "log_softmax")),
           ("activation", ("silu", "gelu", "relu")),
           ("optimizer", ("_fused_adam", "_fused_sgd", "_foreach", "lerp", "addcdiv", "addcmul", "sqrt")))
VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "split", "split_with_sizes", "slice",
         "select", "detach", "alias", "unsqueeze", "squeeze", "as_strided", "chunk", "unbind", "reshape",
         "lift_fresh", "empty", "empty_like", "new_empty_strided", "new_empty", "_local_scalar_dense", "randint",
         "empty_strided", "normal_", "arange", "device", "sym_size", "sym_stride", "sym_numel", "dim"}
# Ops that move memory but compute nothing: casts (autocast's copies of weights and activations), copies
# and fills. They cost time like any element-wise op (a bf16 step spends ~10% of its time casting), so
# they are in the list, with bytes and no FLOPs.
COPIES = {"_to_copy", "copy_", "clone", "fill_", "zero_", "zeros", "ones", "zeros_like", "ones_like", "full",
          "new_zeros", "new_ones", "new_full"}
PHASES = ("forward", "backward", "optimizer")


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

    def scaled(self, factor: int) -> Op:
        return replace(self, calls=self.calls * factor, flops=self.flops * factor, bytes=self.bytes * factor)

    def per_call_bytes(self) -> float:
        return self.bytes / self.calls if self.calls else 0.0


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _layout(t: torch.Tensor) -> str:
    """N: the last dimension is contiguous (row-major); T: a transposed view (a weight's .t())."""
    return "N" if t.dim() < 2 or t.stride(-1) == 1 or t.shape[-1] == 1 else "T"


def _shape(name: str, ins: list[torch.Tensor]) -> tuple[tuple[int, ...] | None, str]:
    """(shape, layout) of an operator call: a matmul's (batch, M, K, N) of mm / addmm / bmm / baddbmm from
    its two matrix operands (the last two) and their layout; an attention kernel's (batch, heads, kv heads,
    T, head dim) from q and k; (None, "") for other ops."""
    cls = op_class(name)
    if cls == "attention" and len(ins) >= 3 and ins[0].dim() == 4:
        q, k = ins[1:3] if "backward" in name else ins[:2]  # the backward's first input is the output's gradient
        return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3]), ""
    floats = [x for x in ins if x.is_floating_point()]
    if cls != "matmul" or len(floats) < 2:
        return None, ""
    a, b = floats[-2], floats[-1]
    layout = _layout(a) + _layout(b)
    if "grouped_mm" in name:
        groups = next((x.numel() for x in ins if not x.is_floating_point()), 1)  # the offsets
        if b.dim() == 3:  # (S, K) rows split over E experts' (K, N) weights
            return (b.shape[0], a.shape[0] // b.shape[0], a.shape[1], b.shape[2]), layout
        # (K, S) x (S, N) split along S into E groups: the experts' weight gradients, (E, K, N)
        return (groups, a.shape[0], a.shape[1] // groups, b.shape[1]), layout + ":split-k"
    if a.dim() == 2 and b.dim() == 2:
        return (1, a.shape[0], a.shape[1], b.shape[1]), layout
    if a.dim() == 3 and b.dim() == 3:
        return (a.shape[0], a.shape[1], a.shape[2], b.shape[2]), layout
    return None, ""


def _balanced_bincount(x: torch.Tensor, weights=None, minlength: int = 0) -> torch.Tensor:
    """MoE routing counts on fake tensors: the tokens' choices are unknown, so every expert gets an equal
    share (the planner's uniform-routing assumption). A real tensor: the step's .tolist() can read it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        n = x.numel()
        counts = torch.full((minlength,), n // minlength, dtype=torch.int64)
        counts[: n % minlength] += 1
    return counts


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        from trainwise.measure.flopcount import flop_counter

        self.registry = flop_counter().flop_registry
        self.phase = "forward"
        self.ops: dict[tuple, list] = defaultdict(lambda: [0, 0.0, 0.0])

    def hook(self, phase: str) -> None:  # train_step's hook: called after each phase
        self.phase = {"forward": "backward", "backward": "optimizer"}.get(phase, self.phase)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = str(packet)
        if name.split(".")[-1] in VIEWS:
            return out
        ins = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        short = name.split(".")[-1]
        if packet in self.registry:
            flops = self.registry[packet](*args, **kwargs, out_val=out)
        elif short in COPIES:
            flops = 0
        else:
            flops = sum(o.numel() for o in outs)
        if short in ("copy_", "fill_", "zero_"):  # in place: the output is the input, written once
            outs = []
        dtype = next((_DTYPE_NAMES.get(x.dtype, "other") for x in ins + outs if x.is_floating_point()), "other")
        nbytes = sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
        shape, layout = _shape(name, ins)
        rec = self.ops[(name, self.phase, dtype, shape, layout, nbytes if shape is None else 0)]
        rec[0] += 1
        rec[1] += flops
        rec[2] += nbytes
        return out


def _one(x) -> float:
    return 1.0


def step_ops(model_cfg, micro_batch: int, seq_len: int, precision: str = "fp32", checkpointing: str = "none",
             grad_accum: int = 1, compiled: bool = False, optimizer: str = "adamw") -> list[Op]:
    """Operators of one training step of the trainwise model (K = grad_accum micro-batches), recorded on
    fake CPU tensors; largest FLOPs first. precision: "fp32" or a bf16/fp16 autocast recipe.

    A deep model whose blocks repeat (every layer after first_dense_layers alike) is recorded at depths
    d+1 and d+2 and extrapolated: ops(L) = ops(d+1) + (L-d-1) x (ops(d+2) - ops(d+1)), exact because a
    block's operators do not depend on its depth (an 80-layer step took 20 s to record whole)."""
    base = model_cfg.first_dense_layers + 1 if model_cfg.is_moe else 1
    if model_cfg.n_layers > base + 1 and (not model_cfg.is_moe or model_cfg.moe_every == 1):
        from dataclasses import replace

        one, two = (_record(replace(model_cfg, n_layers=n), micro_batch, seq_len, precision, checkpointing,
                            compiled, optimizer) for n in (base, base + 1))
        extra = model_cfg.n_layers - base
        recs = {k: [a + extra * (b - a) for a, b in zip(one.get(k, [0, 0.0, 0.0]), two[k])] for k in two}
    else:
        recs = _record(model_cfg, micro_batch, seq_len, precision, checkpointing, compiled, optimizer)
    ops = [Op(n, op_class(n), ph, dt, shape, int(c), f, b, layout)
           for (n, ph, dt, shape, layout, _), (c, f, b) in recs.items() if f or b]
    ops = [op.scaled(grad_accum) if op.phase != "optimizer" else op for op in ops]
    return sorted(ops, key=lambda o: -o.flops)


def _record(model_cfg, micro_batch: int, seq_len: int, precision: str, checkpointing: str, compiled: bool,
            optimizer: str) -> dict[tuple, list]:
    """{(name, phase, dtype, shape, layout, bytes per call): [calls, FLOPs, bytes]} of one micro-batch's
    step on fake tensors (bytes per call 0 for matmuls and attention, which their shape describes)."""
    from trainwise.config import TrainConfig
    from trainwise.measure.step import train_step
    from trainwise.model import Transformer
    from trainwise.train.optim import build_optimizer
    from trainwise.train.parallelize import apply_activation_checkpointing

    precision = {"amp": "bf16", "bf16": "bf16", "fp16": "fp16"}.get(precision, "fp32")
    if model_cfg.is_moe and not model_cfg.dropless:
        # Capacity-limited routing cuts the groups with data-dependent shapes, which fake tensors cannot
        # follow; under the uniform routing recorded here no expert exceeds its capacity (>= N k / E), so
        # the dropless step runs the same expert work.
        from dataclasses import replace

        model_cfg = replace(model_cfg, dropless=True)
    rec = _Recorder()
    adam = importlib.import_module("torch.optim.adam")
    with FakeTensorMode(allow_non_fake_inputs=True), mock.patch.object(adam, "_get_value", _one), \
            mock.patch.object(torch.compiler, "is_compiling", lambda: compiled and rec.phase != "optimizer"), \
            mock.patch.object(torch, "bincount", _balanced_bincount):
        model = Transformer(model_cfg)
        if precision == "fp32":  # fake tensors have no fp32 _grouped_mm: experts one by one, same FLOPs and bytes
            for block in model.blocks:
                if hasattr(block.mlp, "grouped_mm"):
                    block.mlp.grouped_mm = False
        if checkpointing != "none":
            apply_activation_checkpointing(model, checkpointing)
        opt = build_optimizer(model, TrainConfig(optimizer="sgd" if optimizer.startswith("sgd") else "adamw",
                                                 momentum=0.9 if optimizer == "sgd-momentum" else 0.0))
        ids = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len + 1))
        with rec:
            train_step(model, opt, [(ids[:, :-1], ids[:, 1:])], torch.device("cpu"), precision, hook=rec.hook)
    return dict(rec.ops)


# The kernels a CUDA device runs instead of the CPU ones the fake step records (the trainer's choices:
# SDPA picks flash attention; train.optim.build_optimizer picks fused AdamW on CUDA).
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
