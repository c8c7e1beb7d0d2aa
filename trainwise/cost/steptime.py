"""Predicted step time: the sum over the step's operators (cost.ops) of each one's calibrated time, plus
communication per strategy, plus a fixed per-step cost.

    matmul            measured at its shape and operand layout on this device (kernel table), else F/P + Q/BW
    attention kernel  measured at its shape forward and backward (kernel table), else F/R_fwd or F/R_bwd
    everything else   Q/BW_class(q)          (memory-bound: bytes over the bandwidth of that class of op at
                                               its bytes per call q: in cache, from memory, to fresh pages)
    optimizer         a x tensors + b x parameters      (clip + AdamW step, timed as the trainer runs it)
    eager overhead    per-op x calls + per-step          (Python, dispatch, autograd; from reference steps)
    in a step         the eager operators' times x in_step (what kernels lose in a real step; ibid.)

A device's calibration (`trainwise hardware --calibrate`, source "calibrated") holds the fits; the kernel
table holds matmuls and attention calls timed at the shapes of the steps planned on it (measured when a
plan first needs them, a few ms each, and cached): on a CPU the same FLOPs run 2-5x apart with shape and
layout, which no two-parameter fit follows. The fits' intercepts are left out: the per-call cost is the
eager overhead term, measured in real steps (with the factor by which kernels run slower inside a step
than alone). A compiled step (torch.compile, CPU) runs the same matmuls; inductor fuses the rest into
kernels that take COMPILED_ELEMENTWISE x the eager element-wise time and pay no per-op overhead. A table
GPU gets DEFAULT_EFFICIENCY applied to its datasheet (source "table defaults": "from table,
uncalibrated").
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

from trainwise.cost.ops import Op

# A compiled CPU step runs the eager step's matmuls (timed as in eager) and inductor's generated kernels
# for the rest. Those fuse chains of element-wise ops, but on the 2-core Xeon (AMX) they took about as
# long as the eager ops they replace, more in bf16 (conversions in every loop) and with the explicit
# attention's T x T scores in memory: the fused work costs COMPILED_ELEMENTWISE x the eager element-wise
# time, fitted on two compiled configurations unlike those benchmarks/time_model.py checks
# (`python benchmarks/time_model.py --fit-compiled`, per compute precision of the step; RESULTS.md).
COMPILED_ELEMENTWISE = {"fp32": 1.02, "bf16": 1.29, "fp16": 1.29}

# Uncalibrated accelerators: fractions of the datasheet figure a well-fed kernel reaches, round figures
# of the commonly reported range (not measured by trainwise): large bf16 GEMMs 70-80% of an A100/H100's
# dense peak, flash attention 50-70% forward and less backward, element-wise kernels 70-90% of HBM
# bandwidth; a PyTorch eager op costs ~5-10 us of launch and Python. `benchmarks/gpu_check.py` measures.
DEFAULT_EFFICIENCY = {"matmul": 0.7, "attention_forward": 0.5, "attention_backward": 0.35, "bandwidth": 0.7}
DEFAULT_OVERHEAD = [1e-3, 6e-6]  # [seconds per step, seconds per eager op] on a GPU host
ADAMW_BYTES_PER_PARAM = 28  # fused AdamW, fp32: read+write param, m, v (24) + read grad (4)


PROFILE_VERSION = 7  # a cached calibration of another version is measured again


@dataclass
class Profile:
    """What a device does per unit of work; see the module docstring. Rates in FLOP/s and bytes/s."""

    matmul: dict[str, list[float]]  # dtype -> [c s, P FLOP/s, BW bytes/s]
    elementwise: dict[str, dict[str, list[list[float]]]]  # dtype -> class -> [[bytes per call, bytes/s], ...]
    attention: dict[str, dict[str, list[float]]]  # dtype -> "forward"/"backward" -> [c s, FLOP/s]
    optimizer: list[float]  # [s per parameter tensor, s per parameter] of clip + AdamW step
    overhead: list[float]  # [s per step, s per eager op call]
    source: str  # "calibrated" | "table defaults"
    link: list[float] = field(default_factory=lambda: [5e-5, 1e9])  # collectives: [latency s, bytes/s]
    link_source: str = "default"
    in_step: float = 1.0  # a real step's kernels take this times their time alone (calibrated: step_fit)
    # seconds per call of matmuls and attention at given shapes (kernel_key); with `device` set, the
    # calls a plan needs and the table lacks are measured on this device (`threads` torch threads)
    kernels: dict[str, float] = field(default_factory=dict)
    device: str | None = None
    threads: int | None = None
    machine: str = ""
    new_kernels: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        return cls(**{k: d[k] for k in ("matmul", "elementwise", "attention", "optimizer", "overhead", "source")},
                   link=d.get("link", [5e-5, 1e9]), link_source=d.get("link_source", "default"),
                   in_step=d.get("in_step", 1.0))

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("kernels", "device", "threads", "new_kernels")}

    def on_device(self, device: str, machine: str, threads: int | None) -> Profile:
        """This profile measured here: kernels at new shapes may be timed on `device`, and the ones timed
        before on this machine (calibrate.kernel_table) are used."""
        from trainwise.measure.calibrate import kernel_table

        self.device, self.machine, self.threads = device, machine, threads
        self.kernels = {**kernel_table(machine), **self.kernels}
        return self

    def save_kernels(self) -> None:
        """Cache the kernels timed since the last save (calibrate.save_kernel_table)."""
        if self.new_kernels and self.machine:
            from trainwise.measure.calibrate import save_kernel_table

            save_kernel_table(self.machine, self.new_kernels)
            self.new_kernels = {}


def table_profile(peak_flops: dict[str, float], bandwidth: float) -> Profile:
    """A datasheet's peaks and bandwidth at DEFAULT_EFFICIENCY: the model of an uncalibrated GPU."""
    e = DEFAULT_EFFICIENCY
    bw = e["bandwidth"] * bandwidth
    classes = ("elementwise/other", "activation", "norm", "softmax/cross-entropy")
    dtypes = {"fp32": peak_flops.get("tf32", peak_flops.get("fp32"))}
    for name in ("bf16", "fp16"):
        dtypes[name] = peak_flops.get(name, peak_flops.get({"bf16": "fp16", "fp16": "bf16"}[name]))
    dtypes = {k: v for k, v in dtypes.items() if v}
    return Profile(
        matmul={d: [0.0, e["matmul"] * p, bw] for d, p in dtypes.items()},
        elementwise={d: {c: [[1.0, bw]] for c in classes} for d in dtypes},
        attention={d: {"forward": [0.0, e["attention_forward"] * p], "backward": [0.0, e["attention_backward"] * p]}
                   for d, p in dtypes.items()},
        optimizer=[0.0, ADAMW_BYTES_PER_PARAM / bw], overhead=list(DEFAULT_OVERHEAD), source="table defaults",
        link=[1e-5, 100e9], link_source="default (100 GB/s, 10 us; interconnect not in the table)")


def elementwise_rate(grid: list[list[float]], nbytes: float) -> float:
    """Bytes/s of an element-wise call moving nbytes, from a class's calibrated [[bytes, bytes/s], ...]:
    seconds per byte interpolated linearly in log(bytes) between the calibrated sizes, held at the ends."""
    import math

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
# follow): a few hundred ms on a 2-core CPU, and at most MAX_KERNEL_BYTES of operands.
MAX_KERNEL_FLOPS = 1e11
MAX_KERNEL_BYTES = 1 << 30


def kernel_key(op: Op) -> str:
    """The kernel table's name of a matmul or attention call: kind, dtype, shape, layout."""
    kind = "attention" if op.cls == "attention" else "grouped_mm" if "grouped_mm" in op.name else "matmul"
    return f"{kind}|{op.dtype}|{'x'.join(map(str, op.shape))}|{op.layout}"


# New kernels are timed in this many passes over all of a plan's new kernels, each keeping its fastest:
# the passes span a second or more, so one slow spell of this machine (its speed drifts 20-30% over
# seconds) does not get written into the table for good (a table timed in one pass put a whole benchmark
# run 20% high).
KERNEL_PASSES = 3


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


def time_kernel_pass(todo: dict[str, Op], device: str, timed: dict[str, float], budget_s: float | None = None) -> None:
    """Time each kernel of `todo` (kernels_to_time) once more on `device` with the current torch threads,
    keeping each one's fastest in `timed` (seconds per call; attention as "...|forward" and "...|backward")."""
    import torch

    from trainwise.measure import kernels as K
    from trainwise.train.precision import DTYPES

    budget = K.KERNEL_BUDGET_S if budget_s is None else budget_s

    def keep(key: str, seconds: float) -> None:
        timed[key] = min(seconds, timed.get(key, seconds))

    with torch.random.fork_rng(devices=[]):
        for key, op in todo.items():
            dtype, dev = DTYPES[op.dtype], torch.device(device)
            if op.cls == "attention":
                fwd, bwd = K.attention_call_seconds(op.shape, dtype, dev, budget)
                keep(f"{key}|forward", fwd)
                keep(f"{key}|backward", bwd)
            else:
                keep(key, K.matmul_call_seconds(op.shape, op.layout, dtype, dev, grouped="grouped_mm" in op.name,
                                                budget_s=budget))


def time_new_kernels(ops: list[Op], p: Profile) -> None:
    """Time, on this device, the matmul and attention calls of `ops` the kernel table lacks (when the
    profile is this device's: Profile.on_device), in KERNEL_PASSES passes keeping each one's fastest.
    (Tried: scaling each pass by how much slower a few of the calibration's own matmuls ran beside it.
    In this VM's slow state ~3 ms matmuls ran 1.5x slow and 20 ms ones were not slowed, so the default
    step was planned 40% short; not kept.)"""
    todo = kernels_to_time(ops, p.kernels)
    if p.device is None or not todo:
        return
    import torch

    from trainwise.train.allocator import keep_freed_memory

    keep_freed_memory()
    before = torch.get_num_threads()
    if p.threads:
        torch.set_num_threads(p.threads)
    timed: dict[str, float] = {}
    try:
        for _ in range(KERNEL_PASSES):
            time_kernel_pass(todo, p.device, timed)
    finally:
        torch.set_num_threads(before)
    p.new_kernels.update(timed)
    p.kernels.update(timed)


def kernel_seconds(op: Op, p: Profile) -> float | None:
    """Seconds per call of a matmul or attention op from the profile's kernel table (time_new_kernels
    fills it), or None (too large to time, or no table entry and no device to time it on)."""
    key, small = _kernel_entry(op)
    if not key:
        return None
    if key not in p.kernels and small:
        time_new_kernels([op], p)
    return p.kernels.get(key)


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
    a torch.compile'd step whose compute precision is `precision`)."""
    if op.cls in ("matmul", "attention"):
        per_call = kernel_seconds(op, p)
        if per_call is not None:
            return per_call * op.calls, f"{op.cls} timed at its shape"
    if op.cls == "matmul":
        _, peak, bw = _dtype(p.matmul, op.dtype)
        return op.flops / peak + op.bytes / bw, "matmul F/P + Q/BW"
    if op.cls == "attention":
        phase = "backward" if "backward" in op.name else "forward"
        return op.flops / _dtype(p.attention, op.dtype)[phase][1], f"attention {phase} F/R"
    ew = _dtype(p.elementwise, op.dtype)
    grid = ew.get(op.cls, ew["elementwise/other"])
    eager = op.bytes / elementwise_rate(grid, op.per_call_bytes())
    if compiled and op.phase != "optimizer":
        factor = COMPILED_ELEMENTWISE.get(precision, COMPILED_ELEMENTWISE["fp32"])
        return factor * eager, f"fused: {factor} x Q/BW(q)"
    return eager, "Q/BW(q)"


def predict_step(ops: list[Op], p: Profile, n_param_tensors: int, n_params: int, compiled: bool = False,
                 comm_s: float = 0.0, optimizer: str = "adamw", async_launch: bool = False,
                 precision: str = "fp32") -> StepTime:
    """Predicted seconds of one optimizer step whose operators are `ops` (cost.ops.step_ops), run in
    compute precision `precision`."""
    time_new_kernels(ops, p)  # all of the step's new kernels together, in passes
    timed = []
    opt_ops = [o for o in ops if o.phase == "optimizer"]
    opt_bytes = sum(o.bytes for o in opt_ops) or 1.0
    opt_total = p.optimizer[0] * n_param_tensors + p.optimizer[1] * n_params if optimizer == "adamw" else None
    for op in ops:
        if op.phase == "optimizer" and opt_total is not None:
            timed.append(OpTime(op, opt_total * op.bytes / opt_bytes, "optimizer a*tensors + b*params, by bytes"))
        else:
            seconds, how = op_seconds(op, p, compiled, precision)
            how = how if p.in_step == 1 else f"{how}, x{p.in_step:.3g} in a step"
            timed.append(OpTime(op, seconds * p.in_step, how))
    compute = sum(t.seconds for t in timed)
    eager_calls = sum(o.calls for o in ops if o.phase != "optimizer" and (not compiled or o.cls == "matmul"))
    if opt_total is None:  # optimizer ops priced one by one: they pay the eager per-op cost too
        eager_calls += sum(o.calls for o in opt_ops)
    overhead = p.overhead[0] + p.overhead[1] * eager_calls
    # A GPU runs its kernels while the host queues the next ones: the step takes the longer of the two.
    busy = max(compute, overhead) if async_launch else compute + overhead
    p.save_kernels()
    return StepTime(busy + comm_s, compute, overhead, comm_s, timed, p.source, compiled)


# --- communication --------------------------------------------------------------------------------

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


def ring_seconds(kind: str, nbytes: float, world: int, link: list[float], messages: int = 1) -> float:
    """Ring collective over `world` ranks of a buffer of nbytes (full size): all-reduce moves
    2(n-1)/n x bytes per rank in 2(n-1) hops; all-gather and reduce-scatter (n-1)/n x bytes in n-1 hops
    (Thakur et al. 2005). latency x hops x messages + moved / bandwidth."""
    if world <= 1:
        return 0.0
    latency, bw = link
    factor, hops = {"all_reduce": (2, 2), "all_gather": (1, 1), "reduce_scatter": (1, 1),
                    "broadcast": (1, 1)}[kind]
    return latency * hops * (world - 1) * messages + factor * (world - 1) / world * nbytes / bw


def comm_seconds(strategy: str, world: int, grad_bytes: float, param_bytes: float, n_blocks: int,
                 grad_accum: int, link: list[float], gather_bytes: float | None = None) -> dict[str, float]:
    """{collective: seconds} one step issues. ddp/zero1: one all-reduce of the gradients in 25 MiB
    buckets on the last micro-batch (zero1 then broadcasts the updated parameters); zero2: one
    all-gather of the parameters per micro-batch (kept until backward) + one reduce-scatter of the
    gradients; fsdp: all-gathers before forward and again before backward, per micro-batch. Sharded
    strategies gather per block (n_blocks + 1 messages). gather_bytes: gathered parameter bytes when
    the mixed-precision policy gathers in bf16 (default: param_bytes)."""
    gather = param_bytes if gather_bytes is None else gather_bytes
    if world <= 1 or strategy in ("none", ""):
        return {}
    if strategy in ("ddp", "zero1"):
        buckets = max(1, -(-int(grad_bytes) // DDP_BUCKET_BYTES))
        out = {"all_reduce": ring_seconds("all_reduce", grad_bytes, world, link, buckets)}
        if strategy == "zero1":
            out["broadcast"] = ring_seconds("broadcast", param_bytes, world, link, n_blocks + 1)
        return out
    gathers = grad_accum * (2 if strategy == "fsdp" else 1)
    return {"all_gather": gathers * ring_seconds("all_gather", gather, world, link, n_blocks + 1),
            "reduce_scatter": ring_seconds("reduce_scatter", grad_bytes, world, link, n_blocks + 1)}


def exposed_comm(comm: dict[str, float], compute_s: float, overlaps: bool) -> float:
    """Seconds of communication the step waits for. On a GPU, NCCL runs beside the kernels (DDP's
    buckets during backward, FSDP's prefetched gathers during forward and backward), so only what
    outlasts the forward+backward compute shows; on a CPU, gloo needs the same cores as the compute,
    so all of it shows."""
    total = sum(comm.values())
    return max(0.0, total - compute_s) if overlaps else total


# --- the planner's entry point ----------------------------------------------------------------------

_OPS_CACHE: dict[str, list[Op]] = {}


def cached_step_ops(model, micro_batch: int, seq_len: int, precision: str, checkpointing: str, compiled: bool,
                    optimizer: str) -> list[Op]:
    """cost.ops.step_ops of one micro-batch, memoised: a run asks for its plan several times."""
    from trainwise.cost.ops import step_ops

    key = repr((model, micro_batch, seq_len, precision, checkpointing, compiled, optimizer))
    if key not in _OPS_CACHE:
        _OPS_CACHE[key] = step_ops(model, micro_batch, seq_len, precision, checkpointing, 1, compiled, optimizer)
    return _OPS_CACHE[key]


def scale_batch(ops: list[Op], factor: int, seq_len: int) -> list[Op]:
    """The operators of micro-batch B x factor from those of micro-batch B (for `plan --fit`, which
    prices many micro-batches from one recorded step): forward and backward work grows with the tokens;
    a matmul's token extent (the first of M, K, N that is a multiple of seq_len; bmm's batch) grows with
    it. Weight-sized element-wise work (an embedding's gradient) is scaled too: a small overestimate."""
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
        out.append(replace(op, shape=shape, flops=op.flops * factor, bytes=op.bytes * factor))
    return out


def strategy_for(zero: int, dp: int) -> str:
    """The trainer's strategy that a plan's ZeRO stage stands for (train.distributed)."""
    if dp <= 1:
        return "none"
    return {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}[zero]


def plan_step(model, profile: Profile, *, micro_batch: int, seq_len: int, grad_accum: int, compute_dtype: str,
              checkpointing: str, optimizer: str, zero: int, dp: int, n_params: int, grad_bytes: int,
              param_bytes: int, compiled: bool = False, cuda: bool = False, ops: list[Op] | None = None) -> StepTime:
    """Predicted time of one optimizer step of `model` as the trainer runs it on the profiled device:
    its operator list (bf16 autocast when compute_dtype is bf16/fp16; CUDA kernels on a GPU), priced by
    the profile, K micro-batches, plus the exposed communication of the strategy ZeRO-`zero` over dp."""
    precision = "fp32" if compute_dtype == "fp32" else compute_dtype
    if ops is None:
        ops = cached_step_ops(model, micro_batch, seq_len, precision, checkpointing, compiled and not cuda, optimizer)
    if cuda:
        from trainwise.cost.ops import for_cuda

        ops = for_cuda(ops)
    ops = [o.scaled(grad_accum) if o.phase != "optimizer" else o for o in ops]
    tensors = n_param_tensors(model)
    if zero >= 1 and dp > 1:  # each rank updates only its 1/dp shard of the parameters
        ops = [o if o.phase != "optimizer" else replace(o, flops=o.flops / dp, bytes=o.bytes / dp) for o in ops]
        n_params = n_params // dp
    base = predict_step(ops, profile, tensors, n_params, compiled, 0.0, optimizer, async_launch=cuda,
                        precision=precision)
    comm = comm_seconds(strategy_for(zero, dp), dp, grad_bytes, param_bytes, model.n_layers, grad_accum, profile.link,
                        param_bytes // 2 if precision != "fp32" and zero >= 2 else None)
    phases = base.by_phase()
    exposed = exposed_comm(comm, phases.get("backward", 0.0) + phases.get("forward", 0.0), overlaps=cuda)
    base.comm_s, base.seconds = exposed, base.seconds + exposed
    base.comm = comm
    return base


def n_param_tensors(model) -> int:
    """Parameter tensors of the built model (the optimizer's per-tensor cost), counted on the meta device."""
    import torch

    from trainwise.model import Transformer

    with torch.device("meta"):
        return len(list(Transformer(model).parameters()))
