"""The plan guards the run: before step 1, the planned peak is held against the memory the device has.

A run that will not fit stops here, before the run directory exists, with settings that do fit (from
the same search as `trainwise plan --fit`), instead of being killed by the kernel's OOM killer halfway
(train.memory_check = on; warn prints the same text and trains; off skips the check). The memory
available is trainwise.hardware.memory's (TRAINWISE_AVAILABLE_MEMORY replaces it).
"""

from __future__ import annotations

import os

import torch

from trainwise.config import RunConfig
from trainwise.cost import memory as M
from trainwise.cost.comm import strategy_for
from trainwise.cost.rank_memory import rank_peak_bytes
from trainwise.errors import TrainwiseError
from trainwise.hardware.memory import available_bytes
from trainwise.planner.fit import fit
from trainwise.planner.plan import train_settings
from trainwise.runtime import distributed
from trainwise.runtime.parallelize import resolve_compile
from trainwise.units import fmt_bytes


def planned_peak(cfg: RunConfig, precision: str, strategy: str, world_size: int) -> int:
    """The plan's peak bytes of one training step on one rank (cost.memory.rank_peak_bytes)."""
    s = train_settings(cfg.train, precision)
    compiled, _ = resolve_compile(cfg.train.compile, cfg.model, cfg.train.max_steps, strategy)
    return M.rank_peak_bytes(cfg.model, M.get_recipe(s["precision"]), s["optimizer"], strategy, world_size,
                             s["micro_batch"], s["seq_len"], s["grad_accum"], s["checkpointing"], compiled=compiled)


def proposal(cfg: RunConfig, precision: str, world_size: int, budget: int) -> str | None:
    """The fastest settings of `plan --fit` (same global batch) whose planned peak fits `budget`, as
    `--set` arguments; None if nothing fits."""
    s = train_settings(cfg.train, precision)
    global_batch = s["micro_batch"] * s["grad_accum"] * world_size
    good, _ = fit(cfg.model, global_batch=global_batch, memory_budget=budget, seq_len=s["seq_len"],
                  precision=s["precision"], optimizer=s["optimizer"], gpus=world_size, peak_flops=1e12)
    for c in good:  # fit ranks by step time; the guard holds each against the peak, not states + activations
        strategy = strategy_for(c.zero, world_size)
        peak = M.rank_peak_bytes(cfg.model, M.get_recipe(s["precision"]), s["optimizer"], strategy, world_size,
                                 c.micro_batch, s["seq_len"], c.grad_accum, c.checkpointing)
        if peak <= budget:
            sets = [f"train.micro_batch={c.micro_batch}", f"train.grad_accum_steps={c.grad_accum}",
                    f"train.activation_checkpointing={c.checkpointing}"]
            if world_size > 1:
                sets.append(f"parallel.strategy={strategy}")
            return " ".join(f"--set {kv}" for kv in sets) + f" (planned peak {fmt_bytes(peak)})"
    return None


def check_memory(cfg: RunConfig, device: torch.device, precision: str, d, say) -> None:
    """Stop (memory_check = on) or warn before a run whose planned peak exceeds the available memory.
    Under torchrun every rank checks its own device and all ranks agree, so they stop together."""
    mode = cfg.train.memory_check
    if mode == "off":
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    available, source = available_bytes(device, local_ranks)
    if d.layout.model_parallel > 1:  # tensor / pipeline parallel: this rank's share (trainwise.cost.rank)
        st = train_settings(cfg.train, precision)
        peak = rank_peak_bytes(cfg.model, d.layout, d.rank, M.get_recipe(st["precision"]), st["optimizer"],
                               st["micro_batch"], st["seq_len"], st["grad_accum"], st["checkpointing"])
    else:
        peak = planned_peak(cfg, precision, d.strategy if d.active else "none", d.world_size)
    if not distributed.any_rank(peak > available, d):
        return
    t = cfg.train
    fix = proposal(cfg, precision, d.world_size, available)
    text = (f"the planned peak memory of one training step, {fmt_bytes(peak)} per "
            f"{'rank' if d.active else 'device'} (micro_batch {t.micro_batch} x grad_accum "
            f"{t.grad_accum_steps}, seq_len {t.seq_len}, checkpointing {t.activation_checkpointing}, {precision}), "
            f"exceeds the {fmt_bytes(available)} available ({source}); the run would be killed for lack of "
            "memory. " + (f"Settings with the same effective batch that fit: {fix}. " if fix else
                          "No micro-batch, checkpointing or ZeRO setting for this batch fits: use a smaller model "
                          "or shorter seq_len. ")
            + "Nothing was written. To train anyway set train.memory_check=warn (or off).")
    if mode == "warn":
        say("warning: " + text)
        return
    raise TrainwiseError(text)
