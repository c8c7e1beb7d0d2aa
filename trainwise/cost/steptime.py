"""Predicted step time: the sum over the step's operators (cost.ops) of each one's calibrated time, plus
communication per strategy, plus a fixed per-step cost.

    matmul            measured at its shape and operand layout on this device (kernel table), else F/P;
                      + Q/BW (its operands from memory: timed hot, a step's kernel finds them evicted)
    attention kernel  measured at its shape forward and backward (kernel table), else F/R_fwd or F/R_bwd; + Q/BW
    everything else   Q/BW_class(q)          (memory-bound: bytes over the bandwidth of that class of op at
                                               its bytes per call q, at most its rate from memory)
    optimizer         a x tensors + b x parameters      (clip + AdamW step, timed as the trainer runs it)
    eager overhead    per-op x calls + per-step          (Python, dispatch, autograd; from reference steps)
    in a step         the eager operators' times x in_step of the step's compute precision (what kernels
                      lose in a real step; ibid.)

A device's calibration (`trainwise hardware --calibrate`, source "calibrated") holds the fits; the kernel
table holds matmuls and attention calls timed at the shapes of the steps planned on it (the planner times
them when a plan first needs them, a few ms each, and caches them; here they are only read): on a CPU the
same FLOPs run 2-5x apart with shape and layout, which no two-parameter fit follows. The fits' intercepts
are left out: the per-call cost is the eager overhead term, measured in real steps (with the factor by which
kernels run slower inside a step than alone). A compiled step (torch.compile, CPU) runs the same matmuls;
inductor fuses the rest into kernels that take COMPILED_ELEMENTWISE x the eager element-wise time and pay no
per-op overhead. A GPU this machine has not calibrated is priced from published figures instead
(trainwise.cost.cluster).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

from trainwise.cost.comm import comm_seconds, exposed_comm, strategy_for
from trainwise.cost.ops import Op, for_cuda
from trainwise.hardware.profile import Profile

# A compiled CPU step runs the eager step's matmuls (timed as in eager) and inductor's generated kernels
# for the rest, which fuse chains of element-wise ops: the fused work costs COMPILED_ELEMENTWISE x the
# eager element-wise time (priced as op_seconds prices it: operands from memory, x the in-step factor of
# the step's precision), fitted on two compiled configurations unlike those benchmarks/time_model.py
# checks (`python benchmarks/time_model.py --fit-compiled`, per compute precision of the step): fp32 and
# bf16 are the means of repeated fits (benchmarks/RESULTS.md, "One in-step factor per compute precision");
# fp16 has no fit of its own (CPUs train in bf16) and takes bf16's, the other 16-bit format.
COMPILED_ELEMENTWISE = {"fp32": 1.08, "bf16": 0.75, "fp16": 0.75}

def elementwise_rate(grid: list[list[float]], nbytes: float) -> float:
    """Bytes/s of an element-wise call moving nbytes, from a class's calibrated [[bytes, bytes/s], ...]:
    seconds per byte interpolated linearly in log(bytes) between the calibrated sizes, held at the ends."""
    pts = sorted(grid)
    if nbytes <= pts[0][0] or len(pts) == 1:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        return pts[-1][1]
    for (q0, r0), (q1, r1) in zip(pts, pts[1:]):
        if q0 <= nbytes <= q1:
            w = (math.log(nbytes) - math.log(q0)) / (math.log(q1) - math.log(q0))
            return 1.0 / ((1 - w) / r0 + w / r1)
    return pts[-1][1]


# The largest matmul or attention call timed on demand (larger ones take the fit, which large shapes
# follow): a few hundred ms on a small CPU, and at most MAX_KERNEL_BYTES of operands.
MAX_KERNEL_FLOPS = 1e11
MAX_KERNEL_BYTES = 1 << 30


def kernel_key(op: Op) -> str:
    """The kernel table's name of a matmul or attention call: kind, dtype, shape, layout."""
    kind = "attention" if op.cls == "attention" else "grouped_mm" if "grouped_mm" in op.name else "matmul"
    return f"{kind}|{op.dtype}|{'x'.join(map(str, op.shape))}|{op.layout}"


def _kernel_entry(op: Op) -> tuple[str, bool]:
    """(kernel table key, may be timed here: a matmul or attention call small enough to time)."""
    if op.shape is None or op.dtype not in ("fp32", "bf16", "fp16") or not op.calls or op.cls not in (
            "matmul", "attention"):
        return "", False
    key = kernel_key(op)
    if op.cls == "attention":
        key = f"{key}|{'backward' if 'backward' in op.name else 'forward'}"
    return key, op.flops / op.calls <= MAX_KERNEL_FLOPS and op.bytes / op.calls <= MAX_KERNEL_BYTES


def kernels_to_time(ops: list[Op], known: dict[str, float]) -> dict[str, Op]:
    """{kernel: op} of the matmul and attention calls of `ops` small enough to time and not in `known`
    (one entry per attention call: its forward and backward are timed together)."""
    todo = {}
    for op in ops:
        key, small = _kernel_entry(op)
        if small and key not in known:
            todo[key.rsplit("|", 1)[0] if op.cls == "attention" else key] = op
    return todo


def kernel_seconds(op: Op, p: Profile) -> float | None:
    """Seconds per call of a matmul or attention op from the profile's kernel table, or None (too large
    to time, or not timed: the planner times a step's new kernels before it prices them,
    trainwise.measure.kernels.time_new_kernels)."""
    key, _ = _kernel_entry(op)
    return p.kernels.get(key) if key else None


@dataclass
class OpTime:
    op: Op
    seconds: float
    how: str  # which rule priced it


@dataclass
class StepTime:
    seconds: float
    compute_s: float
    overhead_s: float
    comm_s: float
    ops: list[OpTime]
    source: str
    compiled: bool
    comm: dict[str, float] = field(default_factory=dict)  # every collective's seconds, exposed or not
    comm_how: str = ""  # the link the collectives were priced at, and where it comes from

    def by_phase(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for t in self.ops:
            out[t.op.phase] += t.seconds
        return dict(out)

    def top(self, n: int = 5) -> list[OpTime]:
        return sorted(self.ops, key=lambda t: -t.seconds)[:n]


def _dtype(profile_part: dict, dtype: str):
    return profile_part.get(dtype) or profile_part.get("fp32") or next(iter(profile_part.values()))


def op_seconds(op: Op, p: Profile, compiled: bool = False, precision: str = "fp32") -> tuple[float, str]:
    """Time of all calls of one operator, without the per-call overhead, and the rule used (compiled: in
    a torch.compile'd step whose compute precision is `precision`).

    In a step an operator finds its operands in memory, not in cache: the step's other work has evicted
    them since they were written. Kernels are timed hot (the same operands call after call), so a matmul or
    attention call timed alone pays, on top, its bytes streamed once at the copy bandwidth, and element-wise
    work moves at most at its class's rate far past the shared cache (the grid's largest size): without
    this rule the reference steps' in-step factor absorbed the difference, most where hot bf16 kernels are
    fastest (benchmarks/RESULTS.md, "Operands in memory")."""
    if op.cls in ("matmul", "attention"):
        per_call = kernel_seconds(op, p)
        if per_call is not None:
            return per_call * op.calls + op.bytes / _dtype(p.matmul, op.dtype)[2], \
                f"{op.cls} timed at its shape + Q/BW"
    if op.cls == "matmul":
        _, peak, bw = _dtype(p.matmul, op.dtype)
        return op.flops / peak + op.bytes / bw, "matmul F/P + Q/BW"
    if op.cls == "attention":
        phase = "backward" if "backward" in op.name else "forward"
        return op.flops / _dtype(p.attention, op.dtype)[phase][1] + op.bytes / _dtype(p.matmul, op.dtype)[2], \
            f"attention {phase} F/R + Q/BW"
    ew = _dtype(p.elementwise, op.dtype)
    grid = ew.get(op.cls, ew["elementwise/other"])
    eager = op.bytes / min(elementwise_rate(grid, op.per_call_bytes()), max(grid)[1])
    if compiled and op.phase != "optimizer":
        factor = COMPILED_ELEMENTWISE.get(precision, COMPILED_ELEMENTWISE["fp32"])
        return factor * eager, f"fused: {factor} x Q/BW(q)"
    return eager, "Q/BW(q)"


def predict_step(ops: list[Op], p: Profile, n_param_tensors: int, n_params: int, compiled: bool = False,
                 comm_s: float = 0.0, optimizer: str = "adamw", async_launch: bool = False,
                 precision: str = "fp32") -> StepTime:
    """Predicted seconds of one optimizer step whose operators are `ops` (measure.record.step_ops), run in
    compute precision `precision`. Matmul and attention calls are priced from the profile's kernel
    table where it has them (time them first to use their own times), else from its fits."""
    timed, in_step = [], p.in_step_for(precision)
    opt_ops = [o for o in ops if o.phase == "optimizer"]
    opt_bytes = sum(o.bytes for o in opt_ops) or 1.0
    opt_total = p.optimizer[0] * n_param_tensors + p.optimizer[1] * n_params if optimizer == "adamw" else None
    for op in ops:
        if op.phase == "optimizer" and opt_total is not None:
            timed.append(OpTime(op, opt_total * op.bytes / opt_bytes, "optimizer a*tensors + b*params, by bytes"))
        else:
            seconds, how = op_seconds(op, p, compiled, precision)
            how = how if in_step == 1 else f"{how}, x{in_step:.3g} in a {precision} step"
            timed.append(OpTime(op, seconds * in_step, how))
    compute = sum(t.seconds for t in timed)
    eager_calls = sum(o.calls for o in ops if o.phase != "optimizer" and (not compiled or o.cls == "matmul"))
    if opt_total is None:  # optimizer ops priced one by one: they pay the eager per-op cost too
        eager_calls += sum(o.calls for o in opt_ops)
    overhead = p.overhead[0] + p.overhead[1] * eager_calls
    # A GPU runs its kernels while the host queues the next ones: the step takes the longer of the two.
    busy = max(compute, overhead) if async_launch else compute + overhead
    return StepTime(busy + comm_s, compute, overhead, comm_s, timed, p.source, compiled)


# A machine running more than this far from its calibration is said so, and priced as probed. One band
# for a run's closing table (the mean of its steps) and for benchmarks/time_model.py (each configuration's
# fastest round): runs on two CPU kinds whose calibrated errors followed their probes' readings in order,
# and a benchmark run whose calibration had caught a fast spell, which its probes said
# (benchmarks/RESULTS.md, "One band for the probe"). The probe's baseline is the median of its readings at
# calibration, so quiet readings centre near 1.0 and one band serves both.
PROBE_WARN = 0.15


def probed_seconds(step: StepTime, probe: dict) -> float:
    """The predicted step on the machine as a speed probe found it (measure.reference.probe_speed): the
    eager overhead scaled as the overhead-bound reference steps moved since the calibration, the
    operators as the kernel-bound ones moved; communication as predicted. A reading within PROBE_WARN of
    the calibration is read as the calibrated machine: the calibrated step. Either way the step is then
    multiplied by the probe's load factor (measure.load.load_factor): the share of the cores other
    processes held while it ran, which the reference steps' fastest samples step around and a run's
    steps do not (1.0 on a quiet machine). A single probe (~1 s) reads a VM's state of the moment: a run
    and the benchmark take a second one after their steps where the first reads outside the band, and
    keep the nearer (settled_probe)."""
    load = probe.get("load_factor", 1.0)
    if abs(probe["ratio"] - 1) <= PROBE_WARN:
        return (step.seconds - step.comm_s) * load + step.comm_s
    return (step.overhead_s * probe["overhead_ratio"] + step.compute_s * probe["kernel_ratio"]) * load + step.comm_s


def settled_probe(first: dict, *later: dict) -> dict:
    """Of a run's speed probes (at its start, and at its end where the start read outside the band), the
    one nearest the calibration, with every reading's ratio under "readings": a move of the machine counts
    only when it shows at both ends of the run. The slow and fast states of a VM last seconds (a 0.6 s
    probe read 1.33 right before a round that ran at calibrated speed: benchmarks/RESULTS.md)."""
    nearest = min((first, *later), key=lambda p: abs(p["ratio"] - 1))
    return {**nearest, "readings": [p["ratio"] for p in (first, *later)]}


def scale_batch(ops: list[Op], factor: int, seq_len: int) -> list[Op]:
    """The operators of micro-batch B x factor from those of micro-batch B (for `plan --fit`, which
    prices many micro-batches from one recorded step): forward and backward work grows with the tokens;
    a matmul's token extent (the first of M, K, N that is a multiple of seq_len; bmm's batch) grows with
    it. Weight-sized work (autocast's weight casts, the gradients' casts) stays: an op's fixed bytes, where
    its record found them (cost.ops.Op.batched); without them it is scaled too, an overestimate."""
    if factor == 1:
        return ops
    out = []
    for op in ops:
        if op.phase == "optimizer":
            out.append(op)
            continue
        shape = op.shape
        if shape is not None:
            dims = list(shape)
            if "grouped_mm" in op.name:  # (experts, tokens per expert, K, N)
                dims[1] *= factor
            elif dims[0] > 1 or op.cls == "attention":  # bmm's batch; attention's (batch, heads, kv heads, T, hd)
                dims[0] *= factor
            else:
                i = next((i for i in (1, 2, 3) if dims[i] % seq_len == 0), 1)
                dims[i] *= factor
            shape = tuple(dims)
        out.append(replace(op.batched(factor), shape=shape))
    return out


# The strategy whose link calibration (measure.reference.strategy_links) prices another's collectives: zero1's
# gradients are all-reduced by the same DDP reducer as ddp's (its optimizer's broadcast beside them).
FITTED_AS = {"zero1": "ddp"}


def step_time(ops: list[Op], profile: Profile, *, n_layers: int, grad_tensor_bytes: list[int], n_params: int,
              grad_accum: int, compute_dtype: str, optimizer: str, zero: int, dp: int, grad_bytes: int,
              param_bytes: int, compiled: bool = False, cuda: bool = False, reduces: int = 1) -> StepTime:
    """Predicted time of one optimizer step as the trainer runs it on the profiled device: the operators
    of one micro-batch's step (`ops`, recorded as cost.recipe.Recipe.record_precision says: autocast, or 16-bit
    weights under FSDP2's policy, when compute_dtype is bf16/fp16; CUDA
    kernels on a GPU), priced by the profile, K micro-batches, plus the exposed communication of the
    strategy ZeRO-`zero` over dp (`reduces`: reduce-scatters per step; `grad_tensor_bytes`: each parameter tensor's
    gradient bytes in the model's order, for the optimizer's per-tensor cost, DDP's buckets and ZeRO-1's broadcasts:
    cost.comm.comm_seconds)."""
    precision = "fp32" if compute_dtype == "fp32" else compute_dtype
    if cuda:
        ops = for_cuda(ops)
    ops = [o.scaled(grad_accum) if o.phase != "optimizer" else o for o in ops]
    tensors = len(grad_tensor_bytes)
    if zero >= 1 and dp > 1:  # each rank updates only its 1/dp shard of the parameters
        ops = [o if o.phase != "optimizer" else o.resized(1 / dp, 1 / dp) for o in ops]
        n_params = n_params // dp
    base = predict_step(ops, profile, tensors, n_params, compiled, 0.0, optimizer, async_launch=cuda,
                        precision=precision)
    strategy = strategy_for(zero, dp)
    fitted = FITTED_AS.get(strategy, strategy)
    link = profile.strategy_links.get(fitted, profile.link)
    comm = comm_seconds(strategy, dp, grad_bytes, param_bytes, n_layers, grad_accum, link,
                        param_bytes // 2 if precision != "fp32" and zero >= 2 else None, reduces, grad_tensor_bytes)
    phases = base.by_phase()
    exposed = exposed_comm(comm, phases.get("backward", 0.0) + phases.get("forward", 0.0), overlaps=cuda)
    base.comm_s, base.seconds = exposed, base.seconds + exposed
    base.comm = comm
    if comm:
        how = (("as its training steps ran them" if fitted == strategy else f"as {fitted}'s training steps ran them")
               if fitted in profile.strategy_links else "alone")
        source = ("the default link (`trainwise hardware --calibrate` under torchrun measures this machine's)"
                  if profile.link_source == "default" else f"{strategy}'s collectives {how}, {profile.link_source}")
        base.comm_how = f"ring model at {link[0] * 1e6:,.0f} us per hop and {link[1] / 1e9:.3g} GB/s: {source}"
    return base


