"""Micro-benchmarks that describe a device for the step-time model (trainwise.cost.steptime).

Each figure is the lower quartile of repeated timings of the kernels the trainer really runs, with every
torch thread, after a warm-up; every fit is cost.time.fit_linear (least squares in relative error,
coefficients >= 0):
- matmul: (M,K)x(K,N) over a small grid of shapes per dtype (skinny and small shapes run far below
  peak), summarised by t = F/P + Q/BW;
- element-wise work per class (plain, activation, norm, softmax/cross-entropy) and dtype: t = Q/BW;
- attention: the SDPA CPU kernel forward and backward, t = F/R;
- the optimizer step (fused AdamW + gradient clipping): t = a x tensors + b x elements;
- the per-operator overhead of an eager training step (dispatch + autograd), from two tiny models:
  the per-call cost the other fits leave out (they have no intercept);
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

MATMUL_SIZES = (64, 256, 1024, 4096)  # M, K, N from this set: the token/feature extents of small LLMs


def _rate(seconds_per_unit: float) -> float:
    """Units per second from a fitted time per unit (a fit of 0 means: too fast to see, i.e. unbounded)."""
    return 1.0 / seconds_per_unit if seconds_per_unit > 0 else 1e30


def quartile_seconds(fn, budget_s: float = 0.06, min_reps: int = 5, max_reps: int = 200) -> float:
    """Lower-quartile wall time of fn() after one warm-up call, repeated for about budget_s (at least
    min_reps): on a quiet machine within a few percent of the median, and less thrown by a moment of
    contention than the median (the peak itself is the median: calibrate.matmul_flops_per_s)."""
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
    return statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0]


def matmul_grid(dtype: torch.dtype, device: torch.device) -> list[tuple[int, int, int, float]]:
    """(M, K, N, seconds) for the shapes of MATMUL_SIZES whose product is at most 4096*1024*1024."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for m in MATMUL_SIZES:
        for k in MATMUL_SIZES:
            for n in MATMUL_SIZES:
                if m * k * n > 4096 * 1024 * 1024:
                    continue
                a = torch.randn(m, k, generator=gen, device=device).to(dtype)
                b = torch.randn(k, n, generator=gen, device=device).to(dtype)
                out.append((m, k, n, quartile_seconds(lambda: torch.mm(a, b), 0.03, 3)))
    return out


# class -> (kernel of two same-shape tensors x, y; tensor-sizes it moves as cost.ops counts bytes:
# every tensor input read + every output written)
ELEMENTWISE = {
    "elementwise/other": (lambda x, y: x * y, 3),
    "activation": (lambda x, y: F.silu(x), 2),
    "norm": (lambda x, y: x.pow(2), 2),
    "softmax/cross-entropy": (lambda x, y: torch.log_softmax(x, dim=-1), 2),
}


def elementwise_fits(dtype: torch.dtype, device: torch.device) -> dict[str, list[float]]:
    """{class: [0, bytes/s]}: t = Q/BW over tensors of 1 .. 32 MiB (fp32 size); the per-call cost is the
    step overhead's (step_overhead), so the fit has no intercept."""
    fits = {}
    for cls, (fn, passes) in ELEMENTWISE.items():
        rows = []
        for numel in (262_144, 1_048_576, 8_388_608):
            x, y = (torch.randn(numel // 4096, 4096, device=device).to(dtype) for _ in range(2))
            t = quartile_seconds(lambda: fn(x, y), 0.03, 3)
            rows.append(([passes * x.numel() * x.element_size()], t))
        fits[cls] = [0.0, _rate(fit_linear(rows)[0])]
    return fits


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
        t_fwd = quartile_seconds(fwd, 0.03, 3)
        t_both = quartile_seconds(lambda: torch.autograd.grad(fwd(), (q, k, v), grad), 0.05, 3)
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

        grad_fill = quartile_seconds(lambda: [torch.ones_like(p) for p in params], 0.02, 3)
        rows.append(([n_tensors, n_tensors * numel], max(quartile_seconds(step, 0.1, 3) - grad_fill, 1e-7)))
    a, b = fit_linear(rows)
    return [a, b]


def step_overhead(device: torch.device, optimizer: list[float]) -> list[float]:
    """[seconds per step, seconds per operator call]: two tiny models whose work is negligible, so their
    step time less their optimizer update (optimizer = optimizer_fit) is the eager overhead (Python,
    dispatch, autograd) of their forward and backward operators (cost.ops)."""
    from trainwise.config import ModelConfig, TrainConfig
    from trainwise.cost.ops import step_ops
    from trainwise.measure.step import random_batches, train_step
    from trainwise.model import Transformer
    from trainwise.train.optim import build_optimizer

    rows = []
    for layers in (1, 6):
        cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=layers, n_heads=2, n_kv_heads=2, ffn_hidden=32,
                          max_seq_len=8)
        ops = step_ops(cfg, 1, 8)
        calls = sum(op.calls for op in ops if op.phase != "optimizer")
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Transformer(cfg).to(device)
            opt = build_optimizer(model, TrainConfig())
        batches = random_batches(cfg.vocab_size, 1, 8, 1, device)
        t = quartile_seconds(lambda: train_step(model, opt, batches, device, "fp32"), 0.15, 5)
        tensors = list(model.parameters())
        t_opt = optimizer[0] * len(tensors) + optimizer[1] * sum(p.numel() for p in tensors)
        rows.append(([1.0, calls], max(t - t_opt, 1e-6)))
    per_step, per_op = fit_linear(rows)
    return [per_step, per_op]


def collective_fit(sizes: tuple[int, ...] = (1 << 12, 1 << 20, 1 << 23)) -> dict:
    """Latency and bandwidth of the collectives the strategies issue, on the initialised process group
    (run by every rank of a torchrun job): all-reduce, all-gather and reduce-scatter of fp32 buffers of
    `sizes` bytes, median timings, fitted together to the ring model of cost.steptime.ring_seconds:
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
            t = torch.tensor([quartile_seconds(fn, 0.0, 8, 8)], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank is what a step waits for
            rows.append(([factor * (world - 1), factor * (world - 1) / world * nbytes], float(t)))
            points.append([kind, nbytes, float(t)])
    latency, inv_bw = fit_linear(rows)
    return {"link": [latency, _rate(inv_bw)], "backend": dist.get_backend(), "world": world, "points": points,
            "rank": rank}
