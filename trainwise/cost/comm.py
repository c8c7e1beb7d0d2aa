"""Communication of a step: ring collectives per data-parallel strategy, and how much of it a step waits for;
on a GPU cluster, each collective over the tier (NVLink, network) its group crosses."""

from __future__ import annotations

from dataclasses import dataclass

from trainwise.config import STRATEGY_OF_STAGE
from trainwise.hardware.table import Node

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb
DDP_FIRST_BUCKET_BYTES = 2**20  # torch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


def ddp_buckets(grad_bytes: list[int]) -> list[int]:
    """DDP's gradient buckets (bytes): parameters in reverse order, a bucket closed once it reaches its
    cap (1 MiB for the first, 25 MiB after: torch's compute_bucket_assignment_by_size)."""
    buckets, current, cap = [], 0, DDP_FIRST_BUCKET_BYTES
    for n in reversed(grad_bytes):
        current += n
        if current >= cap:
            buckets.append(current)
            current, cap = 0, DDP_BUCKET_BYTES
    return buckets + ([current] if current else [])


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
                 grad_accum: int, link: list[float], gather_bytes: float | None = None,
                 reduces: int = 1, tensor_bytes: list[int] | None = None) -> dict[str, float]:
    """{collective: seconds} one step issues. ddp/zero1: one all-reduce of the gradients per DDP bucket (ddp_buckets
    of `tensor_bytes`, each parameter tensor's gradient bytes in the model's order; default: grad_bytes as one
    tensor) on the last micro-batch, then of the map of the tensors each rank used (zero1 then broadcasts each
    updated tensor from the rank that updated it, ZeroRedundancyOptimizer's step: a message a tensor);
    zero2: one all-gather of the parameters per micro-batch (kept until backward) + one reduce-scatter of the
    gradients (`reduces` of them: the micro-batches whose gradients are reduce-scattered, Layout.fsdp_grad_sync);
    fsdp: all-gathers before forward and again before backward, per micro-batch. Sharded strategies gather per block
    (n_blocks + 1 messages). gather_bytes: gathered parameter bytes when the mixed-precision policy gathers in bf16
    (default: param_bytes)."""
    gather = param_bytes if gather_bytes is None else gather_bytes
    if world <= 1 or strategy in ("none", ""):
        return {}
    if strategy in ("ddp", "zero1"):
        tensor_bytes = tensor_bytes or [int(grad_bytes)]
        buckets = len(ddp_buckets(tensor_bytes))
        # and the map of the tensors each rank used (find_unused_parameters: runtime.distributed.wrap), a message
        out = {"all_reduce": ring_seconds("all_reduce", grad_bytes, world, link, buckets + 1)}
        if strategy == "zero1":
            out["broadcast"] = ring_seconds("broadcast", param_bytes, world, link, len(tensor_bytes))
        return out
    gathers = grad_accum * (2 if strategy == "fsdp" else 1)
    return {"all_gather": gathers * ring_seconds("all_gather", gather, world, link, n_blocks + 1),
            "reduce_scatter": reduces * ring_seconds("reduce_scatter", grad_bytes, world, link, n_blocks + 1)}


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


# ---------------------------------------------------------------------------------------------------
# collectives on a GPU cluster: nccl-tests' formulas over the tier a group's ranks cross

# nccl-tests (doc/PERFORMANCE.md): time t of a collective over n ranks of a buffer of S bytes (the full
# array: the gathered output, the reduced input) moves factor x S per rank at the bus bandwidth.
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}
# t = ALPHA + factor x S / (ETA x peak busbw), the least-squares fit (log time, sizes 1 MiB-16 GiB, rms
# 11%, worst 22% at 16 MiB) to the published 8x A100 NVLink all_reduce_perf sweep (ml-engineering
# network/README.md l.1216-1241: 101.9 us at 1 MiB ... 127,997 us at 16 GiB, peak busbw 234.9 GB/s):
# 217 GB/s effective = 0.923 of the peak, 86 us per call. Applied to every tier's published peak.
ETA_NCCL = 0.923
ALPHA_NCCL_S = 86e-6
ALPHA_P2P_S = 10e-6  # a 2-GPU ring all-reduce of 8-128 B on a DGX A100 (nccl-tests issue #123): one hop
P2P_FRACTION = 0.65  # sendrecv_perf, 8x A100: 195.1 GB/s at 1 GiB of NVLink3's 300 (li-plus/playground cuda/nccl.md)


@dataclass(frozen=True)
class Tier:
    """The links a group's collectives cross, as bus bandwidths (bytes/s): NVLink inside a node, or the
    network when the group spans nodes."""

    name: str
    ring_busbw: float  # all-reduce, all-gather, reduce-scatter
    alltoall_busbw: float
    p2p_bytes_per_s: float


def group_tier(per_node: int, nodes: int, node: Node, bridged_pair: bool = False) -> Tier:
    """The tier of a group with `per_node` ranks on each of `nodes` nodes of `node`. Inside a node: the
    node's NCCL bus bandwidths over its fabric, or over the bridge when the group is the two cards of a
    bridged pair (`bridged_pair`: two neighbours). Across nodes a ring's slowest hop is the network, each
    rank through its share of the NICs: the node's measured cross-node busbw x per_node / gpus per node, and
    never more than the node's own busbw (a ring also runs through the node's fabric: an H800's 160 GB/s of
    NVLink under its 400 of network, a GB200 NVL72's 680 under 72 NICs); all-to-all reaches one NIC's worth
    whatever the ranks per node (nccl-tests issue #267); send/recv one GPU's share."""
    if nodes <= 1 and bridged_pair and node.pair_busbw:
        return Tier("bridge", node.pair_busbw, node.pair_busbw, P2P_FRACTION * node.pair_bytes_per_s)
    if nodes <= 1:
        return Tier(node.fabric, node.allreduce_busbw_intra, node.alltoall_busbw_intra,
                    P2P_FRACTION * node.intra_bytes_per_s)
    return Tier("network", min(node.allreduce_busbw_inter * per_node / node.gpus, node.allreduce_busbw_intra),
                node.alltoall_busbw_inter, node.allreduce_busbw_inter / node.gpus)


def collective_seconds(kind: str, nbytes: float, n: int, tier: Tier) -> float:
    """Seconds of one collective `kind` of S = nbytes over n ranks on `tier` (see ETA_NCCL)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "send_recv":
        return ALPHA_P2P_S + nbytes / (ETA_NCCL * tier.p2p_bytes_per_s)
    busbw = tier.alltoall_busbw if kind == "all_to_all" else tier.ring_busbw
    return ALPHA_NCCL_S + BUS_FACTOR[kind](n) * nbytes / (ETA_NCCL * busbw)


def bytes_sent(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a collective of S = nbytes over n ranks (ring algorithms): factor x S."""
    return 0.0 if n <= 1 else BUS_FACTOR[kind](n) * nbytes
