"""Communication of a step: ring collectives per data-parallel strategy, and how much of it a step waits for."""

from __future__ import annotations

from trainwise.config import STRATEGY_OF_STAGE

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


def strategy_for(zero: int, dp: int) -> str:
    """The trainer's strategy that a plan's ZeRO stage stands for over dp ranks (runtime.distributed)."""
    return "none" if dp <= 1 else STRATEGY_OF_STAGE[zero]
