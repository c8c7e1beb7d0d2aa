"""Pipeline parallelism on torch.distributed.pipelining: the model's layers split into stages, one
PipelineStage per stage, micro-batches scheduled by PyTorch's GPipe, 1F1B or interleaved 1F1B.

    stages = pp x vpp; stage s holds contiguous layers, as the planner cuts them (cost.schedule.chunk_layers:
    even where pp x vpp divides L, otherwise one fewer on the last and first stages)
    the first stage also holds the embedding, the last the final norm and the LM head (and the loss)
    pipeline rank r holds stages r, r + pp, ... (vpp of them: the interleaved schedule's "loop" placement)
    micro-batches = train.grad_accum_steps; each is micro_batch sequences

A stage module is plain PyTorch over the model's own modules (no copy): what Transformer.forward does for
its share of the layers. Under tensor parallelism a stage's input and output are the rank's T/tp
positions (sequence parallelism), so the activations sent between stages shrink by tp too.

Tied embeddings (model.tie_embeddings) live on two ranks, as in Megatron-LM: the first stage holds the
table, the last stage its own copy as the LM head's weight, a clone of the same seeded table (every rank
builds the whole model from the run's seed, or loads the same weights, before it is divided). After each
step's backward the two gradients are all-reduced (summed) between the first and the last stage, the sum
one process accumulates in its one tensor, so both copies take the same update and stay bit-equal; the
gradient norm counts the table once, on the first stage (TiedEmbedding).

MoE layers on any stage add their auxiliary loss's gradient where they run (the loss itself is computed
on the last stage only): each stage hooks its layers' auxiliary losses onto its output with an identity
whose backward hands them a gradient of one, as Megatron-LM's MoEAuxLossAutoScaler does; the schedule then
divides every gradient by the number of micro-batches, as (loss / K).backward() does in one process.

The schedule's first step infers the shapes passed between stages by running each stage's forward once more,
with gradients on (has_backward), before the K micro-batches: on the first micro-batch on the first stage,
on uninitialised tensors of the received shape on the others. That forward routes tokens and computes
auxiliary losses that are not the step's, so a stage records every training forward's and the step keeps the
last K (StageModule.keep_last): the logged loss and the choice bias's expert load are the K micro-batches'.
Under expert parallelism that forward also runs the experts' all-to-alls (the ep group's ranks are on the same
stage and infer together): real collectives of the first step only; the rows a stage sent to each expert
(expert_parallel.routed_tokens) are the K micro-batches' too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                         ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                         ScheduleZBVZeroBubble)

from trainwise.config.run import MULTI_STAGE_SCHEDULES
from trainwise.cost.layout import V_SCHEDULES, Layout
from trainwise.cost.schedule import rank_stages, stage_layers
from trainwise.model import Transformer
from trainwise.model.moe import MoE

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "interleaved_zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}


class _AttachAux(torch.autograd.Function):
    """Identity on the stage's output; backward gives the MoE auxiliary loss a gradient of `scale` (the loss
    scale: one without fp16). The output is a copy, not a view of the input: a zero-bubble schedule's input
    half detaches the stage's output, which autograd refuses for a view made by a custom function."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_shape, ctx.scale = aux.shape, scale
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, device=grad.device, dtype=torch.float32), None


class StageModule(nn.Module):
    """One pipeline stage of a Transformer: its share of the blocks, the embedding on the first stage,
    the final norm and LM head on the last. forward: token ids (first stage) or hidden states -> hidden
    states, or logits on the last stage."""

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.embed = model.embed if first else None
        self.pos_embed = model.pos_embed if first else None
        self.drop = model.drop
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        if model.cfg.position == "rope":
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.seq_shards = 1  # tp under sequence parallelism: hidden states hold T / seq_shards positions
        self.amp = contextlib.nullcontext  # the autocast of the run's precision: the forward's, not backward's
        self.loss_scale = 1.0  # fp16's loss scale this step (Pipeline.run)
        self.aux_losses: list[torch.Tensor] = []  # each training forward's MoE auxiliary loss, detached (the log)
        self.expert_counts: list[dict[int, torch.Tensor]] = []  # each training forward's id(MoE) -> assignments
        self.routed: list[torch.Tensor] = []  # each training forward's (E,) rows sent to each divided expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.amp():
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            T = x.shape[1]
            h = self.embed(x)  # (B, T, H), or (B, T/tp, H) under sequence parallelism
            if self.pos_embed is not None:
                h = h + self.pos_embed(torch.arange(T, device=x.device))
            h = self.drop(h)
        else:
            h, T = x, x.shape[1] * self.seq_shards
        rope = (self.rope_cos[:T], self.rope_sin[:T]) if self.cfg.position == "rope" else None
        for block in self.blocks:
            h = block(h, rope)
        moe = [b.mlp for b in self.blocks if isinstance(b.mlp, MoE)]
        if moe and self.training and torch.is_grad_enabled():
            self.expert_counts.append({id(m): m.last_expert_counts for m in moe})
            sent = [m.exchange.last_counts for m in moe if m.exchange is not None]
            if sent:
                self.routed.append(torch.stack(sent).sum(0))
            total = torch.stack([m.last_aux_loss.float() for m in moe]).sum()
            self.aux_losses.append(total.detach())
            h = _AttachAux.apply(h, total, self.loss_scale)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))  # (B, T, V)
        return h

    def keep_last(self, forwards: int) -> None:
        """Keep the records of the last `forwards` training forwards: the step's micro-batches, without the
        schedule's shape inference before them (module docstring)."""
        del self.aux_losses[:max(0, len(self.aux_losses) - forwards)]
        del self.expert_counts[:max(0, len(self.expert_counts) - forwards)]
        del self.routed[:max(0, len(self.routed) - forwards)]

    def expert_load(self) -> dict[int, torch.Tensor]:
        """id(MoE) -> its assignments per expert (E,), summed over the recorded forwards."""
        load: dict[int, torch.Tensor] = {}
        for counts in self.expert_counts:
            for key, c in counts.items():
                load[key] = c if key not in load else load[key] + c
        return load


class RankModel(nn.Module):
    """The modules of one pipeline rank's stages under the names they have in the whole model
    ("embed.weight", "blocks.5.attn.qkv.q.weight", ...): what the optimizer, the checkpoint and the
    per-rank accounting see. Not called: the stages run."""

    def __init__(self, model: Transformer, stages: list[StageModule], layers: list[int]):
        super().__init__()
        self.cfg = model.cfg
        self.embed = model.embed if any(s.embed is not None for s in stages) else None
        self.pos_embed = model.pos_embed if self.embed is not None else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.norm = model.norm if any(s.lm_head is not None for s in stages) else None
        self.lm_head = model.lm_head if self.norm is not None else None
        self.stages = stages  # a plain list: not registered twice

    def train(self, mode: bool = True) -> RankModel:
        super().train(mode)
        for stage in self.stages:  # the stage modules' own flag (their blocks are ours)
            stage.train(mode)
        return self


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The model's loss on the last stage: mean next-token cross-entropy in fp32 (Transformer.forward)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class ScaledLoss:
    """The schedule's loss function: cross_entropy x `scale`, fp16's loss scale for the step (1 otherwise), as
    one process scales each micro-batch's loss before its backward."""

    def __init__(self):
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy(logits, targets)
        return loss * self.scale if self.scale != 1.0 else loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own elements of a DTensor (a view: collectives on it write into the DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


class TiedEmbedding:
    """This rank's copies of a tied embedding table (the embedding's weight on the first stage, the LM head's
    on the last; both under a V schedule, whose rank 0 holds both ends) and the group of the two ranks holding
    them with the same dp and tp coordinates (None when one rank holds both)."""

    def __init__(self, modules: list[nn.Module], group, last: bool):
        self.modules = modules  # model.embed and / or model.lm_head: their weights are read when used (wrapping
        self.group = group  # replaces them)
        self.last = last  # the last stage's copy is here

    def all_reduce_grads(self) -> None:
        """Sum the two copies' gradients (this rank's shard of them, fp32) so both hold the whole model's."""
        for module in self.modules:
            weight = module.weight
            if weight.grad is None:  # no gradient reached it: a zero, so the sum has its other term
                weight.grad = torch.zeros_like(weight)
            grad = weight.grad
            if hasattr(grad, "placements") and grad.placements != weight.placements:
                # the vocabulary-parallel embedding's gradient comes back whole (Replicate): cut to the rank's
                # rows, the placement of the head's copy (the clip would do the same, runtime.distributed)
                weight.grad = grad.redistribute(grad.device_mesh, weight.placements)
        with torch.no_grad():
            if len(self.modules) == 2:  # both copies here: the same sum in both
                table, copy = (_local(m.weight.grad) for m in self.modules)
                table.add_(copy)
                copy.copy_(table)
            else:
                dist.all_reduce(_local(self.modules[0].weight.grad), group=self.group)

    def copies(self) -> list[torch.Tensor]:
        """The parameter that the first stage counts in the gradient norm already: the last stage's copy."""
        return [self.modules[-1].weight] if self.last else []


def tied_group(layout: Layout):
    """The process group of this rank's tied table: it and the rank with the same dp and tp coordinates on
    the other end of the pipeline (rank = (pp_rank x dp + dp_rank) x tp + tp_rank, runtime.mesh). Every rank
    creates every group (torch.distributed's rule); None on a rank at neither end."""
    per_stage = layout.dp * layout.tp
    group, _ = dist.new_subgroups_by_enumeration([[i, (layout.pp - 1) * per_stage + i] for i in range(per_stage)])
    return group


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them."""

    layout: Layout
    parts: list[StageModule]
    stages: list[PipelineStage]
    schedule: object
    group: object  # the pp process group
    device: torch.device
    eval_schedule: object = None
    tied: TiedEmbedding | None = None  # this rank's copy of a tied embedding, on the first or the last stage
    loss: ScaledLoss = field(default_factory=ScaledLoss)  # the training schedule's loss function
    _losses: list = field(default_factory=list)

    @property
    def first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_scale: float = 1.0) -> torch.Tensor:
        """One training step's forward and backward over the K micro-batches (the schedule's order), each
        micro-batch's losses multiplied by `loss_scale` for its backward (fp16's scaler); the sum of their
        losses (cross-entropy + MoE auxiliary losses, unscaled), the same on every pipeline rank."""
        self.loss.scale = loss_scale
        for part in self.parts:
            part.keep_last(0)
            part.loss_scale = loss_scale
        x = torch.cat([b[0] for b in batches])  # (K B, T): the schedule cuts it into K micro-batches again
        y = torch.cat([b[1] for b in batches])
        total = self._step(self.schedule, x, y, micro_batches=len(batches))
        if self.tied is not None:
            self.tied.all_reduce_grads()
        return total

    def shared_params(self) -> list[torch.Tensor]:
        """Parameters whose gradient norm another rank counts (module docstring): clipped here, not counted."""
        return self.tied.copies() if self.tied is not None else []

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one batch on every rank: forward only, except in a V (zbv, dualpipev), whose torch
        runtime runs its backward actions in eval() too: there the batch's backward runs as well and its
        gradients are dropped (evaluation comes between steps, when there are none), and both schedules set
        up the stages they share again (for one micro-batch, then for the step's K)."""
        if self.layout.pp_schedule not in V_SCHEDULES:
            with torch.no_grad():
                return self._step(self.eval_schedule, x, y)
        for schedule in (self.eval_schedule, self.schedule):  # the stages they share: one micro-batch, then K
            schedule._stages_forward_initialized = schedule._stages_backward_initialized = False
        with torch.enable_grad():
            loss = self._step(self.eval_schedule, x, y, backward=True)
        for part in self.parts:
            for p in part.parameters():
                p.grad = None
        return loss

    def _step(self, schedule, x: torch.Tensor, y: torch.Tensor, micro_batches: int = 0,
              backward: bool = False) -> torch.Tensor:
        """A training step over `micro_batches`, or (0) an evaluation: the mean loss of one batch, as one
        process's model in eval mode computes it (without auxiliary losses)."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        if micro_batches or backward:  # return_outputs=False: the last stage would keep every micro-batch's logits
            schedule.step(*args, return_outputs=False, **kwargs)
        else:
            schedule.eval(*args, **kwargs)
        total = torch.zeros((), device=self.device)
        if losses:  # the training schedule's losses carry the loss scale
            scale = self.loss.scale if micro_batches else 1.0
            total = total + torch.stack([loss.detach().float() for loss in losses]).sum() / scale
        for part in self.parts if micro_batches else ():
            part.keep_last(micro_batches)
            for aux in part.aux_losses:
                total = total + aux
        if not micro_batches:
            total = total / max(1, len(losses))
        dist.all_reduce(total, group=self.group)  # the last stage's losses + every stage's auxiliary ones
        return total

    def expert_load(self, modules: list[nn.Module]) -> torch.Tensor | None:
        """This step's assignments per expert of `modules` (this rank's balanced MoE layers), stacked."""
        loads = {}
        for part in self.parts:
            loads.update(part.expert_load())
        if not modules or any(id(m) not in loads for m in modules):
            return None
        return torch.stack([loads[id(m)] for m in modules])


def split_stages(model: Transformer, layout: Layout, pp_rank: int,
                 seq_shards: int = 1) -> tuple[list[StageModule], list[int]]:
    """This pipeline rank's stage modules (in stage order) and the layers they hold. With tied embeddings
    the last stage's LM head gets its own copy of the table (module docstring)."""
    parts, layers = [], []
    if model.cfg.tie_embeddings and layout.stages - 1 in rank_stages(layout, pp_rank):
        model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone())
    for s in rank_stages(layout, pp_rank):
        span = stage_layers(model.cfg.n_layers, layout.stages, s)
        part = StageModule(model, span, first=s == 0, last=s == layout.stages - 1)
        part.seq_shards = seq_shards
        parts.append(part)
        layers.extend(span)
    return parts, layers


def build_pipeline(parts: list[nn.Module], layout: Layout, pp_rank: int, group, device: torch.device,
                   micro_batches: int, tie_embeddings: bool = False) -> Pipeline:
    """PipelineStages for `parts` (this rank's stage modules, already sharded and wrapped) and the
    schedule of parallel.pp_schedule; a second, one-micro-batch GPipe-style schedule for evaluation; with
    tie_embeddings the group that sums the tied table's gradients (every rank calls this: a collective)."""
    ids = rank_stages(layout, pp_rank)
    stages = [PipelineStage(part, s, layout.stages, device, group=group) for part, s in zip(parts, ids)]
    cls = SCHEDULES[layout.pp_schedule]
    multi = layout.pp_schedule in MULTI_STAGE_SCHEDULES
    loss = ScaledLoss()
    schedule = cls(stages if multi else stages[0], n_microbatches=micro_batches, loss_fn=loss)
    # evaluation: one micro-batch forward through the stages as they are placed (DualPipeV takes no fewer
    # micro-batches than stages; ZBV's forwards are the same V)
    eval_cls = (ScheduleZBVZeroBubble if layout.pp_schedule in V_SCHEDULES
                else ScheduleInterleaved1F1B if multi else ScheduleGPipe)
    eval_schedule = eval_cls(stages if multi else stages[0], n_microbatches=1, loss_fn=cross_entropy)
    unwrapped = [getattr(p, "_orig_mod", p) for p in parts]
    v_shape = layout.pp_schedule in V_SCHEDULES  # both ends of the pipeline on rank 0: no group
    tied, tied_pg = None, tied_group(layout) if tie_embeddings and not v_shape else None
    ends = [m for p in unwrapped for m in (p.embed, p.lm_head) if m is not None]
    if tie_embeddings and ends:
        tied = TiedEmbedding(ends, tied_pg, last=any(p.lm_head is not None for p in unwrapped))
    return Pipeline(layout, unwrapped, stages, schedule, group, device, eval_schedule, tied, loss=loss)
