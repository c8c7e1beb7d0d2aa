"""Micro-benchmarks that describe a device for the step-time model (trainwise.cost.steptime).

Each figure is the fast end (fast_seconds: 10th percentile) of repeated timings of the kernels the
trainer really runs, with every torch thread, after a warm-up; fits are cost.time.fit_linear (least
squares in relative error, coefficients >= 0):
- matmuls and attention at the exact shapes (and operand layouts) of a planned step, on demand
  (time_new_kernels; cached in the kernel table, trainwise.hardware.cache); for matmuls too large to
  time, the best throughput over a grid of 1024/4096 shapes per dtype;
- element-wise work per class (plain, activation, norm, softmax/cross-entropy) and dtype, at sizes from
  a core's cache to far past the shared cache: bytes/s per size;
- attention without a timed shape: the SDPA CPU kernel forward and backward, t = F/R;
- the optimizer step (fused AdamW + gradient clipping), its operands in memory as a step finds them:
  t = a x tensors + b x elements;
- (trainwise.measure.reference: real eager steps of reference models, for the per-operator overhead
  the kernel timings leave out and the factor by which kernels run slower inside a step than alone);
- under torchrun, the collectives (collective_fit).
FLOPs and bytes are counted as the trainwise operator list (cost.ops) counts them, so the fits and the
model that uses them count alike.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainwise.cost.ops import Op
from trainwise.cost.steptime import kernels_to_time
from trainwise.cost.time import fit_linear
from trainwise.hardware.profile import Profile
from trainwise.measure.flopcount import flop_counter
from trainwise.model.moe import pad_multiple, padded_groups, pads_groups
from trainwise.runtime.allocator import keep_freed_memory
from trainwise.runtime.precision import DTYPES

# M, K, N from this set: the matmuls too large to time at their own shape (cost.steptime.MAX_KERNEL_FLOPS)
# run at about this throughput; smaller ones are timed at their shape (kernel table), so no fit over
# small shapes is needed (a two-parameter F/P + Q/BW fit over 64..4096 moved by 2.6x between calibrations)
MATMUL_SIZES = (1024, 4096)


def _rate(seconds_per_unit: float) -> float:
    """Units per second from a fitted time per unit (a fit of 0 means: too fast to see, i.e. unbounded)."""
    return 1.0 / seconds_per_unit if seconds_per_unit > 0 else 1e30


def fast_seconds(fn, budget_s: float = 0.06, min_reps: int = 5, max_reps: int = 200, mean: bool = False) -> float:
    """Undisturbed wall time of fn(): the 10th percentile of repeated calls after one warm-up, repeated
    for about budget_s (at least min_reps). A VM's speed can drift by 20-30% over seconds and
    interference only adds time, so the fast end is the figure that repeats from one calibration to the
    next (the median moved with the drift). Kernels are timed hot; in_step carries what a step adds.
    mean=True: the mean instead, for calls whose cost varies by design (each
    grouped matmul call with its own routing: some build a kernel, some find one)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    fn()
    sync()
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while len(times) < min_reps or (time.perf_counter() < end and len(times) < max_reps):
        start = time.perf_counter()
        fn()
        sync()  # a GPU kernel is timed to its end, not to its launch
        times.append(time.perf_counter() - start)
    return sum(times) / len(times) if mean else sorted(times)[len(times) // 10]


def matmul_grid(dtype: torch.dtype, device: torch.device) -> list[tuple[int, int, int, float]]:
    """(M, K, N, seconds) for the shapes of MATMUL_SIZES whose product is at most 4096*1024*1024, each the
    fast end of repeated calls (fast_seconds)."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for m in MATMUL_SIZES:
        for k in MATMUL_SIZES:
            for n in MATMUL_SIZES:
                if m * k * n > 4096 * 1024 * 1024:
                    continue
                a = torch.randn(m, k, generator=gen, device=device).to(dtype)
                b = torch.randn(k, n, generator=gen, device=device).to(dtype)
                out.append((m, k, n, fast_seconds(lambda: torch.mm(a, b), 0.2, 3)))
    return out


# class -> (kernel of two same-shape tensors x, y; tensor-sizes it moves as cost.ops counts bytes:
# every tensor input read + every output written)
ELEMENTWISE = {
    "elementwise/other": (lambda x, y: x * y, 3),
    "activation": (lambda x, y: F.silu(x), 2),
    "norm": (lambda x, y: x.pow(2), 2),
    "softmax/cross-entropy": (lambda x, y: torch.log_softmax(x, dim=-1), 2),
}
# Bytes one call moves: in a core's cache, in the shared cache, from memory, and past the allocator's
# mmap threshold (glibc: up to 32 MiB), where every output is written to freshly faulted pages.
ELEMENTWISE_BYTES = (1 << 14, 1 << 18, 1 << 21, 1 << 24, 1 << 27)


def elementwise_grid(dtype: torch.dtype, device: torch.device) -> dict[str, list[list[float]]]:
    """{class: [[bytes per call, bytes/s], ...]} at ELEMENTWISE_BYTES: element-wise work runs at a rate
    that depends on its size (cost.steptime.elementwise_rate interpolates), and a step has all sizes."""
    grid = {}
    for cls, (fn, passes) in ELEMENTWISE.items():
        rows = []
        for nbytes in ELEMENTWISE_BYTES:
            numel = max(4096, nbytes // (passes * torch.tensor([], dtype=dtype).element_size()) // 4096 * 4096)
            x, y = (torch.randn(numel // 4096, 4096, device=device).to(dtype) for _ in range(2))
            moved = passes * x.numel() * x.element_size()
            rows.append([float(moved), moved / fast_seconds(lambda: fn(x, y), 0.05, 3)])
        grid[cls] = rows
    return grid


# Seconds of repeated calls per timing of a kernel for the kernel table (at least 3 calls); cost.steptime
# times each new kernel in three passes, so a plan of the default model's ~20 new kernels takes ~1.5 s
KERNEL_BUDGET_S = 0.02


def _operand(rows: int, cols: int, layout: str, dtype: torch.dtype, device: torch.device, gen,
             batch: int = 0) -> torch.Tensor:
    """A (rows, cols) matrix (or `batch` of them), row-major (N) or as the transposed view of a (cols, rows)
    one (T)."""
    lead = (batch,) if batch else ()
    if layout == "T":
        return torch.randn(*lead, cols, rows, generator=gen, device=device).to(dtype).transpose(-2, -1)
    return torch.randn(*lead, rows, cols, generator=gen, device=device).to(dtype)


def matmul_call_seconds(shape: tuple[int, ...], layout: str, dtype: torch.dtype, device: torch.device,
                        grouped: bool = False, budget_s: float = KERNEL_BUDGET_S) -> float:
    """Seconds of one (batch, M, K, N) matmul with operands laid out as `layout` (e.g. "NT": x @ W.t()),
    the fast end of repeated calls (fast_seconds): the same FLOPs run 2-5x apart with the shape and the
    layout on a CPU (a bf16 4096x256x4096 mm ran at a sixth of the rate of a 4096x256x704 one,
    benchmarks/RESULTS.md)."""
    batch, m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(0)
    la, lb = (layout or "NN")[:2]
    if grouped:
        return _grouped_mm_seconds(shape, layout, dtype, device, gen, budget_s)
    if batch > 1:
        a, b = _operand(m, k, la, dtype, device, gen, batch), _operand(k, n, lb, dtype, device, gen, batch)
        return fast_seconds(lambda: torch.bmm(a, b), budget_s, 3)
    a, b = _operand(m, k, la, dtype, device, gen), _operand(k, n, lb, dtype, device, gen)
    return fast_seconds(lambda: torch.mm(a, b), budget_s, 3)


_routings = 0
GROUPED_CALLS = 24  # timed calls of one grouped matmul at most, each with its own routing


def _grouped_mm_seconds(shape: tuple[int, ...], layout: str, dtype: torch.dtype, device: torch.device, gen,
                        budget_s: float) -> float:
    """One torch._grouped_mm call of an MoE layer as cost.ops records it: (experts, rows per expert, K, N)
    for (S, K) x (E, K, N); with layout "..:split-k", (experts, K', rows per expert, N) for the weight
    gradient (K', S) x (S, N) -> (E, K', N). Every call routes the S rows to the experts anew, as training
    does, with group sizes as a router makes them, uneven (a flat Dirichlet's shares of the rows).

    Where the model pads its groups (trainwise.model.moe.pads_groups: a CPU in 16 bits), the calls are
    padded the same way and timed in a run's steady state: every padded size met once before the timed
    calls (their mean), as a run meets them in its first steps. Unpadded, every group size is new, so a
    CPU builds a fresh kernel for most calls (oneDNN makes one per shape, ~ms each): the mean of calls
    never seen before is their cost (routings cycled between calls, and the fast end of the timings,
    priced a step's grouped matmuls 30% short: benchmarks/RESULTS.md)."""
    split_k = layout.endswith(":split-k")
    experts, rows = shape[0], shape[2] if split_k else shape[1]
    total = experts * rows
    # routings never drawn before in this process (a seed per call): a second timing of the same shape
    # must not find the first one's kernels built (cost.steptime times each kernel in several passes)
    global _routings
    _routings += 1
    routes = torch.Generator(device=device).manual_seed(1000 + _routings)
    pad = pads_groups(device.type, dtype)
    offsets, padded_total = [], total
    for _ in range(GROUPED_CALLS + 1):
        shares = -torch.log(torch.rand(experts, generator=routes))  # normalised: Dirichlet(1, ..., 1)
        counts = (shares / shares.sum() * total).floor().to(torch.int64)
        counts[0] += total - counts.sum()
        if pad:
            counts = padded_groups(counts, pad_multiple(total))[0]
            padded_total = max(padded_total, int(counts.sum()))
        offsets.append(counts.cumsum(0).to(torch.int32).to(device))
    if split_k:
        a = _operand(shape[1], padded_total, layout[0], dtype, device, gen)
        b = _operand(padded_total, shape[3], layout[1], dtype, device, gen)
    else:
        a = _operand(padded_total, shape[2], layout[0], dtype, device, gen)
        b = _operand(shape[2], shape[3], layout[1], dtype, device, gen, experts)
    if pad:  # the steady state: every padded size built once (rows past a call's last group are not read)
        for offs in offsets:
            torch._grouped_mm(a, b, offs=offs)
    calls = iter(offsets * 2)
    return fast_seconds(lambda: torch._grouped_mm(a, b, offs=next(calls)), budget_s, 3, GROUPED_CALLS, mean=True)


def attention_call_seconds(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                           budget_s: float = KERNEL_BUDGET_S) -> tuple[float, float]:
    """(forward, backward) seconds of one causal SDPA call at (batch, heads, kv heads, T, head dim), as
    the model calls it (grouped-query attention through enable_gqa)."""
    batch, heads, kv, t_len, hd = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, t_len, hd, generator=gen, device=device).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, kv, t_len, hd, generator=gen, device=device).to(dtype).requires_grad_()
            for _ in range(2))

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)

    grad = torch.randn_like(fwd())
    t_fwd = fast_seconds(fwd, budget_s, 3)
    t_both = fast_seconds(lambda: torch.autograd.grad(fwd(), (q, k, v), grad), 1.5 * budget_s, 3)
    return t_fwd, max(t_both - t_fwd, 1e-7)


# New kernels are timed in this many passes over all of a plan's new kernels, each keeping its fastest:
# the passes span a second or more, so one slow spell of the machine (a VM's speed can drift 20-30% over
# seconds) does not get written into the table for good (a table timed in one pass put a whole benchmark
# run 20% high, benchmarks/RESULTS.md).
KERNEL_PASSES = 3


def time_kernel_pass(todo: dict[str, Op], device: str, timed: dict[str, float], budget_s: float | None = None) -> None:
    """Time each kernel of `todo` (kernels_to_time) once more on `device` with the current torch threads,
    keeping each one's fastest in `timed` (seconds per call; attention as "...|forward" and "...|backward")."""
    budget = KERNEL_BUDGET_S if budget_s is None else budget_s

    def keep(key: str, seconds: float) -> None:
        timed[key] = min(seconds, timed.get(key, seconds))

    with torch.random.fork_rng(devices=[]):
        for key, op in todo.items():
            dtype, dev = DTYPES[op.dtype], torch.device(device)
            if op.cls == "attention":
                fwd, bwd = attention_call_seconds(op.shape, dtype, dev, budget)
                keep(f"{key}|forward", fwd)
                keep(f"{key}|backward", bwd)
            else:
                keep(key, matmul_call_seconds(op.shape, op.layout, dtype, dev, grouped="grouped_mm" in op.name,
                                                budget_s=budget))


def time_new_kernels(ops: list[Op], p: Profile) -> None:
    """Time, on this device, the matmul and attention calls of `ops` the kernel table lacks (when the
    profile is this device's: Profile.on_device), in KERNEL_PASSES passes keeping each one's fastest,
    and cache them (Profile.save_kernels). Each pass keeps its own reading: small anchor matmuls timed
    beside it slow down more than a step's larger ones in a VM's slow state, so they cannot rescale it."""
    todo = kernels_to_time(ops, p.kernels)
    if p.device is None or not todo:
        return
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
    p.save_kernels()


def attention_fits(dtype: torch.dtype, device: torch.device) -> dict[str, list[float]]:
    """{"forward"|"backward": [0, FLOP/s]} of causal SDPA at (B*nh, T, hd) shapes of small LLMs: t = F/R."""
    fwd_rows, bwd_rows = [], []
    for bh, t_len, hd in ((8, 128, 64), (32, 256, 64), (16, 512, 64), (8, 1024, 32)):
        q, k, v = (torch.randn(1, bh, t_len, hd, device=device).to(dtype).requires_grad_() for _ in range(3))

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        out = fwd()
        grad = torch.randn_like(out)
        with flop_counter() as counter:
            y = fwd()
            y.backward(grad)
        total = counter.get_total_flops()
        f_fwd = total / 3  # the counter's convention: backward = 2 x forward
        t_fwd = fast_seconds(fwd, 0.03, 3)
        t_both = fast_seconds(lambda: torch.autograd.grad(fwd(), (q, k, v), grad), 0.05, 3)
        fwd_rows.append(([f_fwd], t_fwd))
        bwd_rows.append(([2 * f_fwd], max(t_both - t_fwd, 1e-7)))
    return {phase: [0.0, _rate(fit_linear(rows)[0])] for phase, rows in (("forward", fwd_rows), ("backward", bwd_rows))}


def last_level_cache_bytes() -> int:
    """The CPU's largest cache in bytes (Linux sysfs; 64 MiB where it cannot be read)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * unit)
        except ValueError:
            continue
    return max(sizes, default=64 << 20)


def evicting_write(device: torch.device):
    """A call that overwrites a buffer larger than the device's caches (1.25 x a CPU's last-level cache,
    at most 1 GiB; 256 MiB on a GPU, past any L2): what runs after it finds its operands in memory."""
    nbytes = min(int(1.25 * last_level_cache_bytes()), 1 << 30) if device.type == "cpu" else 256 << 20
    buf = torch.empty(nbytes // 4, device=device)
    return lambda: buf.fill_(1.0)


def optimizer_fit(device: torch.device, reps: int = 8) -> list[float]:
    """[seconds per tensor, seconds per element] of clip_grad_norm_ + AdamW(fused).step() + zero_grad,
    the trainer's CPU update (runtime.optim.build_optimizer), from three parameter sets, each call
    timed with its operands in memory (the caches overwritten first): in a step the backward has evicted
    the gradients, parameters and states since the last update. Timed hot on a CPU whose last-level cache
    holds the sets whole, the update reads several times faster than it runs in a step (benchmarks/RESULTS.md,
    "The optimizer's operands in memory")."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    evict = evicting_write(device)
    rows = []
    for n_tensors, numel in ((8, 1 << 20), (128, 1 << 14), (32, 1 << 17)):
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(n_tensors)]
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)  # as train/optim.py builds it, CPU and CUDA
        times = []
        for rep in range(reps + 1):  # the first builds the states
            for p in params:
                p.grad = torch.ones_like(p)
            evict()
            sync()
            start = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if rep:
                times.append(time.perf_counter() - start)
        rows.append(([n_tensors, n_tensors * numel], sorted(times)[len(times) // 10]))
    a, b = fit_linear(rows)
    return [a, b]


def collective_fit(sizes: tuple[int, ...] = (1 << 12, 1 << 20, 1 << 23)) -> dict:
    """Latency and bandwidth of the collectives the strategies issue, on the initialised process group
    (run by every rank of a torchrun job): all-reduce, all-gather and reduce-scatter of fp32 buffers of
    `sizes` bytes, the fast end of 8 timings each, fitted together to the ring model of cost.steptime.ring_seconds:
    t = latency x hops x (n-1) + factor x (n-1)/n x bytes / bandwidth. Returns {"link": [s, bytes/s],
    "backend", "world", "points": [[kind, bytes, seconds], ...]}."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows, points = [], []
    for nbytes in sizes:
        full = torch.ones(nbytes // 4, device=device)
        shard = torch.ones(nbytes // 4 // world, device=device)
        calls = {"all_reduce": (lambda: dist.all_reduce(full), 2),
                 "all_gather": (lambda: dist.all_gather_single(full[: shard.numel() * world], shard), 1),
                 "reduce_scatter": (lambda: dist.reduce_scatter_single(shard, full[: shard.numel() * world]), 1)}
        for kind, (fn, factor) in calls.items():
            dist.barrier()
            # a fixed count on every rank (a time budget would give each rank its own count: a deadlock)
            t = torch.tensor([fast_seconds(fn, 0.0, 8, 8)], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank is what a step waits for
            rows.append(([factor * (world - 1), factor * (world - 1) / world * nbytes], float(t)))
            points.append([kind, nbytes, float(t)])
    latency, inv_bw = fit_linear(rows)
    return {"link": [latency, _rate(inv_bw)], "backend": dist.get_backend(), "world": world, "points": points,
            "rank": rank}
