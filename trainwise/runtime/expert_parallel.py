"""Expert parallelism (parallel.ep): each MoE layer's routed experts divided over ep data-parallel ranks, and
the tokens carried to their experts and back by all-to-all (GShard, Lepikhin et al. 2020; the expert
parallelism of torchtitan and Megatron-Core). Shapes: S' assignments a rank routed (after any capacity drop),
R the assignments it receives, H d_model, E routed experts, E/ep of them on a rank.

    dp = edp x ep     the ep group: ep neighbouring data-parallel ranks (dp_rank = edp_rank x ep + ep_rank,
                      cost.layout.placement's folding with etp = tp); the edp group: the dp / ep ranks that
                      hold the same experts. With tensor parallelism, per tp rank: an ep group is the ranks of
                      one tp rank in ep neighbouring replicas, which all route the same tokens (all-gathered
                      over tp by MoETensorParallel) and each hold their tp share of every expert's width
    on a rank         experts [ep_rank E/ep, (ep_rank + 1) E/ep); the router, the shared experts and everything
                      dense stay whole on every rank (tp shards under tp), replicated over dp as without ep

Each rank routes its own tokens with the model's router, top-k, choice bias and capacity, exactly as one
process routes that micro-batch (MoE.forward, MoE.dispatch), and sorts its S' assignments by expert. Then
MoE.exchange (ExpertExchange) runs, per layer and micro-batch:

    counts      all-to-all of the (E,) assignments per expert: each rank learns how many rows every rank of
                its group sends to each of its experts
    dispatch    all-to-all of the (S', H) rows in the compute dtype (the experts' matmuls cast them to it
                anyway), each to the rank of its expert; the R rows received regrouped by local expert
    experts     the rank's experts on them: MoE's grouped or looped matmuls over E/ep experts
    combine     all-to-all of the (R, H) outputs back; MoE weights and scatters them as in one process

and backward runs the two gradients' all-to-alls the other way (autograd of the functional collective). The
expert loads (MoE.last_expert_counts), the routing-bias update and the auxiliary losses stay each rank's own
tokens', reduced over dp as without ep (runtime.step), so nothing is counted once per ep rank.

Gradients. A rank's expert gradient sums the contributions of every token its ep group routed to it. DDP (or
FSDP2, zero2 and fsdp) averages the dense gradients over dp; the experts' are left out of it and, after the
step's last backward, scaled by 1/dp and summed over edp (one all-reduce of the rank's expert gradients,
flattened): the gradient one process computes on the global batch. FSDP2 shards the dense parameters only: each
expert stays whole on its edp ranks (with ep = dp, one rank), its states too. With pipeline stages (pp > 1, with
or without tp) the same per stage: each stage's experts divided over the ep ranks of its dp ranks, left out of
replicate or FSDP2 (runtime.distributed.wrap), and reduced over edp once the schedule's backward is done
(runtime.step).

Parameters. The experts' weights are DTensors on the (edp, ep) mesh, [Replicate(), Shard(0)] (with tp on (edp,
ep, tp), their tp placement last): the whole (E, ...) tensor, each rank holding its E/ep rows. DCP then stores
each expert once (the edp copies of a shard deduplicated) under the whole model's names and reshards on load, to
another ep, to tensor or pipeline parallelism, or into one process; clip_grad_norm counts each expert once
(runtime.distributed). The MoE code reads the local rows: the exchange hands it the local tensors while the
experts run (_local_rows). Plain local tensors would have needed a second description of the sharding for DCP
(on torch 2.13 DCP reshards DTensors, not tensors annotated by hand), and DDP ignores the DTensors by name.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from trainwise.cost.layout import Layout
from trainwise.model.moe import MoE

DIMS = ("pp", "edp", "ep")


def build_expert_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The experts' mesh, shape (pp, edp, ep) (world = pp x dp, dp = edp x ep, ep innermost), or (pp, edp, ep,
    tp) with tensor parallelism (rank = (pp_rank x dp + dp_rank) x tp + tp_rank, runtime.mesh's order: an ep
    group is the ranks of one tp rank in ep neighbouring data-parallel replicas); every rank calls it."""
    tp = (layout.tp,) if layout.tp > 1 else ()
    return init_device_mesh(device_type, (layout.pp, layout.expert_dp, layout.ep, *tp),
                            mesh_dim_names=DIMS + ("tp",) * len(tp))


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of `model` whose experts are divided (MoE.exchange set), in module order."""
    return [m for m in model.modules() if isinstance(m, MoE) and m.exchange is not None]


def _owners(moe: MoE) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of each routed-expert tensor (dim 0: the experts), fused or split."""
    return [(owner, name) for part in (moe.experts_fc, moe.experts_proj) for owner in part.modules()
            for name, p in owner.named_parameters(recurse=False)]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The divided expert parameters of `model` (DTensors), in module order: the same order on every rank."""
    return [getattr(owner, name) for moe in moe_layers(model) for owner, name in _owners(moe)]


def expert_param_names(model: nn.Module) -> list[str]:
    """Their names in `model` (what DDP is told to leave alone)."""
    ids = {id(p) for p in expert_params(model)}
    return [name for name, p in model.named_parameters() if id(p) in ids]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Divide the routed experts of every MoE layer of `model` (built whole, the same on every rank) over the
    mesh's ep dimension, in place: each rank keeps its E/ep experts as DTensor rows (module docstring) and its
    layers exchange tokens with the ep group."""
    tensor_parallel = "tp" in (mesh.mesh_dim_names or ())
    experts = mesh["edp", "ep", "tp"] if tensor_parallel else mesh["edp", "ep"]
    ep, ep_rank = mesh["ep"].size(), mesh["ep"].get_local_rank()
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        local = moe.n_experts // ep
        for owner, name in _owners(moe):
            p = getattr(owner, name)
            # under tensor parallelism each expert's width is split over tp already (MoETensorParallel): the
            # rank's tp shard keeps its placement on the tp dimension
            whole, tp_placement = (p.to_local(), list(p.placements)) if isinstance(p, DTensor) else (p, [])
            rows = whole.detach()[ep_rank * local:(ep_rank + 1) * local].clone()
            placements = [Replicate(), Shard(0), *tp_placement]
            param = nn.Parameter(DTensor.from_local(rows, experts, placements, run_check=False),
                                 requires_grad=p.requires_grad)
            owner.register_parameter(name, param)
        moe.exchange = ExpertExchange(mesh["ep"].get_group(), ep, ep_rank)


@contextlib.contextmanager
def _local_rows(moe: MoE):
    """While the rank's experts run, MoE's code reads each expert tensor's local rows (an instance attribute
    over the parameter; its gradient lands in the DTensor's, with the same placements: no reduction implied).
    Removed on the way out, also when activation checkpointing's recomputation stops early (by an exception)."""
    owners = _owners(moe)
    for owner, name in owners:
        owner.__dict__[name] = owner._parameters[name].to_local()
    try:
        yield
    finally:
        for owner, name in owners:
            owner.__dict__.pop(name, None)


class ExpertExchange:
    """MoE.exchange for expert parallelism over one ep group (module docstring): exchange(moe, grouped, counts)
    takes the (S', H) assignments sorted by expert and their (E,) counts, returns the (S', H) outputs of their
    experts in the same order. `last_counts`: the counts of the last call (the rows this rank sent to each
    expert: cost.rank plans the all-to-alls from them)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, ep_rank: int):
        self.group, self.ep, self.ep_rank = group, ep, ep_rank
        self.last_counts: torch.Tensor | None = None

    @torch.compiler.disable  # split sizes read on the host: not a graph
    def __call__(self, moe: MoE, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, counts.numel() // self.ep
        device = grouped.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else grouped.dtype
        self.last_counts = counts.detach()
        received = funcol.all_to_all_single(counts, None, None, self.group).view(ep, local)  # (source, expert)
        sent_splits, received_splits = counts.view(ep, local).sum(1).tolist(), received.sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(grouped.to(dtype), received_splits, sent_splits, self.group)
        # (R, H) by source rank, then by local expert: regrouped by local expert (source order inside)
        expert = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(received.flatten())
        order = expert.argsort(stable=True)
        with _local_rows(moe):
            y = local_experts(moe, rows.index_select(0, order), received.sum(0), expert[order])
        y = y.new_empty(y.shape).index_copy(0, order, y)  # back in the order received
        return funcol.all_to_all_single_autograd(y, sent_splits, received_splits, self.group)


def local_experts(moe: MoE, x: torch.Tensor, counts: torch.Tensor, expert_of: torch.Tensor) -> torch.Tensor:
    """x (R, H) grouped by the rank's experts -> (R, H), as MoE runs its experts (grouped or looped). With no
    rows the output is x itself, so that the backward all-to-alls still run on this rank."""
    if x.shape[0] == 0:
        return x
    if moe.use_grouped_mm(x):
        return moe.experts_grouped(x, counts, expert_of)
    return moe.experts_looped(x, counts)


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, group: dist.ProcessGroup, dp: int) -> None:
    """After the step's last backward: each expert gradient scaled by 1/dp and summed over the edp `group`
    (one all-reduce, flattened), which makes it the gradient one process computes on the global batch. An
    expert tensor none of the group's tokens reached gets a zero gradient, so every rank joins the reduction."""
    params = expert_params(model)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad.to_local() for p in params]
    if not grads:
        return
    if dist.get_world_size(group) == 1:
        torch._foreach_mul_(grads, 1.0 / dp)
        return
    flat = torch.cat([g.reshape(-1) for g in grads]).mul_(1.0 / dp)
    dist.all_reduce(flat, group=group)  # gloo has no AVG: the scale is applied before
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def routed_tokens(model: nn.Module) -> torch.Tensor | None:
    """(E,) the assignments this rank sent to each expert in the last forward, summed over its divided MoE
    layers (None without expert parallelism): what cost.rank's all-to-alls are evaluated at. A pipeline rank
    (runtime.pipeline.RankModel, its stages run by the schedule): those of the step's K micro-batches."""
    stages = getattr(model, "stages", None)
    if stages is not None:
        counts = [c for stage in stages for c in stage.routed]
    else:
        counts = [m.exchange.last_counts for m in moe_layers(model) if m.exchange.last_counts is not None]
    return torch.stack(counts).sum(0) if counts else None
