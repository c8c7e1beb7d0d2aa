"""The Plan: parameters, FLOPs, memory and time of one training run, its JSON (DESIGN.md) and its
worked derivation (`explain`); and the `--fit` search over micro-batch, grad-accum, checkpointing and ZeRO.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from trainwise.config import ModelConfig, RunConfig, TrainConfig
from trainwise.cost import flops as F
from trainwise.cost import memory as M
from trainwise.cost.hardware import Accelerator, get_accelerator
from trainwise.cost.params import ParamCount, params
from trainwise.cost.steptime import Profile, StepTime, plan_step, table_profile
from trainwise.cost.time import DEFAULT_MFU, TimeEstimate, cost_usd, estimate_time
from trainwise.errors import TrainwiseError


@dataclass
class Hardware:
    name: str
    peak_flops: float
    bandwidth_bytes_per_s: float | None = None
    memory_bytes: int | None = None
    profile: Profile | None = None  # what the step-time model prices operators with (cost.steptime)
    cuda: bool = False  # a GPU: CUDA kernels, communication overlapped with backward


def resolve_hardware(gpu: str | None, peak_flops: float | None, bandwidth: float | None, memory: int | None,
                     dtype: str, threads: int | None = None) -> Hardware:
    """--gpu NAME from the table, overridden by --peak-flops/--bandwidth/--memory where given. `cpu` is
    this machine as calibrated (with `threads` torch threads, e.g. per torchrun rank); a table GPU gets
    the step-time model's default efficiencies (uncalibrated). A given --peak-flops drops the profile:
    time then comes from the assumed MFU."""
    if gpu and gpu.lower() == "cpu":  # this machine, as `trainwise hardware --calibrate` measured it
        from trainwise.measure.calibrate import calibrate

        measured = calibrate("cpu", threads=threads)
        peak = measured["peak_flops"].get(dtype, measured["peak_flops"]["fp32"])
        busy = " while busy: too low, see `trainwise hardware --calibrate`" if measured.get("busy") else ""
        hw = Hardware(f"this CPU (measured{busy})", peak, measured["bandwidth_bytes_per_s"], None,
                      Profile.from_json(measured["profile"]).on_device("cpu", measured["machine"], threads))
        _use_measured_link(hw.profile, "gloo", threads and (os.cpu_count() or 1) // threads)
    elif gpu and gpu.lower() == "cuda":  # this machine's GPU: its calibration if cached, else its table entry
        import torch

        from trainwise.cost.hardware import lookup_cuda_device
        from trainwise.measure.calibrate import cached

        name, entry = torch.cuda.get_device_name(), cached("cuda")
        acc = lookup_cuda_device(name)
        peak = acc.peak(dtype) if acc else (entry or {}).get("peak_flops", {}).get(dtype, 0.0)
        profile = (Profile.from_json(entry["profile"]).on_device("cuda", entry["machine"], None) if entry else
                   table_profile(acc.peak_flops, acc.bandwidth_bytes_per_s) if acc and acc.bandwidth_bytes_per_s else None)
        hw = Hardware(name, peak, acc.bandwidth_bytes_per_s if acc else None, acc.memory_bytes if acc else None,
                      profile, cuda=True)
        _use_measured_link(profile, "nccl", torch.cuda.device_count())
    elif gpu:
        acc: Accelerator = get_accelerator(gpu)
        hw = Hardware(acc.name, acc.peak(dtype), acc.bandwidth_bytes_per_s, acc.memory_bytes,
                      table_profile(acc.peak_flops, acc.bandwidth_bytes_per_s) if acc.bandwidth_bytes_per_s else None,
                      cuda=True)
    elif peak_flops is not None:
        hw = Hardware("custom", peak_flops)
    else:
        raise TrainwiseError("give the hardware: --gpu NAME (see `trainwise hardware`), --gpu cpu (this machine's "
                             "measured peak) or --peak-flops P (FLOP/s).")
    if peak_flops is not None:
        hw.peak_flops, hw.profile = float(peak_flops), None
    if bandwidth:
        hw.bandwidth_bytes_per_s = float(bandwidth)
    if memory:
        hw.memory_bytes = int(memory)
    if hw.peak_flops <= 0:
        raise TrainwiseError("--peak-flops must be positive.")
    return hw


def _use_measured_link(profile: Profile | None, backend: str, world: int | None) -> None:
    """The collectives as `trainwise hardware --calibrate` measured them under torchrun, if it did."""
    from trainwise.measure.calibrate import cached_link

    if profile is not None and world and world > 1 and (link := cached_link(backend, world)):
        profile.link, profile.link_source = link, f"calibrated ({backend}, {world} ranks)"


@dataclass
class Plan:
    name: str
    model: ModelConfig | None
    counts: ParamCount
    tokens: float
    seq_len: int
    micro_batch: int
    grad_accum: int
    recipe: M.Recipe
    optimizer: str
    checkpointing: str
    zero: int
    tp: int
    pp: int
    gpus: int
    hardware: Hardware | None  # None: no --gpu/--peak-flops given; everything but time is known
    mfu: float
    causal_halving: bool
    forward: F.ForwardFlops | None
    model_flops_per_token: float  # fwd + bwd, no recompute (for MFU)
    flops_per_token: float  # + recompute (what the devices execute)
    convention: str
    states: M.StateBytes
    activations_bytes: int | None
    memory_budget: int | None
    time: TimeEstimate | None  # None without hardware
    price: float | None = None
    notes: list[str] = field(default_factory=list)
    compiled: bool = False  # torch.compile: what autograd saves changes (memory.compiled_block_bytes_per_token)
    step: StepTime | None = None  # the step-time model's prediction; None: time from the assumed MFU
    time_source: str = "assumed MFU (--mfu)"  # DESIGN.md: "calibrated" | "table defaults" | "assumed MFU (--mfu)"

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum * self.dp

    @property
    def step_seconds(self) -> float | None:
        """Predicted seconds of one optimizer step (all devices together); None without hardware."""
        if self.step is not None:
            return self.step.seconds
        if self.hardware is None:
            return None
        return self.flops_per_token * self.tokens_per_step / (self.gpus * self.hardware.peak_flops * self.mfu)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def total_flops(self) -> float:
        return self.flops_per_token * self.tokens

    @property
    def per_device_bytes(self) -> int:
        return self.states.total + (self.activations_bytes or 0)

    @property
    def peak_bytes(self) -> int | None:
        """Peak of one step (memory.peak_bytes): what `trainwise verify` compares with tracked memory."""
        if self.activations_bytes is None or self.model is None:
            return None
        return M.peak_bytes(self.model, self.states, self.activations_bytes, self.optimizer, self.micro_batch,
                            self.seq_len, self.grad_accum, self.tp, self.recipe, self.checkpointing,
                            compiled=self.compiled)

    @property
    def budget(self) -> int | None:
        return self.memory_budget or (self.hardware.memory_bytes if self.hardware else None)

    @property
    def fits(self) -> bool | None:
        if self.budget is None:
            return None
        if self.per_device_bytes > self.budget:
            return False
        return None if self.activations_bytes is None else True

    @property
    def cost(self) -> float | None:
        return None if self.price is None or self.time is None else cost_usd(self.time.device_hours, self.price)

    def to_json(self) -> dict[str, Any]:
        c, hw = self.counts, self.hardware
        return {
            "model": {"name": self.name, "params_total": c.total, "params_active": c.active,
                      "params_embedding": c.embedding, "params_non_embedding": c.non_embedding},
            "tokens": float(self.tokens),
            "flops": {"per_token_train": self.flops_per_token, "total": self.total_flops,
                      "convention": self.convention, "model_flops_per_token": self.model_flops_per_token,
                      "causal_halving": self.causal_halving},
            "memory": {"params_bytes": self.states.params, "grads_bytes": self.states.grads,
                       "optimizer_bytes": self.states.optimizer, "master_bytes": self.states.master,
                       "states_bytes": self.states.total, "activations_bytes": self.activations_bytes,
                       "total_bytes": self.per_device_bytes * self.gpus, "per_device_bytes": self.per_device_bytes,
                       "peak_bytes": self.peak_bytes,
                       "fits": self.fits, "budget_bytes": self.budget, "precision": self.recipe.name,
                       "optimizer": self.optimizer, "checkpointing": self.checkpointing, "zero": self.zero,
                       "compiled": self.compiled,
                       "scope": "per device except total_bytes (all devices)"},
            "time": self._time_json(),
            # name, peak and bandwidth are null without hardware
            "hardware": {"name": hw and hw.name, "peak_flops": hw and hw.peak_flops,
                         "bandwidth_bytes_per_s": hw and hw.bandwidth_bytes_per_s, "devices": self.gpus,
                         "mfu": self.mfu, "tp": self.tp, "pp": self.pp, "dp": self.dp},
            "run": {"seq_len": self.seq_len, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                    "global_batch_tokens": self.seq_len * self.micro_batch * self.grad_accum * self.dp},
        }

    def _time_json(self) -> dict[str, Any]:
        """Without hardware the keys stay, null, with a note saying what to give (JSON contract: same keys)."""
        if self.time is None:
            return {"seconds": None, "days": None, "device_hours": None, "step_seconds": None, "tokens_per_s": None,
                    "mfu": None, "source": self.time_source, "note": NO_HARDWARE}
        return {"seconds": self.time.seconds, "days": self.time.days, "device_hours": self.time.device_hours,
                "step_seconds": self.step_seconds, "tokens_per_s": self.tokens_per_step / self.step_seconds,
                "mfu": self.mfu, "source": self.time_source,
                **({"cost_usd": self.cost} if self.price is not None else {})}

    def explain(self) -> str:
        return explain_plan(self)


NO_HARDWARE = ("no hardware given, so no time: add --gpu NAME (see `trainwise hardware`), --gpu cpu (this "
               "machine, measured) or --peak-flops P (FLOP/s per device)")


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise TrainwiseError(f"{name} = {value} must be positive.")


def train_settings(train: TrainConfig, precision: str | None = None) -> dict:
    """The planner's view of a trainer's [train] section. The trainer's bf16/fp16 are autocast over fp32
    weights, which is the planner's "amp" recipe; SGD with momentum keeps one moment per parameter."""
    precision = precision or train.precision
    optimizer = train.optimizer if train.optimizer != "sgd" or train.momentum == 0 else "sgd-momentum"
    return dict(seq_len=train.seq_len, micro_batch=train.micro_batch, grad_accum=train.grad_accum_steps,
                precision="fp32" if precision == "fp32" else "amp", optimizer=optimizer,
                checkpointing=train.activation_checkpointing)


def plan_for_run(cfg: RunConfig, precision: str, peak_flops: float, device: str | None = None,
                 compiled: bool | None = None, world_size: int = 1) -> Plan:
    """The plan of a trainwise run as the trainer will execute it. device "cpu" (or "cuda"): this
    machine's calibration prices the step (a GPU without one: its table entry at default efficiencies),
    compiled or eager, per torchrun rank when world_size > 1; otherwise one device of `peak_flops` at
    the assumed MFU. compiled None: decided as the trainer decides (train.compile)."""
    from trainwise.train.parallelize import resolve_compile

    t = cfg.train
    if compiled is None:
        compiled, _ = resolve_compile(t.compile, cfg.model, t.max_steps, cfg.parallel.strategy)
    if device in ("cpu", "cuda"):
        zero = {"none": 0, "ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}[cfg.parallel.strategy if world_size > 1 else "none"]
        return plan_run(cfg.model, tokens=t.max_steps * t.tokens_per_step * world_size, gpu=device, gpus=world_size,
                        zero=zero, compiled=compiled, **train_settings(t, precision))
    tokens = t.max_steps * t.tokens_per_step
    return plan_run(cfg.model, tokens=tokens, peak_flops=peak_flops, mfu=DEFAULT_MFU, compiled=compiled,
                    **train_settings(t, precision))


def plan_run(model: ModelConfig | None = None, *, params_count: float | None = None, tokens: float,
             seq_len: int = 2048, micro_batch: int = 1, grad_accum: int = 1, precision: str = "bf16",
             optimizer: str = "adamw", checkpointing: str = "none", zero: int = 0, tp: int = 1, pp: int = 1,
             gpus: int = 1, gpu: str | None = None, peak_flops: float | None = None,
             bandwidth: float | None = None, memory: int | None = None, mfu: float | None = None,
             causal_halving: bool = False, memory_budget: int | None = None, price: float | None = None,
             compiled: bool = False) -> Plan:
    """Everything the planner knows about one run. Pass a ModelConfig, or only `params_count` (6ND rule).
    Time: with a model on a profiled device (--gpu cpu, a table GPU) and no `mfu`, the step-time model
    (cost.steptime); else total FLOPs / (G x peak x MFU), MFU = `mfu` or DEFAULT_MFU (a what-if)."""
    for name, value in (("--tokens", tokens), ("--seq-len", seq_len), ("--micro-batch", micro_batch),
                        ("--grad-accum", grad_accum), ("--tp", tp), ("--pp", pp), ("--gpus", gpus),
                        ("--params", params_count), ("--price", price)):
        _positive(name, value)
    if gpus % (tp * pp):
        raise TrainwiseError(f"--gpus {gpus} must be a multiple of --tp x --pp = {tp * pp}; data parallel = gpus / (tp x pp).")
    if model is None and params_count is None:
        raise TrainwiseError("give a model (--model PRESET|FILE) or a parameter count (--params N).")
    if checkpointing not in F.RECOMPUTE:
        raise TrainwiseError(f"--checkpointing '{checkpointing}' must be none, selective or full.")
    recipe = M.get_recipe(precision)
    has_hw = gpu is not None or peak_flops is not None
    threads = max(1, (os.cpu_count() or 1) // gpus) if gpu and gpu.lower() == "cpu" and gpus > 1 else None
    hw = resolve_hardware(gpu, peak_flops, bandwidth, memory, recipe.compute_dtype, threads) if has_hw else None
    if hw is None and memory:
        memory_budget = memory_budget or int(memory)  # --memory without a device: still the capacity to fit
    dp = gpus // (tp * pp)
    notes = []
    if model is not None:
        counts = params(model)
        if seq_len > model.max_seq_len:
            notes.append(f"seq_len {seq_len} > model.max_seq_len {model.max_seq_len}")
        fwd = F.forward_flops_per_token(model, seq_len, causal_halving)
        model_fpt = 3.0 * fwd.total
        fpt = model_fpt + F.recompute_flops_per_token(fwd, checkpointing, model)
        convention = "exact" if fpt == model_fpt else "exact+recompute"
        acts = M.activation_bytes(model, recipe, micro_batch, seq_len, checkpointing, tp, compiled)
        name = model.name
    else:
        n = int(params_count)
        counts = ParamCount(total=n, active=n, embedding=0, non_embedding=n)
        fwd, acts, name = None, None, f"{n:.3g} params"
        model_fpt = 6.0 * n
        fpt = model_fpt + (2.0 * n if checkpointing == "full" else 0.0)
        convention = "8ND" if checkpointing == "full" else "6ND"
        notes.append("activations unknown without a model config (--params only)")
    states = M.state_bytes(counts.total, recipe, optimizer, zero, dp, tp * pp)
    step, source, t = None, "assumed MFU (--mfu)", None
    if hw is None:
        source = "no hardware"
    elif mfu is None and model is not None and hw.profile is not None and tp == pp == 1:
        step = plan_step(model, hw.profile, micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum,
                         compute_dtype=recipe.compute_dtype, checkpointing=checkpointing, optimizer=optimizer,
                         zero=zero, dp=dp, n_params=counts.total, grad_bytes=4 * counts.total,
                         param_bytes=4 * counts.total, compiled=compiled, cuda=hw.cuda)
        source = hw.profile.source
        tokens_per_s = seq_len * micro_batch * grad_accum * dp / step.seconds
        mfu = model_fpt * tokens_per_s / (gpus * hw.peak_flops)
        t = TimeEstimate(tokens / tokens_per_s, gpus)
    else:
        if mfu is None and model is not None and hw.profile is not None:
            notes.append("tensor/pipeline parallel steps are not modelled per operator: time from the assumed MFU")
        mfu = DEFAULT_MFU if mfu is None else mfu
        t = estimate_time(fpt * tokens, gpus, hw.peak_flops, mfu)
    mfu = DEFAULT_MFU if mfu is None else mfu
    return Plan(name=name, model=model, counts=counts, tokens=float(tokens), seq_len=seq_len,
                micro_batch=micro_batch, grad_accum=grad_accum, recipe=recipe, optimizer=optimizer,
                checkpointing=checkpointing, zero=zero, tp=tp, pp=pp, gpus=gpus, hardware=hw, mfu=mfu,
                causal_halving=causal_halving, forward=fwd, model_flops_per_token=model_fpt, flops_per_token=fpt,
                convention=convention, states=states, activations_bytes=acts, memory_budget=memory_budget,
                time=t, price=price, notes=notes, compiled=compiled, step=step, time_source=source)


# ---------------------------------------------------------------------------------------------------
# --fit


@dataclass(frozen=True)
class Candidate:
    micro_batch: int
    grad_accum: int
    checkpointing: str
    zero: int
    per_device_bytes: int
    step_seconds: float | None  # None without hardware
    fits: bool
    reason: str = ""
    step_flops: float = 0.0  # per step, all devices, recompute included
    tokens_per_s: float | None = None  # predicted; None without hardware


def global_batch_sequences(seq_len: int, dp: int = 1, *, sequences: int | None = None,
                           tokens: float | None = None) -> tuple[int, str | None]:
    """A global batch in whole sequences that split evenly over the dp data-parallel ranks: the requested
    sequences or tokens rounded to the nearest multiple of dp sequences (at least dp), and a note saying so
    when it had to round. 4e6 tokens at seq_len 8192 -> 488 sequences = 3,997,696 tokens (-0.06%)."""
    if (sequences is None) == (tokens is None):
        raise TrainwiseError("give the global batch once: --global-batch SEQUENCES or --global-batch-tokens TOKENS.")
    _positive("--global-batch" if tokens is None else "--global-batch-tokens", sequences or tokens)
    wanted = sequences if tokens is None else tokens / seq_len
    rounded = max(dp, dp * int(wanted / dp + 0.5))  # half up, not Python's half-to-even
    if rounded == wanted:
        return rounded, None
    asked = f"{sequences:,} sequences" if tokens is None else f"{tokens:,.0f} tokens"
    why = f"seq_len {seq_len}" + (f" x {dp} data-parallel ranks" if dp > 1 else "")
    got = rounded * seq_len
    change = got / (wanted * seq_len) - 1
    return rounded, (f"the global batch of {asked} is not a whole number of sequences of {why}; rounded to "
                     f"{rounded:,} sequences = {got:,} tokens ({change:+.2%})")


def fit(model: ModelConfig, *, global_batch: int, memory_budget: int, seq_len: int, precision: str = "bf16",
        optimizer: str = "adamw", tp: int = 1, pp: int = 1, gpus: int = 1, gpu: str | None = None,
        peak_flops: float | None = None, mfu: float | None = None, causal_halving: bool = False,
        max_micro_batch: int = 1024) -> tuple[list[Candidate], list[Candidate]]:
    """Search micro_batch x checkpointing x ZeRO stage for a global batch of `global_batch` sequences.

    Each candidate is the plan of one step (plan_run), so it fits exactly when `trainwise plan` with those
    settings says it fits: one memory model. grad_accum = global_batch / (micro_batch x dp) must be a
    whole number. Candidates that fit are ranked by predicted step time: on a profiled device (--gpu
    cpu, a table GPU) the step-time model prices each one (recompute, small matmuls, communication all
    cost time; one recorded step per checkpointing mode, scaled to each micro-batch); else step FLOPs
    including recompute / (G x peak x MFU); without hardware by step FLOPs, which ranks the same. Ties
    go to the lower ZeRO stage (less communication), then to fewer accumulation steps.
    Returns (fitting candidates best first, rejected candidates with the reason)."""
    _positive("global batch", global_batch)
    dp = gpus // (tp * pp) if gpus % (tp * pp) == 0 else 0
    if dp == 0:
        raise TrainwiseError(f"--gpus {gpus} must be a multiple of --tp x --pp = {tp * pp}.")
    if global_batch % dp:
        raise TrainwiseError(f"global batch {global_batch} sequences does not split over {dp} data-parallel ranks.")
    per_rank = global_batch // dp
    micro_batches = [b for b in range(1, min(per_rank, max_micro_batch) + 1) if per_rank % b == 0]
    recipe, counts = M.get_recipe(precision), params(model)
    hw = None
    if gpu is not None or peak_flops is not None:  # resolved once (--gpu cpu reads the calibration)
        hw = resolve_hardware(gpu, peak_flops, None, None, recipe.compute_dtype)
        peak_flops = hw.peak_flops
    good, bad = [], []
    modelled = mfu is None and hw is not None and hw.profile is not None and tp == pp == 1
    mfu = DEFAULT_MFU if mfu is None else mfu
    for zero in (0, 1, 2, 3):
        if zero and dp == 1:
            continue  # nothing to shard over
        for ckpt in F.RECOMPUTE:
            for b in micro_batches:
                p = plan_run(model, tokens=global_batch * seq_len, seq_len=seq_len, micro_batch=b,
                             grad_accum=per_rank // b, precision=precision, optimizer=optimizer, checkpointing=ckpt,
                             zero=zero, tp=tp, pp=pp, gpus=gpus, peak_flops=peak_flops, mfu=mfu,
                             causal_halving=causal_halving, memory_budget=memory_budget)
                total, ok = p.per_device_bytes, bool(p.fits)
                reason = "" if ok else (f"needs {total / 2**30:.1f} GiB > budget {memory_budget / 2**30:.1f} GiB"
                                        + (" (the model states alone exceed it)" if p.states.total > memory_budget
                                           else ""))
                step_s = None if p.time is None else p.time.seconds
                if ok and modelled:
                    step_s = _modelled_step(model, hw, recipe, optimizer, ckpt, zero, dp, b, per_rank // b, seq_len,
                                            counts.total)
                (good if ok else bad).append(Candidate(b, per_rank // b, ckpt, zero, total, step_s, ok, reason,
                                                       p.total_flops, step_s and global_batch * seq_len / step_s))
    good.sort(key=lambda c: (c.step_seconds if c.step_seconds is not None else c.step_flops, c.zero, c.grad_accum))
    for c in good[3:]:
        bad.append(dataclasses.replace(c, reason=_why_worse(c, good[0])))
    return good, bad


def _modelled_step(model, hw: Hardware, recipe, optimizer: str, ckpt: str, zero: int, dp: int, micro_batch: int,
                   grad_accum: int, seq_len: int, n_params: int) -> float:
    """Step-time model of one --fit candidate, from the checkpointing mode's recorded micro-batch of 1."""
    from trainwise.cost.steptime import cached_step_ops, scale_batch

    precision = "fp32" if recipe.compute_dtype == "fp32" else recipe.compute_dtype
    ops = scale_batch(cached_step_ops(model, 1, seq_len, precision, ckpt, False, optimizer), micro_batch, seq_len)
    return plan_step(model, hw.profile, micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum,
                     compute_dtype=recipe.compute_dtype, checkpointing=ckpt, optimizer=optimizer, zero=zero, dp=dp,
                     n_params=n_params, grad_bytes=4 * n_params, param_bytes=4 * n_params, cuda=hw.cuda,
                     ops=ops).seconds


def _why_worse(c: Candidate, best: Candidate) -> str:
    if c.step_seconds is not None and best.step_seconds is not None:
        if c.step_seconds > best.step_seconds * (1 + 1e-9):
            why = (f"recompute ({c.checkpointing})" if c.checkpointing != best.checkpointing else
                   f"ZeRO-{c.zero} communication" if c.zero != best.zero else
                   f"micro-batch {c.micro_batch} x {c.grad_accum} accumulation steps")
            return f"fits, but {why}: predicted step {c.step_seconds / best.step_seconds - 1:.1%} slower"
    elif c.step_flops > best.step_flops * (1 + 1e-9):
        return f"fits, but recompute ({c.checkpointing}) makes the step {c.step_flops / best.step_flops - 1:.1%} slower"
    if c.zero > best.zero:
        return f"fits, same FLOPs, but ZeRO-{c.zero} communicates more than ZeRO-{best.zero}"
    return f"fits, same FLOPs, but {c.grad_accum} accumulation steps of micro-batch {c.micro_batch} use smaller matmuls"


# ---------------------------------------------------------------------------------------------------
# --explain: formula, numbers substituted, result


def fmt_bytes(n: float | None) -> str:
    """'16.00 GB (14.90 GiB)'; DESIGN.md: print MB/GB (10^k) and MiB/GiB (2^k)."""
    if n is None:
        return "unknown"
    for si, bi, unit in ((1e12, 2**40, "T"), (1e9, 2**30, "G"), (1e6, 2**20, "M"), (1e3, 2**10, "K")):
        if n >= si:
            return f"{n / si:,.2f} {unit}B ({n / bi:,.2f} {unit}iB)"
    return f"{n:,.0f} B"


def explain_plan(p: Plan) -> str:
    c, r, out = p.counts, p.recipe, []
    add = out.append
    add(f"Plan for {p.name}: {p.tokens:.4g} tokens, seq_len T={p.seq_len}, micro-batch B={p.micro_batch}, "
        f"grad-accum K={p.grad_accum}, {p.gpus} device(s) (tp={p.tp}, pp={p.pp}, dp={p.dp})")
    add("")
    add("1. Parameters")
    if p.model is not None:
        m = p.model
        add(f"   embedding = V*H{' + max_seq_len*H' if m.position == 'learned' else ''} = {c.embedding:,}")
        add(f"   total = embedding + L blocks + final norm + LM head{' (tied: 0)' if m.tie_embeddings else ''}"
            f" = {c.total:,}")
        if c.active != c.total:
            add(f"   active (top_k={m.top_k} of n_experts={m.n_experts} routed experts) = {c.active:,}")
    else:
        add(f"   N = {c.total:,} (given with --params)")
    add("")
    add("2. FLOPs (matmul (M,K)x(K,N) = 2MNK; backward = 2 x forward)")
    N, D = c.active, p.tokens
    if p.forward is not None:
        f = p.forward
        add(f"   forward per token: attention projections {f.attention_proj:.4g} + attention core "
            f"4*T*nh*hd*L = {f.attention_core:.4g}{' (halved, causal)' if p.causal_halving else ''}")
        add(f"                      + MLP {f.mlp:.4g} + router/experts {f.router_and_experts:.4g} "
            f"+ LM head 2HV = {f.lm_head:.4g} + embedding 0 = {f.total:.4g}")
        add(f"   train per token = 3 x forward = 3 x {f.total:.4g} = {p.model_flops_per_token:.4g}")
        if p.flops_per_token != p.model_flops_per_token:
            what = p.checkpointing if p.checkpointing != "none" else "chunked loss, LM head 2HV"
            add(f"   + recompute ({what}) = {p.flops_per_token - p.model_flops_per_token:.4g}"
                f" -> {p.flops_per_token:.4g}")
        add(f"   (6N rule for comparison: 6 x {N:,} = {6 * N:.4g})")
    else:
        add(f"   per token = 6N = 6 x {N:,} = {p.model_flops_per_token:.4g}"
            + (" (+2N recompute, full checkpointing)" if p.checkpointing == "full" else ""))
    add(f"   total C = per token x D = {p.flops_per_token:.4g} x {D:.4g} = {p.total_flops:.4g} FLOPs")
    add("")
    s = p.states
    mp = p.tp * p.pp
    add(f"3. Memory per device ({r.name}: {r.description}; optimizer {p.optimizer}; ZeRO-{p.zero} over dp={p.dp}"
        f"{'' if mp == 1 else f'; model split over tp*pp={mp}'})")
    add(f"   params     = N x {r.param_bytes} B{' / dp' if p.zero >= 3 else ''} = {fmt_bytes(s.params)}")
    add(f"   grads      = N x {r.grad_bytes} B{' / dp' if p.zero >= 2 else ''} = {fmt_bytes(s.grads)}")
    add(f"   optimizer  = N x {M.optimizer_moments(p.optimizer)} x {r.moment_bytes} B{' / dp' if p.zero >= 1 else ''}"
        f" = {fmt_bytes(s.optimizer)}")
    add(f"   master     = N x {r.master_bytes} B{' / dp' if p.zero >= 1 else ''} = {fmt_bytes(s.master)}")
    add(f"   states     = {fmt_bytes(s.total)}")
    add(f"   activations ({p.checkpointing} checkpointing, B x T = {p.micro_batch * p.seq_len:,} tokens, "
        f"incl. fp32 logits B*T*V) = {fmt_bytes(p.activations_bytes)}")
    add(f"   per device = {fmt_bytes(p.per_device_bytes)}; budget {fmt_bytes(p.budget)} -> fits: {p.fits}")
    add("")
    if p.time is None:
        add("4. Time")
        add(f"   {NO_HARDWARE}")
        out += [f"note: {n}" for n in p.notes]
        return "\n".join(out)
    if p.step is not None:
        from trainwise.cost.explain_time import explain_step

        add(explain_step(p))
    else:
        add("4. Time = C / (G x peak x MFU)   (assumed MFU: a what-if, not a prediction)")
        add(f"   = {p.total_flops:.4g} / ({p.gpus} x {p.hardware.peak_flops:.4g} x {p.mfu}) = {p.time.seconds:.4g} s"
            f" = {p.time.days:.2f} days = {p.time.device_hours:,.1f} device-hours")
    if p.price is not None:
        add(f"   cost = {p.time.device_hours:,.1f} device-hours x ${p.price}/h = ${p.cost:,.0f}")
    for n in p.notes:
        add(f"note: {n}")
    return "\n".join(out)
