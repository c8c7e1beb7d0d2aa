"""The plan guards the run: before step 1, the planned peak is held against the memory the device has.

A run that will not fit stops here, before the run directory exists, with settings that do fit (from
the same search as `trainwise plan --fit`), instead of being killed by the kernel's OOM killer halfway
(train.memory_check = on; warn prints the same text and trains; off skips the check).

Available memory: on CUDA, the free bytes of this rank's GPU (torch.cuda.mem_get_info); on a CPU,
MemAvailable of /proc/meminfo, or what the cgroup (memory.max - memory.current) leaves if less, shared
by the ranks torchrun started on this host. TRAINWISE_AVAILABLE_MEMORY (bytes, or e.g. 2GiB) replaces
the measured figure: to test the check, or to keep room for other work.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainwise.config import RunConfig
from trainwise.cost import memory as M
from trainwise.cost.plan import fit, fmt_bytes, train_settings
from trainwise.errors import TrainwiseError


ENV = "TRAINWISE_AVAILABLE_MEMORY"
STRATEGY_OF_ZERO = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}
ZERO_OF_STRATEGY = {"none": 0, "ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cpu_available_bytes() -> tuple[int, str]:
    """(bytes, where from): MemAvailable, or the cgroup v2 limit's headroom where that is smaller."""
    available, source = None, "MemAvailable in /proc/meminfo"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024  # the kernel's kB are KiB
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None and (available is None or limit - used < available):
        available, source = limit - used, "the cgroup's memory.max - memory.current"
    if available is None:
        raise TrainwiseError("cannot read the available memory of this machine (/proc/meminfo); set "
                             f"train.memory_check=off, or {ENV}=BYTES to give it.")
    return available, source


def available_bytes(device: torch.device, local_ranks: int = 1) -> tuple[int, str]:
    """(bytes one rank may use, where the figure comes from)."""
    if os.environ.get(ENV):
        return M.parse_bytes(os.environ[ENV]), f"{ENV}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory of {torch.cuda.get_device_name(device)} (torch.cuda.mem_get_info)"
    total, source = cpu_available_bytes()
    if local_ranks > 1:
        return total // local_ranks, f"{source}, shared by {local_ranks} ranks on this host"
    return total, source


def planned_peak(cfg: RunConfig, precision: str, strategy: str, world_size: int) -> int:
    """The plan's peak bytes of one training step on one rank (cost.memory.rank_peak_bytes)."""
    from trainwise.train.parallelize import resolve_compile

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
        strategy = STRATEGY_OF_ZERO[c.zero] if world_size > 1 else "none"
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
    from trainwise.train import distributed

    mode = cfg.train.memory_check
    if mode == "off":
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    available, source = available_bytes(device, local_ranks)
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
