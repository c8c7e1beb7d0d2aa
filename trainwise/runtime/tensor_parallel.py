"""Tensor parallelism with sequence parallelism (Megatron-LM; Korthikanti et al. 2022), through DTensor.

Applied from outside to a model whose fused projections are split (runtime.fused), as torchtitan's
`apply_tp` does. Between blocks the residual stream is sharded by sequence: each of the tp ranks holds
T/tp positions of every sequence. Per block:

    norm1, norm2        SequenceParallel: on the rank's positions, weights replicated
    attention input     all-gather of the sequence (Shard(1) -> Replicate)
    q, k, v             ColwiseParallel: each rank computes its n_heads/tp query heads, n_kv_heads/tp KV
                        heads (GQA groups stay whole on a rank)
    attention output    RowwiseParallel: partial sums, reduce-scattered back to the rank's positions
    MLP                 the same: all-gather, fc (gate, up) column-wise, proj row-wise, reduce-scatter
    MoE                 MoETensorParallel: all-gather; the router on every token on every rank (so every
                        rank routes alike), each expert's width F split across ranks, shared experts too;
                        partial outputs reduce-scattered
    embedding           RowwiseParallel: vocabulary rows sharded; output reduce-scattered to positions
    final norm, head    SequenceParallel; LM head column-wise by vocabulary, logits gathered (Replicate)

So the collectives of one micro-batch's forward are, per layer, one all-gather and one reduce-scatter
for attention and one each for the MLP (backward: the same two, swapped), plus the embedding's
reduce-scatter and the head's two all-gathers (trainwise.cost.rank counts them).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainwise.model.attention import Attention
from trainwise.model.moe import MoE
from trainwise.runtime.fused import SplitExperts, SplitLinear


def _columns(module: nn.Module, prefix: str) -> dict:
    """ColwiseParallel for a projection, or for each part of a split one."""
    if isinstance(module, SplitLinear):
        return {f"{prefix}.{name}": ColwiseParallel() for name in module}
    return {prefix: ColwiseParallel()}


class _EndsRowwise(RowwiseParallel):
    """RowwiseParallel whose output collective is waited for where it is issued. torch's style leaves it in
    flight (an AsyncCollectiveTensor), which compiled blocks take as their input but whose gradient they hand
    back as a plain tensor where the collective's backward expects a DTensor; the embeddings' output feeds the
    first block straight away, so nothing is lost by waiting."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs


def block_plan(block: nn.Module) -> dict:
    """parallelize_module's plan for one Transformer block (dense MLP or MoE)."""
    attn = block.attn
    plan = {
        "norm1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                   desired_input_layouts=(Replicate(), None, None, None)),
        **_columns(attn.qkv, "attn.qkv"),
        "attn.out": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
    }
    if attn.q_norm is not None:  # per head: a rank's heads are dim 2 of (B, T, heads, hd)
        plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if isinstance(block.mlp, MoE):
        plan["mlp"] = MoETensorParallel()
    else:
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update(_columns(block.mlp.fc, "mlp.fc"))
        plan["mlp.proj"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard `model` (a Transformer, or one pipeline stage of it: runtime.pipeline.StageModule) over the
    tp mesh, in place. Its attention modules then hold n_heads/tp and n_kv_heads/tp heads."""
    tp = mesh.size()
    for block in model.blocks:
        plan = block_plan(block)
        for module in block.modules():
            if isinstance(module, Attention):
                module.n_heads //= tp
                module.n_kv_heads //= tp
        parallelize_module(block, mesh, plan)
    top = {}
    if getattr(model, "embed", None) is not None:
        top["embed"] = _EndsRowwise(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "pos_embed", None) is not None:  # learned positions: (T, H), sharded like the stream
        top["pos_embed"] = _EndsRowwise(input_layouts=Replicate(), output_layouts=Shard(0))
    if getattr(model, "lm_head", None) is not None:
        top["norm"] = SequenceParallel()
        top["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    tied = top.keys() >= {"embed", "lm_head"} and model.lm_head.weight is model.embed.weight
    parallelize_module(model, mesh, top)
    if tied:  # both are Shard(0) of the same (V, H) matrix: one parameter again
        model.lm_head.weight = model.embed.weight


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class MoETensorParallel(ParallelStyle):
    """Tensor parallelism for trainwise.model.moe.MoE, whose forward reads its weights directly (a router
    matmul in fp32, grouped matmuls over stacked expert weights) rather than through Linear modules.

    Parameters become DTensors on the tp mesh: each expert's gate and up (E, H, F) sharded on F, its proj
    (E, F, H) on F (row-wise, as Megatron-LM shards an expert), the shared experts' MLP the same way, the
    router replicated. While the MoE runs, its modules see the local tensors of those DTensors (so its
    code runs unchanged on a rank's share of F), and the layer works in local tensors throughout:

      input     the rank's positions, all-gathered (Shard(1) -> Replicate); every rank then routes every
                token with the same replicated router, so routing is the same on every rank and as in one
                process. The gradient a rank computes for the input is partial (its share of F), so the
                local input is declared Partial for backward: reduce-scattered to the positions.
      output    each rank's experts give a partial sum over F: Partial -> Shard(1), a reduce-scatter.
      router    its local gradient is partial as well (the combine weights meet partial expert outputs):
                declared Partial, summed over tp by DTensor. The auxiliary losses, computed whole on every
                rank, pass back 1/tp of their gradient each, so that sum is right too.
      biases    row-wise biases (proj) are added by tp rank 0 only, so the partial sums add them once.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MoE):
            raise TypeError(f"MoETensorParallel applies to trainwise MoE layers, not {type(module).__name__}")
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        owners = []  # (module holding the parameter, its name, placement)
        for name, placement in _moe_placements(module).items():
            path, _, attr = name.rpartition(".")
            owner = module.get_submodule(path)
            param = getattr(owner, attr)
            if param is None:
                continue
            owner.register_parameter(attr, nn.Parameter(distribute_tensor(param.detach(), device_mesh, [placement])))
            owners.append((owner, attr, placement, name.endswith("proj.bias")))

        def enter(mod, args):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            for owner, attr, placement, row_bias in owners:
                p = owner._parameters[attr]
                if isinstance(placement, Replicate):  # its tp placement last (divided experts: on (edp, ep, tp))
                    local = p.to_local(grad_placements=[*p.placements[:-1], Partial()])
                    owner.__dict__[attr] = local if not row_bias or rank == 0 else local * 0
                else:
                    owner.__dict__[attr] = p.to_local()
            return (x.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()]), *args[1:])

        def leave(mod, args, out):
            for owner, attr, _, _ in owners:
                owner.__dict__.pop(attr, None)
            if torch.is_tensor(mod.last_aux_loss) and mod.last_aux_loss.requires_grad:
                mod.last_aux_loss = _ScaleGrad.apply(mod.last_aux_loss, 1.0 / tp)
            partial = DTensor.from_local(out, device_mesh, [Partial()], run_check=False)
            return partial.redistribute(device_mesh, [Shard(1)]).to_local()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


def _moe_placements(moe: MoE) -> dict[str, object]:
    """Where each MoE parameter's shard lies (module-relative names)."""
    out = {"router.weight": Replicate()}
    fc = ["experts_fc.gate", "experts_fc.up"] if isinstance(moe.experts_fc, SplitExperts) else ["experts_fc"]
    for name in fc:  # (E, H, F), bias (E, F)
        out[f"{name}.weight"], out[f"{name}.bias"] = Shard(2), Shard(1)
    out["experts_proj.weight"], out["experts_proj.bias"] = Shard(1), Replicate()  # (E, F, H); bias (E, H)
    if moe.shared is not None:
        parts = [f"shared.fc.{n}" for n in moe.shared.fc] if isinstance(moe.shared.fc, SplitLinear) else ["shared.fc"]
        for name in parts:  # Linear (F, H), bias (F,)
            out[f"{name}.weight"], out[f"{name}.bias"] = Shard(0), Shard(0)
        out["shared.proj.weight"], out["shared.proj.bias"] = Shard(1), Replicate()
    return out
