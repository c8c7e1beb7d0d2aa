"""Measure this machine's peak: dense matmul FLOP/s per dtype and memory bandwidth.

MFU on a CPU is only meaningful against what this CPU can really do, so trainwise measures it (once,
then caches it) instead of guessing from a spec sheet. The matmul peak is the best of a few square
sizes; bandwidth is a large tensor copy (bytes read + bytes written per second).

A peak measured while other work holds the CPU is too low (seen: bf16 238 instead of 444 GFLOP/s), and
every MFU computed from it then reads too high. So the CPU time the matmul threads got is measured too:
a quiet 2-core machine gives them 99-100% of the wall time, a busy one ~50%. Below BUSY_SHARE the
result says so (busy_note), wherever it is printed.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from trainwise.train.precision import DTYPES

BUSY_SHARE = 0.8  # the matmul threads' share of wall time below which the CPU was busy with other work
RETRY_BUSY_S = 3600  # a busy measurement is measured again after this long


def cache_root() -> Path:
    return Path(os.environ.get("TRAINWISE_CACHE", Path.home() / ".cache" / "trainwise"))


def machine_key(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_model()
    return f"{device.type}|{name}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, size: int, seconds: float = 0.4) -> tuple[float, float]:
    """(FLOP/s, CPU share) of (size x size) @ (size x size), 2 * size^3 FLOPs each, best of repeated
    timings. CPU share = process CPU time / (wall time x torch threads) over the timings: ~1 when the
    threads had the cores to themselves (meaningless on CUDA, where the GPU does the work)."""
    # A private generator: measuring must not move the global RNG a training run depends on.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen).to(dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype)
    a @ b  # warm-up: kernel selection, page faults
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    best, deadline = 0.0, wall + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    share = (time.process_time() - cpu) / ((time.perf_counter() - wall) * torch.get_num_threads())
    return best, share


def bandwidth_bytes_per_s(device: torch.device, n_bytes: int = 256 << 20, seconds: float = 0.4) -> float:
    """Bytes moved per second by a tensor copy: each copy reads and writes n_bytes."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = max(best, 2 * n_bytes / (time.perf_counter() - start))
    return best


def calibrate(device: torch.device | str = "cpu", refresh: bool = False) -> dict:
    """Return (and cache) {"peak_flops": {dtype: FLOP/s}, "bandwidth_bytes_per_s": B/s, ...}; on a CPU
    also "cpu_share" and, below BUSY_SHARE, "busy": True. A busy measurement is cached (so that a
    machine that is never quiet does not pay ~2 s every run) but measured again after RETRY_BUSY_S, and
    it never replaces a quiet one."""
    device = torch.device(device)
    path = cache_root() / "calibration.json"
    key = machine_key(device)
    cached = _read(path)
    old = cached.get(key)
    if old and not refresh and not (old.get("busy") and time.time() - old.get("measured_unix", 0) > RETRY_BUSY_S):
        return old
    sizes = (1024, 2048) if device.type == "cpu" else (4096, 8192)
    dtypes = ["fp32", "bf16"] + (["fp16"] if device.type == "cuda" else [])
    timings = {name: [matmul_flops_per_s(device, DTYPES[name], n) for n in sizes] for name in dtypes}
    result = {
        "machine": key,
        "peak_flops": {name: max(rate for rate, _ in runs) for name, runs in timings.items()},
        "bandwidth_bytes_per_s": bandwidth_bytes_per_s(device),
        "method": f"best dense matmul of square sizes {sizes}; bandwidth from a 256 MiB copy",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "measured_unix": time.time(),
    }
    if device.type == "cpu":
        result["cpu_share"] = min(share for runs in timings.values() for _, share in runs)
        if result["cpu_share"] < BUSY_SHARE:
            result["busy"] = True
            if old and not old.get("busy"):
                return result  # the quiet measurement stays in the cache
    cached[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home still gets a measured peak, just not a cached one
    return result


def busy_note(result: dict) -> str:
    """'' for a trustworthy measurement; else a sentence saying why the peak is too low and what to do."""
    if not result.get("busy"):
        return ""
    return (f"measured while other work held the CPU (its matmul threads got {result['cpu_share']:.0%} of the "
            f"wall time), so this peak is too low and MFU reads too high: run `trainwise hardware --calibrate` "
            f"on a quiet machine (a run an hour later measures again on its own)")


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
