"""`trainwise plan --fit`: the micro-batch, accumulation, checkpointing and ZeRO stage that fit a memory
budget for a global batch, ranked by predicted step time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainwise.cost import flops as FL
from trainwise.cost.comm import strategy_for
from trainwise.cost.layout import Layout, make_layout
from trainwise.cost.ops import GATHERED
from trainwise.cost.params import params
from trainwise.cost.run import Machine, Run
from trainwise.cost.steptime import scale_batch
from trainwise.cost.time import DEFAULT_MFU
from trainwise.errors import TrainwiseError
from trainwise.planner.machine import Hardware, resolve_hardware
from trainwise.planner.plan import MAX_MICRO_BATCHES, check_micro_batches, plan_run, positive
from trainwise.planner.device_step import cached_step_ops, predict_step_time


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
    positive("--global-batch" if tokens is None else "--global-batch-tokens", sequences or tokens)
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


def fit_layout(gpus: int, tp: int = 1, pp: int = 1) -> Layout:
    """The layout --fit searches over: `gpus` devices split tp x pp, the rest data parallel."""
    if gpus % (tp * pp):
        raise TrainwiseError(f"--gpus {gpus} must be a multiple of --tp x --pp = {tp * pp}.")
    return make_layout(gpus, tp=tp, pp=pp)


def fit_run(run: Run, *, global_batch: int, memory_budget: int, mfu: float | None = None,
            causal_halving: bool = False, max_micro_batch: int = 1024) -> tuple[list[Candidate], list[Candidate]]:
    """Search micro_batch x checkpointing x ZeRO stage for a global batch of `global_batch` sequences of
    `run` (its model, seq_len, recipe, optimizer, machine and tp x pp layout; its batch, checkpointing and
    ZeRO stage are what is searched).

    Each candidate is the plan of one step (plan_run), so it fits exactly when `trainwise plan` with those
    settings says it fits: one memory model. grad_accum = global_batch / (micro_batch x dp) must be a
    whole number. Candidates that fit are ranked by predicted step time: on a profiled device (--gpu
    cpu, a table GPU) the step-time model prices each one (recompute, small matmuls, communication all
    cost time; one recorded step per checkpointing mode, scaled to each micro-batch); else step FLOPs
    including recompute / (G x peak x MFU); without hardware by step FLOPs, which ranks the same. Ties
    go to the lower ZeRO stage (less communication), then to fewer accumulation steps.
    Returns (fitting candidates best first, rejected candidates with the reason)."""
    positive("global batch", global_batch)
    model, seq_len, recipe, optimizer, lay = run.model, run.seq_len, run.recipe, run.optimizer, run.layout
    dp = lay.dp
    if global_batch % dp:
        raise TrainwiseError(f"global batch {global_batch} sequences does not split over {dp} data-parallel ranks.")
    per_rank = global_batch // dp
    micro_batches = [b for b in range(1, min(per_rank, max_micro_batch) + 1) if per_rank % b == 0]
    check_micro_batches(per_rank // micro_batches[-1])  # the fewest any candidate runs
    micro_batches = [b for b in micro_batches if per_rank // b <= MAX_MICRO_BATCHES]
    counts = params(model)
    hw, machine = None, None
    if run.machine is not None and (run.machine.gpu is not None or run.machine.peak_flops is not None):
        # resolved once (--gpu cpu reads the calibration); each candidate runs at its peak
        hw = resolve_hardware(run.machine.gpu, run.machine.peak_flops, None, None, recipe.compute_dtype)
        machine = Machine(peak_flops=hw.peak_flops)
    good, bad = [], []
    modelled = mfu is None and hw is not None and hw.profile is not None and lay.tp == lay.pp == 1
    mfu = DEFAULT_MFU if mfu is None else mfu
    for zero in (0, 1, 2, 3):
        if zero and dp == 1:
            continue  # nothing to shard over
        for ckpt in FL.RECOMPUTE:
            for b in micro_batches:
                k = per_rank // b
                p = plan_run(replace(run, micro_batch=b, grad_accum=k, checkpointing=ckpt,
                                     layout=replace(lay, zero=zero, micro_batches=k),
                                     tokens=global_batch * seq_len, machine=machine),
                             mfu=mfu, causal_halving=causal_halving, memory_budget=memory_budget)
                total, ok = p.per_device_bytes, bool(p.fits)
                reason = "" if ok else (f"needs {total / 2**30:.1f} GiB > budget {memory_budget / 2**30:.1f} GiB"
                                        + (" (the model states alone exceed it)" if p.states.total > memory_budget
                                           else ""))
                step_s = None if p.time is None else p.time.seconds
                if ok and modelled:
                    step_s = _modelled_step(model, hw, recipe, optimizer, ckpt, zero, dp, b, k, seq_len, counts.total)
                (good if ok else bad).append(Candidate(b, k, ckpt, zero, total, step_s, ok, reason,
                                                       p.total_flops, step_s and global_batch * seq_len / step_s))
    good.sort(key=lambda c: (c.step_seconds if c.step_seconds is not None else c.step_flops, c.zero, c.grad_accum))
    for c in good[3:]:
        bad.append(replace(c, reason=_why_worse(c, good[0])))
    return good, bad


def _modelled_step(model, hw: Hardware, recipe, optimizer: str, ckpt: str, zero: int, dp: int, micro_batch: int,
                   grad_accum: int, seq_len: int, n_params: int) -> float:
    """Step-time model of one --fit candidate, from the checkpointing mode's recorded micro-batch of 1."""
    precision = recipe.record_precision(strategy_for(zero, dp) in GATHERED)
    ops = scale_batch(cached_step_ops(model, 1, seq_len, precision, ckpt, False, optimizer, fixed=True), micro_batch,
                      seq_len)
    return predict_step_time(model, hw.profile, micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum,
                     compute_dtype=recipe.compute_dtype, checkpointing=ckpt, optimizer=optimizer, zero=zero, dp=dp,
                     n_params=n_params, grad_bytes=4 * n_params, param_bytes=4 * n_params, cuda=hw.cuda,
                     ops=ops, record=precision).seconds


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


