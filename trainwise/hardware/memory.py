"""The memory a device has free now, for the trainer's memory check and `plan --fit` on this machine.

On CUDA, the free bytes of the GPU (torch.cuda.mem_get_info); on a CPU, MemAvailable of /proc/meminfo,
or what the cgroup (memory.max - memory.current) leaves if less, shared by the ranks torchrun started on
this host. TRAINWISE_AVAILABLE_MEMORY (bytes, or e.g. 2GiB) replaces the measured figure: to test the
check, or to keep room for other work.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainwise.errors import TrainwiseError
from trainwise.units import parse_bytes

ENV = "TRAINWISE_AVAILABLE_MEMORY"


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
        return parse_bytes(os.environ[ENV]), f"{ENV}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory of {torch.cuda.get_device_name(device)} (torch.cuda.mem_get_info)"
    total, source = cpu_available_bytes()
    if local_ranks > 1:
        return total // local_ranks, f"{source}, shared by {local_ranks} ranks on this host"
    return total, source
