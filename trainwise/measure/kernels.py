"""Micro-benchmarks that describe a device for the step-time model (trainwise.cost.steptime).

Each figure is the fast end (fast_seconds: 10th percentile) of repeated timings of the kernels the
trainer really runs, with every torch thread, after a warm-up; fits are cost.time.fit_linear (least
squares in relative error, coefficients >= 0):
- matmuls and attention at the exact shapes (and operand layouts) of a planned step, on demand
  (matmul_call_seconds, attention_call_seconds; cached in cost.steptime's kernel table); for matmuls
  too large to time, the best throughput over a grid of 1024/4096 shapes per dtype;
- element-wise work per class (plain, activation, norm, softmax/cross-entropy) and dtype, at sizes from
  a core's cache to far past the shared cache: bytes/s per size;
- attention without a timed shape: the SDPA CPU kernel forward and backward, t = F/R;
- the optimizer step (fused AdamW + gradient clipping): t = a x tensors + b x elements;
- real eager steps of reference models (ReferenceSteps): the per-operator overhead (dispatch + autograd) the
  kernel timings leave out, and the factor by which kernels run slower inside a step than alone;
- under torchrun, the collectives (collective_fit).
FLOPs and bytes are counted as the trainwise operator list (cost.ops) counts them, so the fits and the
model that uses them count alike.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from trainwise.cost.time import fit_linear

# M, K, N from this set: the matmuls too large to time at their own shape (cost.steptime.MAX_KERNEL_FLOPS)
# run at about this throughput; smaller ones are timed at their shape (kernel table), so no fit over
# small shapes is needed (a two-parameter F/P + Q/BW fit over 64..4096 moved by 2.6x between calibrations)
MATMUL_SIZES = (1024, 4096)


def _rate(seconds_per_unit: float) -> float:
    """Units per second from a fitted time per unit (a fit of 0 means: too fast to see, i.e. unbounded)."""
    return 1.0 / seconds_per_unit if seconds_per_unit > 0 else 1e30


def fast_seconds(fn, budget_s: float = 0.06, min_reps: int = 5, max_reps: int = 200) -> float:
    """Undisturbed wall time of fn(): the 10th percentile of repeated calls after one warm-up, repeated
    for about budget_s (at least min_reps). This machine's speed drifts by 20-30% over seconds and
    interference only adds time, so the fast end is the figure that repeats from one calibration to the
    next (the median moved with the drift). Kernels are timed hot; in_step carries what a step adds.
    (Tried: overwriting the core's cache before each call. One benchmark run gave a median error of
    11.8% against 6.6% the hour before with hot timings: inconclusive on this drifting machine, not kept.)"""
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
    return sorted(times)[len(times) // 10]


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
    layout on a CPU (a 4096x256x4096 bf16 mm reached 440 GFLOP/s, a 4096x256x704 one 2,700 here)."""
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


def _grouped_mm_seconds(shape: tuple[int, ...], layout: str, dtype: torch.dtype, device: torch.device, gen,
                        budget_s: float) -> float:
    """One torch._grouped_mm call of an MoE layer as cost.ops records it: (experts, rows per expert, K, N)
    for (S, K) x (E, K, N); with layout "..:split-k", (experts, K', rows per expert, N) for the weight
    gradient (K', S) x (S, N) -> (E, K', N). Each call routes the S rows to the experts anew (a seeded
    uniform draw), as training does: every group size is new, so a CPU builds a fresh kernel per call
    (oneDNN makes one per shape, ~ms each); timed at fixed sizes the same call ran 4x faster than in a step."""
    split_k = layout.endswith(":split-k")
    experts, rows = shape[0], shape[2] if split_k else shape[1]
    total = experts * rows
    # routings never drawn before in this process (a seed per call): a second timing of the same shape
    # must not find the first one's kernels built (cost.steptime times each kernel in several passes)
    global _routings
    _routings += 1
    routes = torch.Generator(device=device).manual_seed(1000 + _routings)
    offsets = [torch.bincount(torch.randint(0, experts, (total,), generator=routes, device=device),
                              minlength=experts).cumsum(0).to(torch.int32) for _ in range(16)]
    if split_k:
        a = _operand(shape[1], total, layout[0], dtype, device, gen)
        b = _operand(total, shape[3], layout[1], dtype, device, gen)
    else:
        a = _operand(total, shape[2], layout[0], dtype, device, gen)
        b = _operand(shape[2], shape[3], layout[1], dtype, device, gen, experts)
    calls = iter(range(1 << 30))
    return fast_seconds(lambda: torch._grouped_mm(a, b, offs=offsets[next(calls) % len(offsets)]), budget_s, 3)


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


def attention_fits(dtype: torch.dtype, device: torch.device) -> dict[str, list[float]]:
    """{"forward"|"backward": [0, FLOP/s]} of causal SDPA at (B*nh, T, hd) shapes of small LLMs: t = F/R."""
    from trainwise.measure.flopcount import flop_counter

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


def optimizer_fit(device: torch.device) -> list[float]:
    """[seconds per tensor, seconds per element] of clip_grad_norm_ + AdamW(fused).step() + zero_grad,
    the trainer's CPU update (train.optim.build_optimizer), from two parameter sets."""
    rows = []
    for n_tensors, numel in ((8, 1 << 20), (128, 1 << 14), (32, 1 << 17)):
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(n_tensors)]
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)  # as train/optim.py builds it, CPU and CUDA

        def step():
            for p in params:
                p.grad = torch.ones_like(p)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        grad_fill = fast_seconds(lambda: [torch.ones_like(p) for p in params], 0.02, 3)
        rows.append(([n_tensors, n_tensors * numel], max(fast_seconds(step, 0.1, 3) - grad_fill, 1e-7)))
    a, b = fit_linear(rows)
    return [a, b]


# Reference steps the step fit runs: unlike the configurations benchmarks/time_model.py checks, and from
# overhead-bound (d_model 16) to kernel-bound (d_model 192), fp32 and bf16: (model, micro-batch, T, precision)
REFERENCE_STEPS = (
    (dict(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=32), 1, 8, "fp32"),
    (dict(vocab_size=64, d_model=16, n_layers=6, n_heads=2, n_kv_heads=2, ffn_hidden=32), 1, 8, "fp32"),
    (dict(vocab_size=1024, d_model=128, n_layers=3, n_heads=2, n_kv_heads=2, ffn_hidden=384), 16, 64, "bf16"),
    (dict(vocab_size=2048, d_model=192, n_layers=2, n_heads=3, n_kv_heads=1, ffn_hidden=512), 8, 192, "bf16"),
    (dict(vocab_size=2048, d_model=192, n_layers=2, n_heads=3, n_kv_heads=1, ffn_hidden=512), 4, 192, "fp32"),
)


OVERHEAD_REFERENCES = 2  # the first two: kernels ~10% of their step, the rest Python, dispatch, autograd
SAMPLE_S = 0.01  # seconds of calls per reference step and sample (at least one call)


class ReferenceSteps:
    """Real eager steps of REFERENCE_STEPS with the trainer's own step, sampled again and again over the
    whole calibration (sample() after each of its parts), each keeping its fastest, and their matmul and
    attention calls timed alone in the same samples; then fit(profile) says what a real eager step adds to its
    kernels timed one by one: t = per step + per op x calls + in_step x (its operators' times from
    `profile`, a cost.steptime.Profile) + its optimizer update.

    Why samples spread so widely: these VMs switch between a fast and a slow state for seconds to tens
    of seconds at a time (AMD EPYC, 2026-12-01: the d192 reference step 57-59 ms for ~10 s, then 69-72 ms
    for ~15 s, in one process with nothing else running, while a 1024 bf16 matmul moved 5%), and small
    kernels lose most in the slow state. Four rounds at four points gave in_step 1.05-1.38 over eight
    calibrations; a step fitted in a slow spell predicted the default model's step 15-20% long."""

    def __init__(self, device: torch.device, time_kernels: bool = True):
        from trainwise.config import ModelConfig, TrainConfig
        from trainwise.cost.ops import step_ops
        from trainwise.measure.step import random_batches, train_step
        from trainwise.model import Transformer
        from trainwise.train.optim import build_optimizer

        self.refs, self.times, self.device = [], [], device
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.kernels: dict[str, float] = {}  # the references' matmuls and attention calls: fastest seconds
        self.time_kernels, self.todo = time_kernels, {}
        for model, batch, seq, precision in REFERENCE_STEPS:
            cfg = ModelConfig(**model, max_seq_len=seq)
            ops = [op for op in step_ops(cfg, batch, seq, precision) if op.phase != "optimizer"]
            with torch.random.fork_rng():
                torch.manual_seed(0)
                net = Transformer(cfg).to(device)
                opt = build_optimizer(net, TrainConfig())
            batches = random_batches(cfg.vocab_size, batch, seq, 1, device)
            step = (lambda net=net, opt=opt, batches=batches, precision=precision:
                    train_step(net, opt, batches, device, precision))
            step()
            tensors = list(net.parameters())
            self.refs.append((f"d{cfg.d_model} L{cfg.n_layers} B{batch} T{seq} {precision}", ops, step,
                              len(tensors), sum(p.numel() for p in tensors)))

    def sample(self) -> None:
        """Time each reference step once more (the overhead-bound ones for SAMPLE_S, a few calls), and
        (time_kernels) each of their matmul and attention calls alone once more: ~0.3 s on 2 cores. The
        steps and their kernels are timed side by side, so in_step compares one state of the machine."""
        from trainwise.cost.steptime import kernels_to_time, time_kernel_pass

        if self.time_kernels:
            self.todo = self.todo or kernels_to_time([op for ref in self.refs for op in ref[1]], {})
            time_kernel_pass(self.todo, self.device.type, self.kernels, budget_s=0.0)  # 4 calls each, the fastest
        row = []
        for _, _, step, _, _ in self.refs:
            best, end = float("inf"), time.perf_counter() + SAMPLE_S
            while best == float("inf") or time.perf_counter() < end:
                start = time.perf_counter()
                step()
                self.sync()  # a GPU step is timed to its end, not to its launch
                best = min(best, time.perf_counter() - start)
            row.append(best)
        self.times.append(row)

    def fastest(self) -> list[float]:
        """Each reference step's fastest sample, seconds."""
        return list(map(min, zip(*self.times)))

    def fit(self, profile) -> dict:
        """{"overhead": [s per step, s per op], "in_step": x, "rows": [[name, s, kernels s, calls], ...],
        "fastest": [s, ...]} (rows: without the optimizer update; fastest: whole steps), in two
        stages, each well determined (one fit of the three traded its terms off, in_step 0.9-1.7 between
        calibrations): the overhead-bound references (d_model 16, the first OVERHEAD_REFERENCES) give the
        per-step and per-op costs (Python, dispatch, autograd); the others, in_step: what their kernels
        lose inside a step (operands evicted by the step's other work, allocation), their median."""
        from trainwise.cost.steptime import op_seconds

        profile.kernels.update(self.kernels)
        profile.new_kernels.update(self.kernels)
        table = []
        fastest = self.fastest()
        for (name, ops, _, tensors, params), t in zip(self.refs, fastest):
            t_opt = profile.optimizer[0] * tensors + profile.optimizer[1] * params
            table.append([name, t - t_opt, sum(op_seconds(op, profile)[0] for op in ops), sum(op.calls for op in ops)])
        profile.save_kernels()
        per_step, per_op = fit_linear([([1.0, calls], max(t - kernels, 1e-6))
                                       for _, t, kernels, calls in table[:OVERHEAD_REFERENCES]])
        ratios = [(t - per_step - per_op * calls) / kernels for _, t, kernels, calls in table[OVERHEAD_REFERENCES:]]
        in_step = statistics.median(ratios) if ratios else 1.0
        return {"overhead": [per_step, per_op], "in_step": max(in_step, 0.5), "rows": table, "fastest": fastest}


PROBE_S = 0.6  # seconds of reference-step samples in a speed probe (at least one sample)


def reference_speed(device: torch.device, seconds: float = PROBE_S) -> list[float]:
    """The calibration's reference steps timed again now: each one's fastest over `seconds` of samples
    (seconds per step), to hold against the calibration's own (profile "reference_fastest_s"): what a
    step-time error owes to this machine's speed having moved rather than to the model. The global RNG
    is left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        refs = ReferenceSteps(device, time_kernels=False)
        end = time.perf_counter() + seconds
        while not refs.times or time.perf_counter() < end:
            refs.sample()
    return refs.fastest()


def collective_fit(sizes: tuple[int, ...] = (1 << 12, 1 << 20, 1 << 23)) -> dict:
    """Latency and bandwidth of the collectives the strategies issue, on the initialised process group
    (run by every rank of a torchrun job): all-reduce, all-gather and reduce-scatter of fp32 buffers of
    `sizes` bytes, the fast end of 8 timings each, fitted together to the ring model of cost.steptime.ring_seconds:
    t = latency x hops x (n-1) + factor x (n-1)/n x bytes / bandwidth. Returns {"link": [s, bytes/s],
    "backend", "world", "points": [[kind, bytes, seconds], ...]}."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows, points = [], []
    for nbytes in sizes:
        full = torch.ones(nbytes // 4, device=device)
        shard = torch.ones(nbytes // 4 // world, device=device)
        calls = {"all_reduce": (lambda: dist.all_reduce(full), 2),
                 "all_gather": (lambda: dist.all_gather_into_tensor(full[: shard.numel() * world], shard), 1),
                 "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, full[: shard.numel() * world]), 1)}
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
