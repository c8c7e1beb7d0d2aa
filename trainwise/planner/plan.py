"""The Plan: parameters, FLOPs, memory and time of one training run, and its JSON (docs/ARCHITECTURE.md,
"The plan's JSON"). Its worked derivation is trainwise.planner.derivation, the `--fit` search trainwise.planner.fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from trainwise.config import ZERO_STAGE, ModelConfig, RunConfig, check_op_checkpointing
from trainwise.cost import flops as FL
from trainwise.cost import loss as L
from trainwise.cost import memory as M
from trainwise.cost.cluster import ClusterStep
from trainwise.cost.gpu import check_attention
from trainwise.cost.layout import Layout, check_layout, make_layout
from trainwise.cost.ops import GATHERED
from trainwise.cost.params import ParamCount, params
from trainwise.cost.rank_memory import RankPeak, highest_peak
from trainwise.cost.recipe import Recipe
from trainwise.cost.run import Machine, Run, fsdp_grad_sync, trains
from trainwise.cost.steptime import StepTime
from trainwise.cost.time import DEFAULT_MFU, TimeEstimate, cost_usd, estimate_time, model_flops_utilization
from trainwise.errors import TrainwiseError
from trainwise.hardware.table import table_gpus
from trainwise.planner.cluster_step import predict_cluster_step
from trainwise.planner.derivation import NO_HARDWARE, NO_TOKENS, explain_plan
from trainwise.planner.device_step import predict_step_time
from trainwise.planner.machine import Hardware, resolve_hardware
from trainwise.runtime.parallelize import resolve_compile


@dataclass
class Plan:
    name: str
    model: ModelConfig | None
    counts: ParamCount
    tokens: float | None  # D, the run's training tokens; None: everything per step, no total time or cost
    seq_len: int
    micro_batch: int
    grad_accum: int
    recipe: Recipe
    optimizer: str
    checkpointing: str
    zero: int
    tp: int
    pp: int
    gpus: int
    hardware: Hardware | None  # None: no --gpu/--peak-flops given; everything but time is known
    mfu: float
    causal_halving: bool
    forward: FL.ForwardFlops | None
    model_flops_per_token: float  # fwd + bwd, no recompute (for MFU)
    flops_per_token: float  # + recompute (what the devices execute)
    convention: str
    states: M.StateBytes
    activations_bytes: int | None
    memory_budget: int | None
    time: TimeEstimate | None  # the whole run's; None without hardware or without tokens
    price: float | None = None
    notes: list[str] = field(default_factory=list)
    compiled: bool = False  # torch.compile: what autograd saves changes (memory.compiled_block_bytes_per_token)
    step: StepTime | None = None  # the step-time model's prediction; None: time from the assumed MFU
    time_source: str = "assumed MFU (--mfu)"  # "calibrated" | "published microbenchmarks" | "assumed MFU (--mfu)"
    layout: Layout | None = None  # how the GPUs split the work (cost.layout)
    cluster: ClusterStep | None = None  # a GPU cluster's step, per operator and collective (cost.cluster)
    # the rank whose step peaks highest, and its peak (cost.rank_memory: what verify holds a run to)
    peak_rank: tuple[int, RankPeak] | None = None
    run: Run | None = None  # the run planned (cost.run.Run)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum * self.dp

    @property
    def step_seconds(self) -> float | None:
        """Predicted seconds of one optimizer step (all devices together); None without hardware."""
        if self.cluster is not None:
            return self.cluster.seconds
        if self.step is not None:
            return self.step.seconds
        if self.hardware is None:
            return None
        return self.flops_per_token * self.tokens_per_step / (self.gpus * self.hardware.peak_flops * self.mfu)

    @property
    def dp(self) -> int:
        return self.layout.dp if self.layout else self.gpus // (self.tp * self.pp)

    @property
    def total_flops(self) -> float | None:
        return None if self.tokens is None else self.flops_per_token * self.tokens

    @property
    def per_device_bytes(self) -> int:
        return self.states.total + (self.activations_bytes or 0) + self.held_grad_sums

    @property
    def held_grad_sums(self) -> int:
        """FSDP2's unsharded fp32 gradient sums over the micro-batches on the highest rank, held beside the states
        through the accumulation (cost.rank_memory.held_grad_sums); the states stay what the step ends with, as
        verify holds a run to them."""
        return self.peak_rank[1].held if self.peak_rank is not None else 0

    @property
    def loss_kernel(self) -> str | None:
        """The cross-entropy the plan's memory prices (cost.loss.loss_kernel); None without a model."""
        if self.model is None:
            return None
        run = self.run
        return L.loss_kernel(self.model, self.compiled, run and run.loss_kernel, run is not None and not trains(run))

    @property
    def peak_bytes(self) -> int | None:
        """Peak of one step on the highest rank (cost.rank_memory.rank_peak): what `trainwise verify` compares with
        tracked memory."""
        if self.activations_bytes is None or self.model is None:
            return None
        return self.peak_rank[1].peak

    @property
    def reserved_bytes(self) -> int | None:
        """The least the caching allocator reserves on the highest rank (cost.rank_memory.RankPeak.reserved): what
        torch.cuda.max_memory_reserved and the memory other stacks log count, at least."""
        return None if self.peak_bytes is None else self.peak_rank[1].reserved

    @property
    def budget(self) -> int | None:
        return self.memory_budget or (self.hardware.memory_bytes if self.hardware else None)

    @property
    def over_budget_bytes(self) -> int | None:
        """Bytes per device beyond the budget (what `does not fit by` says); None when it fits or is unknown."""
        return self.per_device_bytes - self.budget if self.fits is False else None

    @property
    def fits(self) -> bool | None:
        if self.budget is None:
            return None
        if self.per_device_bytes > self.budget:
            return False
        return None if self.activations_bytes is None else True

    @property
    def peak_over_budget_bytes(self) -> int | None:
        """Bytes of the highest rank's step peak beyond the budget; None when it is within it or unknown. `fits`
        holds states + activations to the budget; the step peak adds the step's transient buffers."""
        if self.budget is None or self.peak_bytes is None or self.peak_bytes <= self.budget:
            return None
        return self.peak_bytes - self.budget

    @property
    def cost(self) -> float | None:
        return None if self.price is None or self.time is None else cost_usd(self.time.device_hours, self.price)

    def to_json(self) -> dict[str, Any]:
        c, hw = self.counts, self.hardware
        return {
            "model": {"name": self.name, "params_total": c.total, "params_active": c.active,
                      "params_embedding": c.embedding, "params_non_embedding": c.non_embedding},
            "tokens": None if self.tokens is None else float(self.tokens),
            "flops": {"per_token_train": self.flops_per_token, "total": self.total_flops,
                      "convention": self.convention, "model_flops_per_token": self.model_flops_per_token,
                      "causal_halving": self.causal_halving},
            "memory": {"params_bytes": self.states.params, "grads_bytes": self.states.grads,
                       "optimizer_bytes": self.states.optimizer, "master_bytes": self.states.master,
                       "states_bytes": self.states.total, "activations_bytes": self.activations_bytes,
                       "held_grad_sums_bytes": self.held_grad_sums,
                       "total_bytes": self.per_device_bytes * self.gpus, "per_device_bytes": self.per_device_bytes,
                       "peak_bytes": self.peak_bytes, "reserved_bytes": self.reserved_bytes,
                       "peak_over_budget_bytes": self.peak_over_budget_bytes,
                       "fits": self.fits, "over_budget_bytes": self.over_budget_bytes, "budget_bytes": self.budget,
                       "precision": self.recipe.name, "grad_bytes_per_param": self.recipe.grad_bytes,
                       "fp8_params": self.recipe.fp8_params,
                       "optimizer": self.optimizer, "checkpointing": self.checkpointing, "zero": self.zero,
                       "compiled": self.compiled, "loss_kernel": self.loss_kernel,
                       "scope": "per device except total_bytes (all devices)"},
            "time": self._time_json(),
            # name, peak and bandwidth are null without hardware
            "hardware": {"name": hw and hw.name, "peak_flops": hw and hw.peak_flops,
                         "bandwidth_bytes_per_s": hw and hw.bandwidth_bytes_per_s, "devices": self.gpus,
                         "mfu": self.mfu, "tp": self.tp, "pp": self.pp, "dp": self.dp,
                         "gpus_per_node": hw and hw.node and hw.node.gpus,
                         "intra_node_bytes_per_s": hw and hw.node and hw.node.intra_bytes_per_s,
                         "inter_node_bytes_per_s": hw and hw.node and hw.node.inter_bytes_per_s,
                         **(self._calibration_json() if hw and hw.calibration else {})},
            "layout": self.layout.to_json() if self.layout else None,
            "comm": self.cluster.comm if self.cluster else {},
            "run": {"seq_len": self.seq_len, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                    "global_batch_tokens": self.seq_len * self.micro_batch * self.grad_accum * self.dp},
        }

    def _calibration_json(self) -> dict:
        """When this machine's calibration prices the plan: when it was taken, what is wrong with it, and
        the last speed probe's reading (reference steps now / at calibration)."""
        cal = self.hardware.calibration
        probe = cal.get("last_probe")
        return {"calibrated_at": cal.get("measured_at"), "calibration_note": self.hardware.calibration_note,
                "last_probe": probe and {k: probe[k] for k in ("at", "ratio", "overhead_ratio", "kernel_ratio")}}

    def explain(self) -> str:
        """The worked derivation: each formula, the numbers substituted, the result."""
        return explain_plan(self)

    @property
    def mfu_bf16_peak(self) -> float | None:
        """An FP8 run's MFU against the GPU's bf16 peak (`mfu` is against its FP8 peak); None otherwise."""
        acc = self.hardware and self.hardware.accelerator
        if not self.recipe.fp8 or acc is None:
            return None
        return self.mfu * self.hardware.peak_flops / acc.peak("bf16")

    def _time_json(self) -> dict[str, Any]:
        """Without hardware the keys stay, null, with a note saying what to give (JSON contract: same keys);
        without tokens the step's figures are there and the run's totals null, with a note."""
        if self.hardware is None:
            return {"seconds": None, "days": None, "device_hours": None, "step_seconds": None, "tokens_per_s": None,
                    "mfu": None, "source": self.time_source, "note": NO_HARDWARE}
        t = self.time
        out = {"seconds": t and t.seconds, "days": t and t.days, "device_hours": t and t.device_hours,
               "step_seconds": self.step_seconds, "tokens_per_s": self.tokens_per_step / self.step_seconds,
               "mfu": self.mfu, "source": self.time_source,
               **({"cost_usd": self.cost} if self.price is not None else {}),
               **({} if t else {"note": NO_TOKENS})}
        if self.mfu_bf16_peak is not None:  # published FP8 runs state MFU against the bf16 peak
            out["mfu_bf16_peak"] = self.mfu_bf16_peak
        if self.step is not None and self.step.comm:  # a data-parallel step's collectives, and their link
            out["comm"] = {"collectives_s": self.step.comm, "exposed_s": self.step.comm_s, "how": self.step.comm_how}
        if self.cluster is not None:  # exposed seconds per step by term (they add up) and per operator/collective
            out.update(breakdown=self.cluster.breakdown, ops=self.cluster.ops,
                       source_detail=self.hardware.kernel_source)
        return out



def positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise TrainwiseError(f"{name} = {value} must be positive.")


# The most micro-batches per step `trainwise plan` takes: its memory and pipeline terms replay a step's schedule
# micro-batch by micro-batch (cost.schedule), ~6 s for this many, and a run's global batch of sequences is
# micro-batch x this x data-parallel ranks; a larger count is a mistyped flag, not a run to plan. (The trainer's
# own plan of a run takes whatever train.grad_accum_steps says: that run's steps take longer still.)
MAX_MICRO_BATCHES = 100_000


def check_micro_batches(grad_accum: int) -> None:
    if grad_accum > MAX_MICRO_BATCHES:
        raise TrainwiseError(
            f"{grad_accum:,} micro-batches per step (--grad-accum, or --global-batch / (micro-batch x dp)) is more "
            f"than the {MAX_MICRO_BATCHES:,} a plan replays: its schedule is priced micro-batch by micro-batch. "
            "Raise --micro-batch or the data-parallel ranks, or lower the global batch.")


def check_numbers(*named: tuple[str, float | None], mfu: float | None = None) -> None:
    """The numbers a user gives, each named by the flag that sets it: positive, and --mfu a fraction."""
    for name, value in named:
        positive(name, value)
    if mfu is not None and not 0 < mfu < 1:
        raise TrainwiseError(f"--mfu {mfu} must be a fraction of the peak between 0 and 1 (no step runs every FLOP "
                             "at peak), e.g. 0.4.")


def plan_for_run(cfg: RunConfig, precision: str, peak_flops: float, device: str | None = None,
                 compiled: bool | None = None, world_size: int = 1) -> Plan:
    """The plan of a trainwise run as the trainer will execute it. device "cpu" (or "cuda"): this
    machine's calibration prices the step (a GPU without one: its table entry at default efficiencies),
    compiled or eager, per torchrun rank when world_size > 1; otherwise one device of `peak_flops` at
    the assumed MFU. compiled None: decided as the trainer decides (train.compile)."""
    t = cfg.train
    if compiled is None:
        compiled, _ = resolve_compile(t.compile, cfg.model, t.max_steps, cfg.parallel.strategy)
    if device in ("cpu", "cuda"):  # tokens: every rank's (Run.of counts the data-parallel ranks)
        zero = ZERO_STAGE[cfg.parallel.strategy] if world_size > 1 else 0
        layout = make_layout(world_size, zero=zero, micro_batches=t.grad_accum_steps)
        return plan_run(Run.of(cfg, precision, layout, compiled, Machine(gpu=device)))
    return plan_run(Run.of(cfg, precision, compiled=compiled, machine=Machine(peak_flops=peak_flops)), mfu=DEFAULT_MFU)


def plan_run(run: Run, *, mfu: float | None = None, price: float | None = None, memory_budget: int | None = None,
             causal_halving: bool = False, params_count: float | None = None) -> Plan:
    """Everything the planner knows about one run (cost.run.Run: the model, the batch, the recipe, the
    layout, the tokens and the machine). A run without a model needs `params_count` (6ND rule).
    Time: with a model and no `mfu`: on a table GPU (or this machine's, uncalibrated) the cluster model
    for any layout (cost.cluster: operators at published kernel rates, collectives at published NCCL
    bandwidths, the pipeline's bubble); on a calibrated device (--gpu cpu) the step-time model
    (cost.steptime); else total FLOPs / (G x peak x MFU), MFU = `mfu` or DEFAULT_MFU (a what-if).
    Without `run.tokens` everything is per step: no total FLOPs, time or cost; without `run.machine`
    (a --gpu or a --peak-flops) no time. `memory_budget`: the bytes per device `fits` holds the plan to
    (default: the device's memory); `price`: $ per device-hour."""
    if run.layout.fsdp_grad_sync is None:  # the stack's: what the rank memory model and the cluster step both read
        run = replace(run, layout=replace(run.layout, fsdp_grad_sync=fsdp_grad_sync(run)))
    model, layout, machine = run.model, run.layout, run.machine or Machine()
    micro_batch, seq_len, grad_accum, tokens = run.micro_batch, run.seq_len, run.grad_accum, run.tokens
    recipe, optimizer, checkpointing, compiled = run.recipe, run.optimizer, run.checkpointing, run.compiled
    gpus, tp, pp, zero = layout.gpus, layout.tp, layout.pp, layout.zero
    check_numbers(("--tokens", tokens), ("--seq-len", seq_len), ("--micro-batch", micro_batch),
                  ("--grad-accum", grad_accum), ("--tp", tp), ("--pp", pp), ("--gpus", gpus),
                  ("--params", params_count), ("--price", price), mfu=mfu)
    if model is None and params_count is None:
        raise TrainwiseError("give a model (--model PRESET|FILE) or a parameter count (--params N).")
    if checkpointing not in FL.RECOMPUTE:
        raise TrainwiseError(f"--checkpointing '{checkpointing}' must be none, selective, op or full.")
    notes = []
    if model is not None:
        check_op_checkpointing(model, checkpointing, "--checkpointing")
        if seq_len > model.max_seq_len:  # the model as it must be configured to take these sequences
            notes.append(f"seq_len {seq_len} > the model's max_seq_len {model.max_seq_len}: planned with max_seq_len "
                         f"{seq_len}" + (" (learned positions: a longer table)" if model.position == "learned" else ""))
            model = replace(model, max_seq_len=seq_len)
            run = replace(run, model=model)
    if run.loss_kernel not in (None, *L.STACK_LOSSES):
        raise TrainwiseError(f"loss_kernel {run.loss_kernel!r} is not a cross-entropy the planner knows: give one of "
                             f"{', '.join(L.STACK_LOSSES)}, or none for the stack's default.")
    if not run.moe_imbalance >= 1:
        raise TrainwiseError(
            f"--moe-imbalance {run.moe_imbalance} is the most loaded expert-parallel rank's tokens over the mean, "
            "so at least 1 (1.0: balanced routing, as published MoE benchmarks force it; 1.2: 20% above the mean).")
    gpu = machine.gpu
    has_hw = gpu is not None or machine.peak_flops is not None
    threads = max(1, (os.cpu_count() or 1) // gpus) if gpu and gpu.lower() == "cpu" and gpus > 1 else None
    hw = resolve_hardware(gpu, machine.peak_flops, machine.bandwidth, machine.memory, recipe.compute_dtype, threads,
                          gpus_per_node=machine.gpus_per_node, intra_node_bw=machine.intra_node_bw,
                          inter_node_bw=machine.inter_node_bw, gpus=gpus,
                          clock_share=machine.clock_share) if has_hw else None
    if hw is not None:
        check_attention(layout.attention_impl, hw.accelerator)
    if recipe.fp8 == "mx" and hw is not None and not (hw.accelerator and hw.accelerator.mx):
        raise TrainwiseError(
            "--precision mxfp8 needs tensor cores that take MX block-scaled formats (Blackwell: --gpu "
            f"{table_gpus(lambda a: a.mx)}); the {hw.name} has none. Plan it with --precision fp8 (per-tensor or "
            "--fp8-recipe blockwise scaling) or bf16.")
    if hw is None and machine.memory:
        memory_budget = memory_budget or int(machine.memory)  # --memory without a device: still the capacity to fit
    dp = layout.dp
    model_parallel = layout.tp * layout.pp * layout.cp * layout.ep > 1
    if model is not None:
        counts = params(model)
        fwd = FL.forward_flops_per_token(model, seq_len, causal_halving)
        model_fpt = 3.0 * fwd.total
        fpt = model_fpt + FL.recompute_flops_per_token(fwd, checkpointing, model)
        convention = "exact" if fpt == model_fpt else "exact+recompute"
        check_layout(model, layout, seq_len)
        acts = M.activation_bytes(model, recipe, micro_batch, seq_len, checkpointing, tp, compiled, run.loss_kernel)
        peak_rank = highest_peak(run)
        name = model.name
    else:
        n = int(params_count)
        counts = ParamCount(total=n, active=n, embedding=0, non_embedding=n)
        fwd, acts, name = None, None, f"{n:.3g} params"
        model_fpt = 6.0 * n
        fpt = model_fpt + (2.0 * n if checkpointing == "full" else 0.0)
        convention = "8ND" if checkpointing == "full" else "6ND"
        notes.append("activations unknown without a model config (--params only)")
        peak_rank = None
    fp8_numel = M.block_matmul_params(model) if model and recipe.fp8_params else 0
    # HSDP: the states over its shard group
    states = M.state_bytes(counts.total, recipe, optimizer, zero, layout.shard // layout.cp, tp * pp, fp8_numel)
    if gpus > 1 and peak_rank is not None:  # over more than one rank: the highest rank's states and activations
        high = peak_rank[1]
        states, acts = M.StateBytes(high.params, high.grads, high.optimizer, high.master), high.activations
    step, cluster, source, t = None, None, "assumed MFU (--mfu)", None
    if hw is None:
        source = "no hardware"
    elif mfu is None and model is not None and hw.accelerator is not None and hw.profile is None:
        cluster = predict_cluster_step(model, layout, hw.accelerator, hw.node, micro_batch=micro_batch,
                                       seq_len=seq_len, recipe=recipe, checkpointing=checkpointing,
                                       optimizer=optimizer, tp_overlap=layout.tp_overlap, compiled=compiled,
                                       moe_imbalance=run.moe_imbalance, fused=run.fused)
        source = "published microbenchmarks"
        tokens_per_s = seq_len * micro_batch * grad_accum * dp / cluster.seconds
        mfu = model_flops_utilization(model_fpt * tokens_per_s, hw.peak_flops, gpus)
        t = TimeEstimate(tokens / tokens_per_s, gpus) if tokens else None
    elif mfu is None and model is not None and hw.profile is not None and not model_parallel:
        step = predict_step_time(model, hw.profile, micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum,
                         compute_dtype=recipe.compute_dtype, checkpointing=checkpointing, optimizer=optimizer,
                         zero=zero, dp=dp, n_params=counts.total, grad_bytes=4 * counts.total,
                         param_bytes=4 * counts.total, compiled=compiled, cuda=hw.cuda,
                         record=recipe.record_precision(layout.strategy in GATHERED),
                         reduces=grad_accum if layout.reduces_each_micro_batch else 1)
        source = hw.profile.source
        tokens_per_s = seq_len * micro_batch * grad_accum * dp / step.seconds
        mfu = model_flops_utilization(model_fpt * tokens_per_s, hw.peak_flops, gpus)
        t = TimeEstimate(tokens / tokens_per_s, gpus) if tokens else None
    else:
        if mfu is None and model is not None and hw.profile is not None:
            notes.append("a model-parallel layout on this machine's calibration (tp/pp/cp/ep) is not modelled per "
                         "operator: time from the assumed MFU; plan it on a table GPU (--gpu a100-80gb ...)")
        mfu = DEFAULT_MFU if mfu is None else mfu
        t = estimate_time(fpt * tokens, gpus, hw.peak_flops, mfu) if tokens else None
    mfu = DEFAULT_MFU if mfu is None else mfu
    return Plan(name=name, model=model, counts=counts, tokens=tokens and float(tokens), seq_len=seq_len,
                micro_batch=micro_batch, grad_accum=grad_accum, recipe=recipe, optimizer=optimizer,
                checkpointing=checkpointing, zero=zero, tp=tp, pp=pp, gpus=gpus, hardware=hw, mfu=mfu,
                causal_halving=causal_halving, forward=fwd, model_flops_per_token=model_fpt, flops_per_token=fpt,
                convention=convention, states=states, activations_bytes=acts, memory_budget=memory_budget,
                time=t, price=price, notes=notes, compiled=compiled, step=step, time_source=source, layout=layout,
                cluster=cluster, peak_rank=peak_rank, run=run)


