"""The plan guards the run: before step 1, the planned peak is held against the memory the device has.

A run that will not fit stops here, before the run directory exists, with settings that do fit (from
the same search as `trainwise plan --fit`), instead of being killed by the kernel's OOM killer halfway
(train.memory_check = on; warn prints the same text and trains; off skips the check). The memory
available is trainwise.hardware.memory's (TRAINWISE_AVAILABLE_MEMORY replaces it).
"""

from __future__ import annotations

import os

import torch

from dataclasses import replace

from trainwise.cost.comm import strategy_for
from trainwise.cost.layout import Layout, make_layout
from trainwise.cost.rank_memory import rank_peak
from trainwise.cost.run import Machine, Run
from trainwise.errors import TrainwiseError
from trainwise.hardware.memory import available_bytes
from trainwise.planner.fit import fit_layout, fit_run
from trainwise.runtime import distributed
from trainwise.units import fmt_bytes


def proposal(run: Run, budget: int) -> str | None:
    """The fastest settings of `plan --fit` (same global batch) whose planned peak fits `budget`, as
    `--set` arguments; None if nothing fits."""
    lay = run.layout
    global_batch = run.micro_batch * run.grad_accum * lay.dp
    searched = replace(run, micro_batch=1, grad_accum=1, checkpointing="none", compiled=False, tokens=None,
                       layout=fit_layout(lay.gpus), machine=Machine(peak_flops=1e12))
    good, _ = fit_run(searched, global_batch=global_batch, memory_budget=budget)
    for c in good:  # fit ranks by step time; the guard holds each against the peak, not states + activations
        strategy = strategy_for(c.zero, lay.gpus)
        layout = make_layout(lay.gpus, zero=c.zero) if lay.gpus > 1 else Layout()
        peak = rank_peak(replace(run, micro_batch=c.micro_batch, grad_accum=c.grad_accum,
                                 checkpointing=c.checkpointing, compiled=False, layout=layout)).peak
        if peak <= budget:
            sets = [f"train.micro_batch={c.micro_batch}", f"train.grad_accum_steps={c.grad_accum}",
                    f"train.activation_checkpointing={c.checkpointing}"]
            if lay.gpus > 1:
                sets.append(f"parallel.strategy={strategy}")
            return " ".join(f"--set {kv}" for kv in sets) + f" (planned peak {fmt_bytes(peak)})"
    return None


def check_memory(run: Run, mode: str, device: torch.device, precision: str, d, say) -> None:
    """Stop (`mode`, train.memory_check: on) or warn before a run whose planned peak on this rank exceeds
    the available memory. `run` is the trainer's description of the run (trainer.loop.train builds it once,
    on the layout distributed.init joined); `precision` the recipe it resolved (bf16, fp16 or fp32). Under
    torchrun every rank checks its own device and all ranks agree, so they stop together."""
    if mode == "off":
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    available, source = available_bytes(device, local_ranks)
    peak = rank_peak(run, d.rank if d.active else 0).peak
    if not distributed.any_rank(peak > available, d):
        return
    fix = proposal(run, available)
    text = (f"the planned peak memory of one training step, {fmt_bytes(peak)} per "
            f"{'rank' if d.active else 'device'} (micro_batch {run.micro_batch} x grad_accum "
            f"{run.grad_accum}, seq_len {run.seq_len}, checkpointing {run.checkpointing}, {precision}), "
            f"exceeds the {fmt_bytes(available)} available ({source}); the run would be killed for lack of "
            "memory. " + (f"Settings with the same effective batch that fit: {fix}. " if fix else
                          "No micro-batch, checkpointing or ZeRO setting for this batch fits: use a smaller model "
                          "or shorter seq_len. ")
            + "Nothing was written. To train anyway set train.memory_check=warn (or off).")
    if mode == "warn":
        say("warning: " + text)
        return
    raise TrainwiseError(text)
