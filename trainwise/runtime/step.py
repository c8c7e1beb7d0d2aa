"""How one training step runs, built in one place: the trainer, verify, the operator recorder, the
calibration, the roofline, the simulator and the scaling sweep all take their model and step from here.

    model = build_model(cfg.model)                 # the one constructor of the Transformer
    step = build_step(model, cfg.train, device, precision)   # + compiled attention, checkpointing,
                                                   #   compile, sharding, optimizer, loss scaler
    step(batches)                                  # one optimizer step over K micro-batches:

    for each of K micro-batches:  loss = model(x, y) under autocast;  (loss / K).backward()
        (under DDP/FSDP the gradients are reduced on the last micro-batch only)
    clip the gradient norm (computed even without clipping: it is logged)
    optimizer step, skipped on the device if the norm is NaN/inf (train.on_nonfinite = skip), or
        NonFiniteGradient raised (stop); fp16: the GradScaler unscales, steps and updates
    zero the gradients (set to None)
    MoE layers with a choice bias (model.router_bias): move it by the step's expert load (all micro-batches,
        averaged over the data-parallel ranks, so every replica of a layer holds the same bias)

With pipeline parallelism (runtime.pipeline) the K micro-batches go through PyTorch's pipeline schedule
instead of the loop above (the schedule scales gradients by 1/K), and the loss and the expert load are the
pipeline's (each stage's own layers, from the K micro-batches' forwards only); a tied embedding's two copies
(first and last stage) have their gradients summed before the clip, which counts the table once; divided
experts (parallel.ep) have theirs reduced over edp once the schedule's backward is done.

A hook sees the step between its phases ("forward" and "backward" after each micro-batch, "step" after
the update, before the gradients are freed): memory tracking, operator recording and the trainer's
per-rank accounting watch the very step that trains.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from trainwise.config import ModelConfig, TrainConfig
from trainwise.errors import TrainwiseError
from trainwise.model import Transformer
from trainwise.model.moe import MoE
from trainwise.runtime import distributed
from trainwise.runtime.context_parallel import apply_cp
from trainwise.runtime.fused import split_fused
from trainwise.runtime.optim import build_optimizer, step_if_finite
from trainwise.runtime.parallelize import apply_activation_checkpointing, apply_compile, use_compiled_attention
from trainwise.runtime.pipeline import Pipeline, RankModel, build_pipeline, split_stages
from trainwise.runtime.precision import autocast
from trainwise.runtime.tensor_parallel import apply_tp

Hook = Callable[[str], None]


def _no_hook(phase: str) -> None:
    pass


class NonFiniteGradient(Exception):
    """The gradient norm of a step is NaN or inf and train.on_nonfinite = stop: nothing was updated."""

    def __init__(self, loss: torch.Tensor):
        super().__init__("non-finite gradient norm")
        self.loss = loss


@dataclass
class StepResult:
    loss: torch.Tensor  # mean over the micro-batches (detached, on the device)
    grad_norm: torch.Tensor | None  # before clipping; None without an optimizer
    skipped: torch.Tensor | None  # 1.0 when a non-finite step was skipped (on the device)


@dataclass
class TrainingStep:
    """A model ready to train (checkpointed, compiled and sharded as configured), its optimizer and
    loss scaler; calling it runs one optimizer step (module docstring)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    precision: str  # "fp32" | "bf16" | "fp16": the autocast recipe
    grad_clip: float = 1.0  # 0 = no clipping
    on_nonfinite: str = "skip"
    dist: distributed.Dist = field(default_factory=lambda: distributed.Dist("none"))
    compiled: bool = False
    eval_forward: Callable | None = None  # a whole-model compile's eager forward (evaluation calls it)
    scaler: torch.amp.GradScaler | None = None
    pipeline: Pipeline | None = None  # pipeline parallel: this rank's stages and their schedule

    def __post_init__(self) -> None:
        if self.scaler is None:
            self.scaler = loss_scaler(self.device, self.precision, self.dist)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.balanced = [m for m in self.model.modules() if isinstance(m, MoE) and m.expert_bias is not None]

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], hook: Hook = _no_hook,
                 loss_sum: torch.Tensor | None = None) -> StepResult:
        """One step over `batches` (the K micro-batches). loss_sum: a device tensor each micro-batch's
        loss is added to in place (the trainer's running sum between log rows)."""
        k = len(batches)
        if self.pipeline is not None:
            # fp16: the scaler's scale (scaling a one sets it up, as scaling the loss does in one process)
            scale = self.scaler.scale(torch.ones((), device=self.device)).item() if self.scaler.is_enabled() else 1.0
            with distributed.gradient_sync(self.model, self.dist, last_micro_batch=True):  # divided experts
                total = self.pipeline.run(batches, scale)  # forward and backward of all K micro-batches
            hook("forward")
            hook("backward")
            load = self.pipeline.expert_load(self.balanced)
            if loss_sum is not None:
                loss_sum += total
        else:
            total, load = self._micro_batches(batches, hook, loss_sum)
        if self.optimizer is None:
            return StepResult(total / k, None, None)
        self.scaler.unscale_(self.optimizer)
        shared = self.pipeline.shared_params() if self.pipeline is not None else []
        grad_norm = distributed.clip_grad_norm(self.params, self.grad_clip or float("inf"), self.dist, shared)
        skipped = None
        if self.scaler.is_enabled():  # fp16: the scaler skips a step with inf/NaN and lowers the scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self.on_nonfinite == "stop" and not bool(torch.isfinite(grad_norm)):
            raise NonFiniteGradient(total / k)
        else:
            skipped = step_if_finite(self.optimizer, grad_norm)
        hook("step")
        self.optimizer.zero_grad(set_to_none=True)
        if load is not None:
            load = distributed.mean_across_ranks(load.float(), self.dist,
                                                 self.dist.dp_group if self.dist.active else None)
            for m, layer_load in zip(self.balanced, load):
                m.balance_expert_bias(layer_load)
        return StepResult(total / k, grad_norm, skipped)

    def _micro_batches(self, batches, hook: Hook, loss_sum: torch.Tensor | None):
        """Forward and backward of each micro-batch in turn: (summed loss, summed expert load or None)."""
        k = len(batches)
        total, load = None, None
        for i, (x, y) in enumerate(batches):
            with distributed.gradient_sync(self.model, self.dist, i == k - 1):
                with autocast(self.device, self.precision):
                    loss = self.model(x, y)
                hook("forward")
                if self.balanced:
                    counts = torch.stack([m.last_expert_counts for m in self.balanced])
                    load = counts if load is None else load + counts
                self.scaler.scale(loss / k).backward()
            if loss_sum is not None:
                loss_sum += loss.detach()
            total = loss.detach() if total is None else total + loss.detach()
            hook("backward")
        return total, load

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one batch, forward only (evaluation): through the pipeline when there is one."""
        if self.pipeline is not None:
            return self.pipeline.eval_loss(x, y)
        forward = self.eval_forward or self.model
        return forward(x, y)


class _JobScaler(torch.amp.GradScaler):
    """GradScaler whose inf/NaN flag is the whole job's: unscale_ takes the maximum of every rank's (one
    all-reduce of one float), so that every rank skips the same steps and keeps the same scale. (torch's
    ShardedGradScaler does the same with a flag of shape (1,), which the fused AdamW kernel refuses.)"""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        for found in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)


def loss_scaler(device: torch.device, precision: str, dist: distributed.Dist | None) -> torch.amp.GradScaler:
    """fp16's loss scaler (disabled otherwise). Under torchrun every rank holds other gradients (pipeline
    stages, tensor or FSDP shards), so whether any is inf or NaN is all-reduced over the job once per step
    (_JobScaler)."""
    if precision == "fp16" and dist is not None and dist.active:
        return _JobScaler(device.type)
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def build_model(cfg: ModelConfig, device: torch.device | str | None = None) -> Transformer:
    """The model of `cfg`, initialised from the global RNG (seed it first), on `device` (default: the
    CPU it is built on). device "meta" builds the shapes only: nothing is allocated."""
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return Transformer(cfg)
    model = Transformer(cfg)
    return model if device is None else model.to(device)


def build_step(model: nn.Module, train: TrainConfig, device: torch.device, precision: str, *,
               dist: distributed.Dist | None = None, compile: bool = False, optimizer: bool = True,
               optimizer_state: dict | None = None) -> TrainingStep:
    """Make `model` (built by build_model, weights loaded, on `device`) ready to train as `train` says,
    from outside: context parallelism (runtime.context_parallel), a compiled CPU step's attention, activation
    checkpointing, torch.compile (whole model, or per block under FSDP2), DDP/FSDP2 for `dist`'s strategy (over
    the dp x cp ranks); then its optimizer (ZeRO-1's sharded one under zero1; `optimizer_state` loaded into it)
    and loss scaler. On a mesh with tp or pp > 1 see _build_divided."""
    dist = dist or distributed.Dist("none")
    if dist.mesh is not None:
        return _build_divided(model, train, device, precision, dist, compile, optimizer)
    if dist.cp_group is not None:
        apply_cp(model, dist.cp_group)
    if compile and device.type == "cpu":
        use_compiled_attention(model)
    if train.activation_checkpointing != "none":
        apply_activation_checkpointing(model, train.activation_checkpointing)
    if compile:
        apply_compile(model, per_block=dist.fsdp)
    # A whole-model compile traced the training graph; under no_grad it would compile a second one
    # (tens of seconds with a cold cache) to save about a second per evaluation: evaluation runs eager.
    eval_forward = model.forward if compile and not dist.fsdp else None
    model = distributed.wrap(model, dist, device, precision)
    model.train()
    opt = None
    if optimizer:
        opt = build_optimizer(model, train, shard_states=dist.active and dist.strategy == "zero1")
        if optimizer_state is not None:
            opt.load_state_dict(optimizer_state)  # copies the state tensors
    return TrainingStep(model, opt, device, precision, train.grad_clip, train.on_nonfinite, dist, compile,
                        eval_forward)


def _build_divided(model: nn.Module, train: TrainConfig, device: torch.device, precision: str,
                   dist: distributed.Dist, compile: bool, optimizer: bool) -> TrainingStep:
    """The model divided over the mesh, torchtitan's order: fused projections split (runtime.fused); with
    pp > 1 this rank's pipeline stages cut out (runtime.pipeline); on each part context parallelism
    (runtime.context_parallel), tensor parallelism (runtime.tensor_parallel), activation checkpointing,
    per-block compile, then the data-parallel dimension (FSDP2 or replicate, over dp x cp); then the pipeline
    schedule and the optimizer over this rank's parameters. The weights are the whole model's, initialised (or
    loaded) before it was divided."""
    layout, mesh = dist.layout, dist.mesh
    split_fused(model)
    parts, layers = [model], list(range(model.cfg.n_layers))
    if layout.pp > 1:
        parts, layers = split_stages(model, layout, dist.pp_rank, seq_shards=layout.tp)
        for part in parts:
            part.amp = functools.partial(autocast, device, precision)
    for part in parts:
        if dist.cp_group is not None:  # before tensor parallelism: its hooks then see the rank's positions
            apply_cp(part, dist.cp_group)
        if layout.tp > 1:
            apply_tp(part, mesh["tp"])
        if compile and device.type == "cpu":
            use_compiled_attention(part)
        if train.activation_checkpointing != "none":
            apply_activation_checkpointing(part, train.activation_checkpointing)
        if compile:
            apply_compile(part, per_block=True)
        distributed.wrap(part, dist, device, precision)
    pipeline = None
    if layout.pp > 1:
        pipeline = build_pipeline(parts, layout, dist.pp_rank, mesh["pp"].get_group(), device, train.grad_accum_steps,
                                  tie_embeddings=model.cfg.tie_embeddings)
        model = RankModel(model, pipeline.parts, layers)
    model.train()
    opt = build_optimizer(model, train) if optimizer else None
    return TrainingStep(model, opt, device, precision, train.grad_clip, train.on_nonfinite, dist, compile,
                        pipeline=pipeline)


def random_batches(vocab_size: int, micro_batch: int, seq_len: int, grad_accum: int, device: torch.device,
                   seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K seeded (x, y) batches of token ids; FLOPs and memory depend only on their shapes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(grad_accum):
        ids = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), generator=g)
        out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out
