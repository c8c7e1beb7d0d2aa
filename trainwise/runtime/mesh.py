"""One DeviceMesh for the whole job: data parallel x pipeline parallel x tensor parallel, dims named.

    world size = dp x pp x tp          (parallel.tp, parallel.pp; dp is what is left)
    rank = (dp_rank x pp + pp_rank) x tp + tp_rank

tp is the innermost dimension, so a tensor-parallel group is tp neighbouring ranks (on one machine when
tp <= GPUs per node, where its per-layer collectives need NVLink bandwidth); pipeline neighbours come
next and data-parallel replicas outermost (Megatron-LM's and torchtitan's order). parallel.strategy says
how the dp dimension shards (runtime.distributed.wrap).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainwise.config import ParallelConfig
from trainwise.config.checks import divisors
from trainwise.cost.rank import Layout
from trainwise.errors import TrainwiseError

DIMS = ("dp", "pp", "tp")

__all__ = ["DIMS", "Layout", "build_mesh", "layout_for"]


def layout_for(p: ParallelConfig, world_size: int) -> Layout:
    """The layout of `world_size` ranks for [parallel] (trainwise.cost.rank.Layout: the planner's per-rank
    view reads the same); a TrainwiseError naming the numbers and a layout that works when world size is not
    a multiple of tp x pp. The strategy is the one that runs: none where there is one replica."""
    mp = p.tp * p.pp
    if world_size == 1 and mp > 1:
        raise TrainwiseError(
            f"parallel.tp = {p.tp} x parallel.pp = {p.pp} divides one model over {mp} ranks, but this is a single "
            f"process: launch it with torchrun, e.g. `torchrun --nproc-per-node {mp} -m trainwise train ...` "
            "(or set parallel.tp=1 and parallel.pp=1 to train in one process).")
    if world_size % mp:
        fits = [f"tp={tp} x pp={pp}" for tp in divisors(world_size) for pp in divisors(world_size // tp)
                if (tp, pp) != (1, 1)][:3]
        raise TrainwiseError(
            f"torchrun started {world_size} ranks, which is not a multiple of parallel.tp = {p.tp} x parallel.pp = "
            f"{p.pp} = {mp} (world size = dp x pp x tp). Start {mp * max(1, world_size // mp)} ranks "
            f"(torchrun --nproc-per-node), or pick tp and pp whose product divides {world_size}"
            + (f" (e.g. {', '.join(fits)})" if fits else "") + ".")
    dp = world_size // mp
    strategy = "none" if dp == 1 else p.strategy
    return Layout(dp=dp, pp=p.pp, tp=p.tp, vpp=p.vpp if p.pp > 1 else 1, schedule=p.pp_schedule, strategy=strategy)


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The job's DeviceMesh, shape (dp, pp, tp) with those dim names; every rank calls it."""
    return init_device_mesh(device_type, (layout.dp, layout.pp, layout.tp), mesh_dim_names=DIMS)
