"""`trainwise roofline`: every operator of one training step on the roofline (Williams et al. 2009).

The operators are measure.record.step_ops, the list the step-time model prices (one list, one FLOP count, one
byte count): the step runs on fake tensors and each aten op is recorded with FLOPs from the FLOP
counter's formulas (one per output element for non-matmul ops) and bytes = inputs read + outputs
written (no cache reuse: a lower bound on intensity for fused kernels). Arithmetic intensity I = F/Q;
ridge point = P/BW; an op is compute-bound when I >= ridge; its lower-bound time is max(F/P, Q/BW).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from trainwise.config import TrainConfig
from trainwise.cost.ops import CLASSES, Op, by_name, for_cuda, op_class
from trainwise.cost.params import params
from trainwise.cost.steptime import predict_step
from trainwise.cost.time import attainable_flops, ridge_point, roofline_seconds
from trainwise.errors import TrainwiseError
from trainwise.measure.kernels import time_new_kernels
from trainwise.measure.record import param_tensors, step_ops
from trainwise.runtime.step import build_model, build_step, random_batches

MIN_PLOT_INTENSITY = 1e-3  # FLOPs/byte: below it an op is bookkeeping (a norm's scalar), not on the plot


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
        return roofline_seconds(self.flops, self.bytes, peak, bw)


def roofline_ops(model_cfg, micro_batch: int, seq_len: int, precision: str = "fp32",
                 checkpointing: str = "none", cuda: bool = False, compiled: bool = False) -> list[OpPoint]:
    """Operators of one training step of the trainwise model (measure.record.step_ops, the list the step-time
    model prices), summed per op name, largest FLOPs first. cuda: the kernels a CUDA device runs."""
    return roofline_points(step_ops(model_cfg, micro_batch, seq_len, precision, checkpointing,
                                    compiled=compiled and not cuda), cuda)


def roofline_points(ops: list[Op], cuda: bool = False) -> list[OpPoint]:
    """A step's recorded operators (roofline_ops; or a record the caller holds, e.g. the planner's memoised one)
    summed per op name, largest FLOPs first. cuda: the kernels a CUDA device runs."""
    if cuda:
        ops = for_cuda(ops)
    points = [OpPoint(n, op_class(n), c, f, b) for n, (c, f, b) in by_name(ops).items()]
    return sorted(points, key=lambda p: -p.flops)


def roofline_table(points: list[OpPoint], peak: float, bw: float) -> str:
    ridge = ridge_point(peak, bw)
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


def _log_axes(ax, ylabel: str, title: str) -> None:
    """Log-log axes of a roofline: intensity in FLOPs/byte across, FLOP/s up."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs/byte)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)


def plot_roofline(points: list[OpPoint], peak: float, bw: float, path: str, title: str = "",
                  measured: list[MeasuredOp] | None = None) -> None:
    """Log-log roofline: attainable FLOP/s = min(P, I x BW), each operator at (I, its bound FLOP/s).
    With `measured`, each measured operator gets its own colour: a hollow marker at its bound, a filled
    one at its achieved FLOP/s, joined by a thin line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ridge = ridge_point(peak, bw)
    points = [p for p in points if p.flops and p.bytes and p.intensity() >= MIN_PLOT_INTENSITY]
    if measured:
        measured = [m for m in measured if m.point.intensity() >= MIN_PLOT_INTENSITY]
    xs = [p.intensity() for p in points]
    lo, hi = min(xs + [ridge]) / 4, max(xs + [ridge]) * 4
    fig, ax = plt.subplots(figsize=(13, 7.5) if measured else (9, 6))
    ax.plot([lo, ridge, hi], [lo * bw, peak, peak], color="black", lw=2, label="roofline min(P, I x BW)")
    ax.axvline(ridge, color="gray", ls="--")
    ax.annotate(f"ridge point {ridge:.3g} FLOPs/byte", (ridge, peak), textcoords="offset points",
                xytext=(-8, 8) if measured else (8, -18), ha="right" if measured else "left")
    if measured:
        _plot_measured(ax, fig, measured, peak, bw, title)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    for i, (cls, _) in enumerate(CLASSES + (("elementwise/other", ()),)):  # one scatter (and legend entry) a class
        xs = [p.intensity() for p in points if p.cls == cls]
        if xs:
            ax.scatter(xs, [attainable_flops(x, peak, bw) for x in xs], color=f"C{i}", s=30, label=cls)
    ax.legend(loc="lower right")
    _log_axes(ax, "attainable performance (FLOP/s)", title or "roofline of one training step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- measured roofline (`trainwise roofline --measure`) -------------------------------------------------

MAX_MEASURE_PARAMS = 200_000_000  # a real fp32 step + Adam state of more than this is not a CPU check
MAX_MEASURE_STEP_S = 120.0  # refuse when the roofline's own lower bound says the step takes longer


@dataclass
class MeasuredOp:
    """One roofline operator with its measured self time in a real profiled step."""

    point: OpPoint
    time_s: float  # profiler self CPU time summed over the op's calls in the step
    calls: int  # calls the profiler saw
    predicted_s: float | None = None  # the step-time model's time for the op (cost.steptime), if given

    def achieved(self) -> float:
        return self.point.flops / self.time_s if self.time_s > 0 else float("nan")

    def attainable(self, peak: float, bw: float) -> float:
        return attainable_flops(self.point.intensity(), peak, bw)

    def fraction(self, peak: float, bw: float) -> float:
        return self.achieved() / self.attainable(peak, bw)


def check_measurable(model_cfg, micro_batch: int, seq_len: int, points: list[OpPoint], peak: float,
                     bw: float) -> None:
    """Raise TrainwiseError when a real CPU step of this config is too big or too slow to profile."""
    n = params(model_cfg).total
    if n > MAX_MEASURE_PARAMS:
        raise TrainwiseError(
            f"--measure runs a real training step on this CPU; {model_cfg.name} has {n / 1e6:.0f}M parameters "
            f"(limit {MAX_MEASURE_PARAMS / 1e6:.0f}M). Use a smaller model (e.g. --model trainwise-small), "
            f"or drop --measure for the analytic roofline.")
    t_min = sum(p.bound_s(peak, bw) for p in points)
    if t_min > MAX_MEASURE_STEP_S:
        raise TrainwiseError(
            f"--measure: one step of {model_cfg.name} at B={micro_batch}, T={seq_len} takes at least "
            f"{t_min:.0f} s on this hardware (roofline lower bound; limit {MAX_MEASURE_STEP_S:.0f} s). "
            f"Shrink it with --seq-len and/or --micro-batch.")


def measure_ops(model_cfg, micro_batch: int, seq_len: int, points: list[OpPoint], precision: str = "fp32",
                checkpointing: str = "none", seed: int = 0) -> list[MeasuredOp]:
    """Run one warm-up and one profiled real training step on the CPU (torch.profiler, CPU activity) and
    match the profiler's aten events to the roofline's operators by name. FLOPs stay the roofline's
    (the project's counter), never the profiler's estimate; time is each op's self CPU time (its own
    kernel, children excluded), summed over its calls. Operators the profiler did not see are left out."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cpu")
    rng_state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        step = build_step(build_model(model_cfg), TrainConfig(activation_checkpointing=checkpointing), device,
                          precision)
        batches = random_batches(model_cfg.vocab_size, micro_batch, seq_len, 1, device, seed)
        step(batches)  # warm-up: allocations, optimizer state
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(batches)
    finally:
        torch.set_rng_state(rng_state)
    times = _attribute(prof.events(), {p.name for p in points})
    return [MeasuredOp(p, times[p.name][0], times[p.name][1]) for p in points
            if p.name in times and times[p.name][0] > 0 and p.flops > 0]


def _attribute(events, names: set[str]) -> dict[str, list]:
    """{roofline op name: [seconds, calls]}. Each profiler event's self time goes to its nearest enclosing
    event that is a roofline operator (itself included): a kernel an op runs through an unlisted helper
    (embedding -> index_select, a CPU _foreach_ op's per-tensor loop) counts as that op's time, and a
    roofline op nested in another keeps its own. Events under no roofline op (autograd nodes, views,
    composite wrappers such as aten::linear) are not charged to any operator."""
    times: dict[str, list] = defaultdict(lambda: [0.0, 0])
    stack = [(ev, None) for ev in events if ev.cpu_parent is None]
    while stack:
        ev, owner = stack.pop()
        name = ev.name.replace("::", ".")  # profiler "aten::mm" == dispatch packet "aten.mm"
        if name in names:
            owner = name
            times[name][1] += 1
        if owner is not None:
            times[owner][0] += ev.self_cpu_time_total * 1e-6  # microseconds
        stack.extend((child, owner) for child in ev.cpu_children)
    return times


def measured_table(measured: list[MeasuredOp], peak: float, bw: float) -> str:
    lines = ["measured: one real step (after a warm-up step) under torch.profiler; FLOPs from the trainwise "
             "counter, time = profiler self CPU time (incl. helper kernels the op calls), all calls in the step",
             f"peak {peak:.4g} FLOP/s, bandwidth {bw:.4g} B/s, ridge point {ridge_point(peak, bw):.3g} FLOPs/byte",
             f"{'operator':<50} {'class':<22} {'FLOPs':>10} {'time ms':>9} {'predicted ms':>12} "
             f"{'achieved FLOP/s':>15} {'attainable FLOP/s':>17} {'% bound':>8}"]
    tot_f = tot_t = tot_p = 0.0
    for m in measured:
        p = m.point
        pred = "n/a" if m.predicted_s is None else f"{m.predicted_s * 1e3:.3g}"
        lines.append(f"{p.name:<50} {p.cls:<22} {p.flops:>10.3g} {m.time_s * 1e3:>9.3g} {pred:>12} "
                     f"{m.achieved():>15.3g} {m.attainable(peak, bw):>17.3g} {100 * m.fraction(peak, bw):>7.1f}%")
        tot_f += p.flops
        tot_t += m.time_s
        tot_p += m.predicted_s or 0.0
    if tot_t:
        lines.append(f"{'all measured ops':<73} {tot_f:>10.3g} {tot_t * 1e3:>9.3g} {tot_p * 1e3:>12.3g} "
                     f"{tot_f / tot_t:>15.3g}")
    if any(m.predicted_s is not None for m in measured):
        lines.append("predicted ms: the step-time model (cost.steptime) per operator, its share of the eager "
                     "per-call overhead included; the profiler's time excludes what runs outside aten ops")
    return "\n".join(lines)


def measured_json(measured: list[MeasuredOp], peak: float, bw: float) -> list[dict]:
    return [{"op": m.point.name, "class": m.point.cls, "calls": m.calls, "flops": m.point.flops,
             "bytes": m.point.bytes, "intensity": m.point.intensity(), "time_s": m.time_s,
             "achieved_flops_per_s": m.achieved(), "attainable_flops_per_s": m.attainable(peak, bw),
             "fraction_of_bound": m.fraction(peak, bw), "predicted_s": m.predicted_s} for m in measured]


def _plot_measured(ax, fig, measured: list[MeasuredOp], peak: float, bw: float, title: str) -> None:
    import matplotlib
    from matplotlib.lines import Line2D

    cmap = list(matplotlib.colormaps["tab20"].colors)
    cmap = cmap[0::2] + cmap[1::2]  # the 10 strong colours first, then their light partners
    markers = "osD^v<>ph*"
    handles = []
    for i, m in enumerate(measured):
        x, color, marker = m.point.intensity(), cmap[i % len(cmap)], markers[(i // 10) % len(markers)]
        ax.plot([x, x], [m.achieved(), m.attainable(peak, bw)], color=color, lw=0.8, alpha=0.6)
        ax.scatter(x, m.attainable(peak, bw), facecolors="none", edgecolors=color, marker=marker, s=70, lw=1.5)
        label = f"{m.point.name.removeprefix('aten.')} ({100 * m.fraction(peak, bw):.2g}% of bound)"
        handles.append(ax.scatter(x, m.achieved(), color=color, marker=marker, s=45, label=label))
    _log_axes(ax, "performance (FLOP/s)", title or "roofline of one training step: measured vs bound")
    style = [Line2D([], [], color="black", lw=2, label="roofline min(P, I x BW)"),
             Line2D([], [], ls="", marker="o", mfc="none", mec="gray", ms=8, label="bound (attainable)"),
             Line2D([], [], ls="", marker="o", color="gray", ms=7, label="measured (achieved)")]
    first = ax.legend(handles=style, loc="lower right", fontsize=9)
    ax.add_artist(first)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              title="operator (filled = measured)", title_fontsize=9, borderaxespad=0)
    fig.tight_layout()


def predicted_by_name(model_cfg, micro_batch: int, seq_len: int, precision: str, checkpointing: str,
                      profile) -> dict[str, float]:
    """{op name: seconds} the step-time model gives each operator of one eager step on this CPU: its
    priced time plus its calls x the calibrated per-call overhead."""
    ops = step_ops(model_cfg, micro_batch, seq_len, precision, checkpointing)
    time_new_kernels(ops, profile)
    step = predict_step(ops, profile, param_tensors(model_cfg), params(model_cfg).total, precision=precision)
    out: dict[str, float] = defaultdict(float)
    for t in step.ops:
        extra = profile.overhead[1] * t.op.calls if t.op.phase != "optimizer" else 0.0
        out[t.op.name] += t.seconds + extra
    return dict(out)
