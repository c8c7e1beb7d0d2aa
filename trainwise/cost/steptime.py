"""Predicted step time: the sum over the step's operators (cost.ops) of each one's calibrated time, plus
communication per strategy, plus a fixed per-step cost.

    matmul            F/P + Q/BW_mm          (P, BW_mm fitted over a grid of shapes: small ones run slow)
    attention kernel  F/R_fwd or F/R_bwd     (the SDPA kernel itself, timed forward and backward)
    everything else   Q/BW_class             (memory-bound: bytes over the bandwidth of that class of op)
    optimizer         a x tensors + b x parameters      (clip + AdamW step, timed as the trainer runs it)
    eager overhead    per-op x calls + per-step          (Python, dispatch, autograd; from tiny models)

The fits' intercepts are left out: the per-call cost is the eager overhead term, measured in a real step.
A compiled step (torch.compile, CPU) runs the same matmuls; inductor fuses the rest into a few kernels,
which move COMPILED_BYTES of the eager bytes and pay no per-op overhead. The profile comes from
`trainwise hardware --calibrate` (source "calibrated") or, for a table GPU, from DEFAULT_EFFICIENCY
applied to its datasheet (source "table defaults": "from table, uncalibrated").
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from trainwise.cost.ops import Op

# A fused inductor kernel reads a chain's inputs once and writes its outputs once, so a compiled step
# moves a fraction of the eager element-wise bytes. An ESTIMATE, not yet fitted: the 2-core machine was
# too loaded to measure it (benchmarks/RESULTS.md, "Step-time model"); fit it with
# `python benchmarks/time_model.py --only 19,20,21` on a quiet machine.
COMPILED_BYTES = 0.35

# Uncalibrated accelerators: fractions of the datasheet figure a well-fed kernel reaches, round figures
# of the commonly reported range (not measured by trainwise): large bf16 GEMMs 70-80% of an A100/H100's
# dense peak, flash attention 50-70% forward and less backward, element-wise kernels 70-90% of HBM
# bandwidth; a PyTorch eager op costs ~5-10 us of launch and Python. `benchmarks/gpu_check.py` measures.
DEFAULT_EFFICIENCY = {"matmul": 0.7, "attention_forward": 0.5, "attention_backward": 0.35, "bandwidth": 0.7}
DEFAULT_OVERHEAD = [1e-3, 6e-6]  # [seconds per step, seconds per eager op] on a GPU host
ADAMW_BYTES_PER_PARAM = 28  # fused AdamW, fp32: read+write param, m, v (24) + read grad (4)


@dataclass
class Profile:
    """What a device does per unit of work; see the module docstring. Rates in FLOP/s and bytes/s."""

    matmul: dict[str, list[float]]  # dtype -> [c s, P FLOP/s, BW bytes/s]
    elementwise: dict[str, dict[str, list[float]]]  # dtype -> class -> [c s, BW bytes/s]
    attention: dict[str, dict[str, list[float]]]  # dtype -> "forward"/"backward" -> [c s, FLOP/s]
    optimizer: list[float]  # [s per parameter tensor, s per parameter] of clip + AdamW step
    overhead: list[float]  # [s per step, s per eager op call]
    source: str  # "calibrated" | "table defaults"
    link: list[float] = field(default_factory=lambda: [5e-5, 1e9])  # collectives: [latency s, bytes/s]
    link_source: str = "default"

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        return cls(**{k: d[k] for k in ("matmul", "elementwise", "attention", "optimizer", "overhead", "source")},
                   link=d.get("link", [5e-5, 1e9]), link_source=d.get("link_source", "default"))

    def to_json(self) -> dict:
        return dict(self.__dict__)


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
        elementwise={d: {c: [0.0, bw] for c in classes} for d in dtypes},
        attention={d: {"forward": [0.0, e["attention_forward"] * p], "backward": [0.0, e["attention_backward"] * p]}
                   for d, p in dtypes.items()},
        optimizer=[0.0, ADAMW_BYTES_PER_PARAM / bw], overhead=list(DEFAULT_OVERHEAD), source="table defaults",
        link=[1e-5, 100e9], link_source="default (100 GB/s, 10 us; interconnect not in the table)")


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


def op_seconds(op: Op, p: Profile, compiled: bool = False) -> tuple[float, str]:
    """Time of all calls of one operator, without the per-call overhead, and the rule used."""
    if op.cls == "matmul":
        _, peak, bw = _dtype(p.matmul, op.dtype)
        return op.flops / peak + op.bytes / bw, "matmul F/P + Q/BW"
    if op.cls == "attention":
        phase = "backward" if "backward" in op.name else "forward"
        return op.flops / _dtype(p.attention, op.dtype)[phase][1], f"attention {phase} F/R"
    ew = _dtype(p.elementwise, op.dtype)
    bw = ew.get(op.cls, ew["elementwise/other"])[1]
    if compiled and op.phase != "optimizer":
        return COMPILED_BYTES * op.bytes / _dtype(p.elementwise, "fp32")["elementwise/other"][1], "fused Q/BW"
    return op.bytes / bw, "Q/BW"


def predict_step(ops: list[Op], p: Profile, n_param_tensors: int, n_params: int, compiled: bool = False,
                 comm_s: float = 0.0, optimizer: str = "adamw", async_launch: bool = False) -> StepTime:
    """Predicted seconds of one optimizer step whose operators are `ops` (cost.ops.step_ops)."""
    timed = []
    opt_ops = [o for o in ops if o.phase == "optimizer"]
    opt_bytes = sum(o.bytes for o in opt_ops) or 1.0
    opt_total = p.optimizer[0] * n_param_tensors + p.optimizer[1] * n_params if optimizer == "adamw" else None
    for op in ops:
        if op.phase == "optimizer" and opt_total is not None:
            timed.append(OpTime(op, opt_total * op.bytes / opt_bytes, "optimizer a*tensors + b*params, by bytes"))
        else:
            timed.append(OpTime(op, *op_seconds(op, p, compiled)))
    compute = sum(t.seconds for t in timed)
    eager_calls = sum(o.calls for o in ops if o.phase != "optimizer" and (not compiled or o.cls == "matmul"))
    if opt_total is None:  # optimizer ops priced one by one: they pay the eager per-op cost too
        eager_calls += sum(o.calls for o in opt_ops)
    overhead = p.overhead[0] + p.overhead[1] * eager_calls
    # A GPU runs its kernels while the host queues the next ones: the step takes the longer of the two.
    busy = max(compute, overhead) if async_launch else compute + overhead
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
            if dims[0] > 1:
                dims[0] *= factor
            else:
                i = next((i for i in (1, 2, 3) if dims[i] % seq_len == 0), 1)
                dims[i] *= factor
            shape = tuple(dims)
        out.append(Op(op.name, op.cls, op.phase, op.dtype, shape, op.calls, op.flops * factor, op.bytes * factor))
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
        ops = [o if o.phase != "optimizer" else Op(o.name, o.cls, o.phase, o.dtype, o.shape, o.calls, o.flops / dp,
                                                    o.bytes / dp) for o in ops]
        n_params = n_params // dp
    base = predict_step(ops, profile, tensors, n_params, compiled, 0.0, optimizer, async_launch=cuda)
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
