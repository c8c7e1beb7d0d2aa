"""More than one device, on PyTorch's own engine: DDP or FSDP2 under `torchrun`, on a DeviceMesh with
tensor and pipeline parallelism (runtime.mesh, runtime.tensor_parallel, runtime.pipeline).

    torchrun --nproc-per-node N -m trainwise train --set parallel.strategy=ddp|zero1|zero2|fsdp ...
    torchrun --nproc-per-node N -m trainwise train --set parallel.tp=2 --set parallel.pp=2 ...
    torchrun --nproc-per-node N -m trainwise train --set parallel.strategy=ddp --set parallel.ep=2 ...

ddp replicates everything (ZeRO stage 0); zero1 is DDP with the optimizer states sharded by
ZeroRedundancyOptimizer (ZeRO stage 1); zero2 is FSDP2 keeping the gathered parameters from forward
to backward (reshard_after_forward=False: FSDP1's SHARD_GRAD_OP; gradients and states sharded, ZeRO
stage 2); fsdp is FSDP2 regathering them per block for backward (parameters sharded too, ZeRO stage 3).

The same config runs unchanged in one process (the strategy then has nothing to shard). The model is
wrapped from outside, after activation checkpointing; checkpoints are gathered to rank 0 in the
single-process format, so any run directory loads in one process for sampling and export. Runs with
tp or pp > 1 keep their model divided: their checkpoints are DCP's (runtime.checkpoint), and the
data-parallel dimension of the mesh is sharded by FSDP2 (zero2, fsdp) or replicated (ddp) with
FSDP2's replicate, which compose with DTensor parameters and pipeline stages. With ep > 1 the routed experts
are divided over ep data-parallel ranks (runtime.expert_parallel): DDP replicates the rest (FSDP2 shards it), the
experts' gradients are reduced over the ranks that hold the same experts, and checkpoints are DCP's.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from trainwise.config import FSDP_STRATEGIES
from trainwise.cost.run import Run
from trainwise.errors import TrainwiseError
from trainwise.runtime import context_parallel, expert_parallel
from trainwise.runtime.fused import split_fused
from trainwise.runtime.mesh import Layout, build_mesh
from trainwise.runtime.optim import local_optimizer
from trainwise.runtime.precision import DTYPES


@dataclass
class Dist:
    strategy: str  # none | ddp | zero1 | zero2 | fsdp (the layout's: none with one replica or one process)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    control: object = None  # a gloo group for host-side agreement (any_rank), also beside NCCL
    layout: Layout = field(default_factory=Layout)
    mesh: DeviceMesh | None = None  # (pp, dp, tp) when tp or pp > 1
    experts: DeviceMesh | None = None  # (pp, edp, ep[, tp]) when ep > 1: the mesh the divided experts live on
    cp_group: object = None  # this rank's context-parallel group when cp > 1 (runtime.context_parallel)
    # with a mesh, the ranks that hold the same parameters (FSDP2 shards, replicate reduces over them): the mesh's
    # dp dimension, dp x cp flattened when cp > 1 (runtime.mesh.build_mesh)
    replicas: DeviceMesh | None = None

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def cp_rank(self) -> int:
        return self.rank // self.layout.tp % self.layout.cp

    @property
    def dp_group(self):
        """The data-parallel process group (the whole world when the model is not divided)."""
        return self.mesh["dp"].get_group() if self.mesh is not None else dist.group.WORLD

    @property
    def divided(self) -> bool:
        """The model is divided over ranks (tp, pp or ep > 1): each rank holds a share, checkpoints are DCP's."""
        return self.mesh is not None or self.experts is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def fsdp(self) -> bool:
        """Runs on FSDP2 (zero2 or fsdp): per-block hooks, sharded parameters at rest."""
        return self.strategy in FSDP_STRATEGIES


def world_size() -> int:
    """The ranks torchrun started (env WORLD_SIZE); 1 for a process started alone."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(run: Run, device_request: str, timeout_s: float = 120.0) -> Dist:
    """Join the process group torchrun set up (env WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR...) for the
    run's layout and, when tp or pp > 1, build the job's DeviceMesh (with cp > 1, the context-parallel groups
    too). `run.layout` is runtime.mesh.layout_for's for this world size (checked there, before anything starts);
    the strategy is the layout's (none with one replica). A process started alone is Dist("none")."""
    layout, ranks = run.layout, world_size()
    if layout.gpus != ranks:
        raise TrainwiseError(
            f"the run's layout spans {layout.gpus} ranks (dp {layout.dp} x pp {layout.pp} x tp {layout.tp}), but "
            f"this process is one of {ranks}: derive it from the world size (runtime.mesh.layout_for).")
    if ranks == 1:
        return Dist("none")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_request != "cpu"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    device_type = "cuda" if use_cuda else "cpu"
    mesh, replicas = build_mesh(layout, device_type) if layout.model_parallel > 1 else (None, None)
    experts = expert_parallel.build_expert_mesh(layout, device_type) if layout.ep > 1 else None
    cp_group = context_parallel.build_cp_group(layout) if layout.cp > 1 else None
    return Dist(layout.strategy, rank, ranks, local_rank, control, layout, mesh, experts, cp_group, replicas)


def local_device(device: torch.device) -> torch.device:
    """The device this process trains on: under torchrun a CUDA device is the rank's own, cuda:LOCAL_RANK
    (the one init makes current). Known before init, from the environment torchrun set."""
    if device.type == "cuda" and world_size() > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def wrap(model: nn.Module, d: Dist, device: torch.device, precision: str) -> nn.Module:
    """DDP: replicate and all-reduce gradients. FSDP2: shard every block and the root, gathering weights
    just in time (fsdp frees each block's gathered weights after its forward and gathers them again for
    backward; zero2 keeps them until backward); with bf16/fp16 the mixed-precision policy computes in
    that dtype and reduces in fp32. On a mesh (tp or pp > 1) the same over its dp dimension (with cp > 1 the
    flattened dp x cp: Dist.replicas), ddp as FSDP2's replicate (DDP does not take DTensor parameters).
    With ep > 1 the model is split into the divided models' form (runtime.fused: their checkpoints' names; a
    pipeline stage is split already), its experts divided over the ep ranks (runtime.expert_parallel), and DDP,
    replicate on a pipeline's mesh, or FSDP2, told to leave them alone: FSDP2 shards the rest over the dp ranks,
    and the experts stay whole on each of the edp ranks that hold them (none when ep = dp), their gradients
    all-reduced over those ranks as under DDP."""
    if not d.active or d.strategy == "none":
        return model
    if d.strategy in ("ddp", "zero1") and d.mesh is None:
        from torch.nn.parallel import DistributedDataParallel

        if d.experts is not None:  # DDP's own way to leave parameters alone (torchrec uses it too)
            split_fused(model)
            expert_parallel.apply_expert_parallel(model, d.experts)
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, expert_parallel.expert_param_names(model))
        # gradient_as_bucket_view: each .grad is a view into DDP's all-reduce buckets instead of a second
        # copy beside them, so a rank holds N x 4 bytes of gradients, as the planner says (measured:
        # peak RSS -73 / -106 MiB per rank for a 27.8M-parameter model whose fp32 gradients are 106 MiB).
        # broadcast_buffers=False: the buffers (RoPE tables, MoE choice biases moved by the all-reduced load)
        # are the same on every rank already; DDP would broadcast them before every forward.
        # find_unused_parameters=True keeps DDP's first bucket layout (parameters in reverse order, the layout
        # cost.rank prices) for the whole run: otherwise DDP lays its buckets out again after the first step, in
        # the order the gradients arrived, and a resumed run's first step would reduce in the other layout. Over
        # three or more ranks a gradient's sum then adds the ranks' parts in another order, and the resumed run
        # parts from the uninterrupted one in the last bits. The price is a walk of the autograd graph a step
        # (and torch's one-line warning at the first backward that no parameter was unused).
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=True, broadcast_buffers=False,
                                       find_unused_parameters=True)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if precision != "fp32":
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    mesh = {} if d.mesh is None else {"mesh": d.replicas}
    if d.strategy == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        if d.experts is not None:  # a pipeline stage's experts: divided, left out of replicate (reduce_expert_grads)
            expert_parallel.apply_expert_parallel(model, d.experts)
        for block in model.blocks:
            replicate(block, mp_policy=policy, ignored_params=_experts_of(block), **mesh)
        replicate(model, mp_policy=policy, ignored_params=_experts_of(model), **mesh)
        return model
    if d.experts is not None:  # divided over ep, left out of FSDP2 (whole on each of their edp ranks)
        if d.mesh is None:
            split_fused(model)
        expert_parallel.apply_expert_parallel(model, d.experts)
    reshard = d.strategy == "fsdp"
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard, ignored_params=_experts_of(block), **mesh)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard, ignored_params=_experts_of(model), **mesh)
    return model


def _experts_of(module: nn.Module) -> set[nn.Parameter] | None:
    """The divided expert parameters under `module` (None without any)."""
    return set(expert_parallel.expert_params(module)) or None


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model


def gradient_sync(model: nn.Module, d: Dist, last_micro_batch: bool):
    """Under gradient accumulation, communicate gradients only on the last micro-batch of a step (divided
    experts: once its backward is done, runtime.expert_parallel.reduce_expert_grads); FSDP2 on every one with
    Layout.fsdp_grad_sync "micro-batch"."""
    if not d.active:
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 (fully_shard, replicate)
        model.set_requires_gradient_sync(last_micro_batch or d.layout.reduces_each_micro_batch)
    elif hasattr(model, "no_sync") and not last_micro_batch:  # DDP
        return model.no_sync()
    return _then_reduce_experts(model, d) if d.experts is not None and last_micro_batch else contextlib.nullcontext()


@contextlib.contextmanager
def _then_reduce_experts(model: nn.Module, d: Dist):
    yield
    expert_parallel.reduce_expert_grads(unwrap(model), d.experts["edp"].get_group(), d.layout.dp)


def mean_across_ranks(value: torch.Tensor, d: Dist, group=None) -> torch.Tensor:
    """The mean of `value` over all ranks, or over `group` (e.g. d.dp_group; nothing to do for one rank)."""
    if d.active and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)  # gloo has no AVG
        value /= dist.get_world_size(group)
    return value


def clip_grad_norm(params: list, max_norm: float, d: Dist, shared: list | None = None) -> torch.Tensor:
    """Clip the gradients of `params` to total L2 norm `max_norm` over the whole model, and return the norm
    before clipping (a plain tensor, the same on every rank). `shared`: parameters of `params` that another
    rank holds too and counts (a tied embedding's copy on the last pipeline stage): clipped, not counted.

    One process, DDP, ZeRO-1: torch.nn.utils.clip_grad_norm_ (every rank holds every gradient). With
    DTensor parameters (tensor parallel, FSDP2) or pipeline stages each rank holds a share: gradients
    still Partial (a replicated weight used on a rank's positions or heads: norms, the router) are
    all-reduced first, once each (DTensor's redistribute; the optimizer then finds them reduced), then
    each rank adds up the squares of what it holds that no other rank counts (a shard, or a replicated
    tensor on coordinate 0 of each mesh dimension it is replicated over) and one all-reduce of that scalar
    over the world gives the norm of the whole model (torchtitan's clip for pipelines, in one collective)."""
    divided = d.layout.pp > 1 or any(isinstance(p, DTensor) for p in params)
    if not d.active or not divided:
        return local_value(torch.nn.utils.clip_grad_norm_(params, max_norm))
    squares = torch.zeros((), dtype=torch.float32, device=next(iter(params)).device)
    for p in params:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
        if _counted_here(p, d) and not any(p is q for q in shared or ()):
            # each tensor's norm first, as torch's clip does: a plain sum of 10^6 squares in fp32 drifted 4e-6
            # from one process's norm, enough to move a clipped run's losses apart over a few dozen steps
            squares += torch.linalg.vector_norm(_local(p.grad).float()) ** 2
    dist.all_reduce(squares)
    norm = squares.sqrt()
    # the scale, as torch's clip computes it, applied to each rank's local values: a scalar times a shard is the
    # shard of the scaled tensor, and the local tensors skip DTensor's sharding propagation, which a foreach call
    # over many DTensor specs runs afresh every step (~0.1 s per step on a CPU rank of a 2-layer model)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_kind: dict = {}
    for p in params:
        if p.grad is not None:
            g = _local(p.grad)
            by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in by_kind.items():
        torch._foreach_mul_(grads, scale.to(device))
    return norm


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _counted_here(p: torch.Tensor, d: Dist) -> bool:
    """Whether this rank's copy of p counts in the model's norm: each element once over the world."""
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        return all(not isinstance(pl, Replicate) or mesh.get_local_rank(i) == 0 for i, pl in enumerate(p.placements))
    # a plain tensor is whole on every tp, cp and dp rank of its stage
    return d.tp_rank == 0 and d.cp_rank == 0 and d.dp_rank == 0


def any_rank(flag: bool, d: Dist) -> bool:
    """True on every rank if it is True on any (a signal reaches one rank; all must stop together).
    Asked every step, so it runs on the CPU over gloo: under NCCL a GPU tensor's .item() would wait for
    the GPU to finish the step before the host could queue the next one."""
    if not d.active:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.control)
    return bool(t.item())


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (FSDP2 gradient norms are DTensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state gathered to full tensors (on rank 0 for FSDP and ZeRO-1), optimizer
    keyed by parameter name: the same format in one process, under DDP, ZeRO-1 and FSDP."""
    if _is_zero(optimizer):  # collective: every rank sends its states to rank 0
        optimizer.consolidate_state_dict(to=0)
        named = {} if dist.get_rank() else _by_name(optimizer.state_dict(), _param_names(model, optimizer))
        # ZeroRedundancyOptimizer keeps the consolidated copy of every rank's states on rank 0 until the next
        # consolidation: a ZeRO-1 rank 0 would hold the whole optimizer state from its first checkpoint on
        optimizer._all_state_dicts = []
        return get_model_state_dict(model, options=_FULL), named
    return get_model_state_dict(model, options=_FULL), get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_state: dict, d: Dist) -> None:
    """Load an optimizer state saved by `full_state` on every rank (model weights are loaded into the
    plain model before it is wrapped, so each rank shards from the full tensors)."""
    if _is_zero(optimizer):  # each rank keeps the states of the parameters it owns
        names = _param_names(model, optimizer)
        index = {name: i for i, name in enumerate(names)}
        optimizer.load_state_dict({
            "state": {index[name]: value for name, value in optimizer_state["state"].items()},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]}
                             for g in optimizer_state["param_groups"]],
        })
        for p, state in optimizer.optim.state.items():  # ZeRO moves the step count to the CPU; fused wants
            for key, value in state.items():          # it beside the parameter
                if torch.is_tensor(value) and value.ndim == 0:
                    state[key] = value.to(p.device)
        return
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))


def _is_zero(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's global index order (its param_groups, in turn)."""
    name_of = {id(p): name for name, p in unwrap(model).named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _by_name(state_dict: dict, names: list[str]) -> dict:
    """A torch.optim state dict keyed by parameter index -> keyed by parameter name (DCP's format)."""
    return {"state": {names[i]: value for i, value in state_dict["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state_dict["param_groups"]]}


def local_bytes(tensors) -> int:
    """Bytes this rank holds of these tensors (the local shard of a DTensor)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def gathered_params_meter(model: nn.Module, d: Dist) -> dict:
    """zero2 keeps the parameters FSDP2 gathered from forward to backward, and they are then the
    module's registered parameters: record their bytes at the end of each training forward
    ({"bytes": 0} for the other strategies, and on a mesh, whose per-rank plan counts the shards at rest)."""
    seen = {"bytes": 0}
    if d.active and d.strategy == "zero2" and d.mesh is None:
        def record(module, args, output):
            if torch.is_grad_enabled():
                seen["bytes"] = local_bytes(module.parameters())

        model.register_forward_hook(record)
    return seen


def rank_state_bytes(params: list, optimizer: torch.optim.Optimizer, grad_bytes: int, gathered_bytes: int = 0) -> dict:
    """This rank's parameter, gradient and optimizer-state bytes, as the planner's ZeRO math predicts
    them per device (grads are measured by the caller before they are freed). Under zero2 the
    parameters are the gathered copy held from forward to backward (`gathered_bytes`), and the fp32
    shard at rest, the weights the optimizer steps, counts as its master copy."""
    states = [v for state in local_optimizer(optimizer).state.values() for v in state.values()
              if torch.is_tensor(v) and v.ndim]
    if gathered_bytes:
        return {"params": gathered_bytes, "grads": grad_bytes, "optimizer": local_bytes(states) + local_bytes(params)}
    return {"params": local_bytes(params), "grads": grad_bytes, "optimizer": local_bytes(states)}


def gather_objects(obj, d: Dist) -> list:
    """Every rank's `obj`, in rank order (each rank's RNG state, for exact resume)."""
    if not d.active:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(d: Dist) -> None:
    if d.active:
        dist.barrier()


def shutdown(d: Dist) -> None:
    """Leave the process group together: a rank that tears down its gloo threads while a peer is still
    talking to it can abort ("terminate called without an active exception")."""
    if d.active and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_worker(code: int) -> NoReturn:
    """End a torchrun worker once its process group is destroyed, without the interpreter's teardown:
    objects left in reference cycles (FSDP2 modules, their hooks and pending work) are then freed after the
    process group, and a gloo worker thread destroyed that late aborts the process ("terminate called
    without an active exception", SIGABRT), turning a finished job into a failed one. Every file is closed
    by now; the streams are flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
