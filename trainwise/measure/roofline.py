"""`trainwise roofline`: every operator of one training step on the roofline (Williams et al. 2009).

The step runs on fake tensors (no memory, no compute) under a dispatch mode that records each aten op:
FLOPs from the one FLOP counter's formulas (trainwise.measure.flopcount) for matmuls and attention, one
FLOP per output element for everything else (norms, activations, softmax/cross-entropy, optimizer
update); bytes moved = bytes of the tensor inputs read + outputs written (no cache reuse: a lower bound
on intensity for fused kernels). Arithmetic intensity I = F/Q; ridge point = P/BW; an op is
compute-bound when I >= ridge; its lower-bound time is max(F/P, Q/BW).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CLASSES = (("attention", ("attention",)), ("matmul", ("mm", "bmm", "addmm", "baddbmm")),
           ("norm", ("rsqrt", "layer_norm", "pow", "mean", "rms")),
           ("softmax/cross-entropy", ("softmax", "nll_loss", "log_softmax")),
           ("activation", ("silu", "gelu", "relu")),
           ("optimizer", ("_foreach", "lerp", "addcdiv", "addcmul", "sqrt")))
VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "split", "split_with_sizes", "slice",
         "select", "detach", "alias", "unsqueeze", "squeeze", "as_strided", "chunk", "unbind", "reshape", "_to_copy",
         "lift_fresh", "empty", "empty_like", "zeros_like", "ones_like", "new_empty_strided", "new_empty",
         "_local_scalar_dense", "clone", "copy_", "randint", "zeros", "ones", "empty_strided", "normal_",
         "fill_", "zero_", "arange", "full"}


def op_class(name: str) -> str:
    short = name.split(".")[1] if "." in name else name
    for cls, keys in CLASSES:
        if any(k in short for k in keys):
            return cls
    return "elementwise/other"


@dataclass
class OpPoint:
    name: str
    cls: str
    calls: int
    flops: float
    bytes: float

    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    def bound_s(self, peak: float, bw: float) -> float:
        return max(self.flops / peak, self.bytes / bw)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        from trainwise.measure.flopcount import flop_counter

        self.registry = flop_counter().flop_registry
        self.ops: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = str(packet)
        if name.split(".")[-1] in VIEWS:
            return out
        ins = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        if packet in self.registry:
            flops = self.registry[packet](*args, **kwargs, out_val=out)
        else:
            flops = sum(o.numel() for o in outs)
        rec = self.ops[name]
        rec[0] += 1
        rec[1] += flops
        rec[2] += sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
        return out


def roofline_ops(model_cfg, micro_batch: int, seq_len: int, precision: str = "fp32",
                 checkpointing: str = "none") -> list[OpPoint]:
    """Operators of one training step of the trainwise model (fake tensors), largest FLOPs first."""
    import importlib
    from unittest import mock

    from trainwise.config import TrainConfig
    from trainwise.measure.simulate import _one
    from trainwise.measure.step import train_step
    from trainwise.model import Transformer
    from trainwise.train.optim import build_optimizer
    from trainwise.train.parallelize import apply_activation_checkpointing

    rec = _Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True), \
            mock.patch.object(importlib.import_module("torch.optim.adam"), "_get_value", _one):
        model = Transformer(model_cfg)
        if checkpointing != "none":
            apply_activation_checkpointing(model, checkpointing)
        opt = build_optimizer(model, TrainConfig())
        ids = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len + 1))
        with rec:
            train_step(model, opt, [(ids[:, :-1], ids[:, 1:])], torch.device("cpu"), precision)
    points = [OpPoint(n, op_class(n), c, f, b) for n, (c, f, b) in rec.ops.items() if f or b]
    return sorted(points, key=lambda p: -p.flops)


def roofline_table(points: list[OpPoint], peak: float, bw: float) -> str:
    ridge = peak / bw
    lines = [f"ridge point = peak / bandwidth = {peak:.4g} / {bw:.4g} = {ridge:.3g} FLOPs/byte",
             f"{'operator':<52} {'class':<22} {'FLOPs':>10} {'bytes':>10} {'FLOPs/B':>8} {'bound':>8} {'t_min s':>9}"]
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for p in points:
        bound = "compute" if p.intensity() >= ridge else "memory"
        t = p.bound_s(peak, bw)
        lines.append(f"{p.name:<52} {p.cls:<22} {p.flops:>10.3g} {p.bytes:>10.3g} {p.intensity():>8.3g} "
                     f"{bound:>8} {t:>9.3g}")
        tot = totals[p.cls]
        tot[0] += p.flops
        tot[1] += p.bytes
        tot[2] += t
    lines.append("totals per class:")
    for cls, (f, b, t) in sorted(totals.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"  {cls:<24} {f:>10.3g} FLOPs {b:>10.3g} bytes  lower-bound time {t:.3g} s")
    lines.append(f"  {'step':<24} lower-bound time {sum(t for _, _, t in totals.values()):.3g} s")
    return "\n".join(lines)


def plot_roofline(points: list[OpPoint], peak: float, bw: float, path: str, title: str = "") -> None:
    """Log-log roofline: attainable FLOP/s = min(P, I x BW), each operator at (I, its bound FLOP/s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ridge = peak / bw
    xs = [p.intensity() for p in points if p.flops and p.bytes]
    lo, hi = min(xs + [ridge]) / 4, max(xs + [ridge]) * 4
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot([lo, ridge, hi], [lo * bw, peak, peak], color="black", lw=2, label="roofline min(P, I x BW)")
    ax.axvline(ridge, color="gray", ls="--")
    ax.annotate(f"ridge point {ridge:.3g} FLOPs/byte", (ridge, peak), textcoords="offset points",
                xytext=(8, -18))
    colors = {cls: f"C{i}" for i, (cls, _) in enumerate(CLASSES + (("elementwise/other", ()),))}
    for p in points:
        if p.flops and p.bytes:
            ax.scatter(p.intensity(), min(peak, p.intensity() * bw), color=colors[p.cls], s=30,
                       label=p.cls)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="lower right")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs/byte)")
    ax.set_ylabel("attainable performance (FLOP/s)")
    ax.set_title(title or "roofline of one training step")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
