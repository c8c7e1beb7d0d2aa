"""Measure this machine: its dense matmul peak per dtype, memory bandwidth, and the kernel profile the
step-time model predicts from (trainwise.measure.kernels).

MFU on a CPU is only meaningful against what this CPU can really do, so trainwise measures it (once,
then caches it) instead of guessing from a spec sheet. The peak is the 90% quantile of ~40 repeated square
matmuls large enough to keep every thread busy (2048-4096 on a CPU), in three rounds: at the start,
half-way and at the end of the calibration (PEAK_QUANTILE; how far calibrations in a row agree on each
CPU kind: benchmarks/RESULTS.md); bandwidth is a large tensor copy (bytes read + bytes written per
second).

A peak measured while other work holds the CPU is too low, and every MFU computed from it then reads
too high. So /proc/stat tells how much of the cores OTHER processes used during the peak timings
(independent of how many threads our own kernels use): a quiet machine reads ~0, one spinning process
per core ~50%. Above BUSY_OTHERS the result says so (busy_note), wherever it is printed.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainwise.files import write_json_atomic
from trainwise.hardware import cache
from trainwise.hardware.cache import PROFILE_VERSION, machine_key
from trainwise.hardware.profile import Profile
from trainwise.measure import kernels as K
from trainwise.measure.load import cpu_busy_jiffies, others_share
from trainwise.measure.reference import ReferenceSteps, reference_speed, strategy_links
from trainwise.runtime.allocator import keep_freed_memory
from trainwise.runtime.precision import DTYPES

BUSY_SHARE = 0.8  # kept for callers: the matmul threads' share of wall time on a quiet machine
BUSY_OTHERS = 0.2  # share of the cores other processes used during the peak timings above which it was busy
QUIET_CHECK_S = 0.3  # how long a stale calibration's user watches /proc/stat before measuring again
RECHECK_S = 300.0  # a machine found busy is not watched again in this process for this long
_found_busy: dict[str, float] = {}  # machine key -> when a quiet check last found it busy


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Square sizes per dtype that keep every thread busy: fp32 sustains its rate from 2048 on; bf16 on AMX tiles
# needs 2048-4096, where oneDNN runs a 1024 matmul on one thread only (benchmarks/RESULTS.md).
PEAK_SIZES = {"cpu": {"fp32": (2048,), "bf16": (2048, 3072, 4096)},
              "cuda": {"fp32": (4096, 8192), "bf16": (4096, 8192), "fp16": (4096, 8192)}}


def peak_sizes(kind: str, dtype: str) -> tuple[int, ...]:
    """PEAK_SIZES, where one CPU thread takes only the first: the larger sizes are there to keep many
    threads busy, and one thread runs at its rate from the first on (a torchrun rank's calibration on
    2048 and 4096 alike, and in a third of the time: benchmarks/RESULTS.md)."""
    sizes = PEAK_SIZES[kind][dtype]
    return sizes[:1] if kind == "cpu" and torch.get_num_threads() == 1 else sizes


def matmul_rates(device: torch.device, dtype: torch.dtype, size: int, seconds: float = 0.25,
                 min_reps: int = 3) -> tuple[list[float], float]:
    """(FLOP/s of each repetition, CPU share) of (size x size) @ (size x size), 2 * size^3 FLOPs each,
    repeated for `seconds` after a warm-up. CPU share = process CPU time / (wall x torch threads)."""
    # A private generator: measuring must not move the global RNG a training run depends on.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen).to(dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype)
    for _ in range(2):  # warm-up: kernel selection, page faults, AMX tile set-up
        a @ b
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    rates, deadline = [], wall + seconds
    while len(rates) < min_reps or time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        _sync(device)
        rates.append(2 * size**3 / (time.perf_counter() - start))
    share = (time.process_time() - cpu) / ((time.perf_counter() - wall) * torch.get_num_threads())
    return rates, share


# The peak is an upper quantile of every timed repetition, over rounds spread across the calibration:
# a VM's speed can drift by 20-30% over seconds (benchmarks/RESULTS.md), and interference only ever
# slows a matmul down, so the fast end is what the device does
# and the part of the distribution that stays put from one calibration to the next.
PEAK_QUANTILE = 0.9


def peak_round(device: torch.device) -> dict:
    """One round of peak timings: {"rates": {dtype: [FLOP/s of every repetition, all sizes]}, "sizes": {dtype:
    [the square sizes timed]}, "share": our threads' lowest CPU share, "others": other processes' share of the
    cores meanwhile (or None)}."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    dtypes = ["fp32", "bf16"] + (["fp16"] if kind == "cuda" else [])
    wall, before = time.perf_counter(), cpu_busy_jiffies()
    rates, sizes, shares = {}, {}, []
    for name in dtypes:
        rates[name], sizes[name] = [], []
        for n in peak_sizes(kind, name):
            seconds = 0.2 if name == "fp32" else 0.15
            r, share = matmul_rates(device, DTYPES[name], n, seconds)
            rates[name] += r
            sizes[name].append(n)
            shares.append(share)
            # The larger sizes keep fast matrix units busy. A multiply that alone outlasts the round's
            # time runs at the dtype's rate already, and a larger one only takes longer (bf16 on a CPU without
            # bf16 instructions: benchmarks/RESULTS.md).
            if 2 * n**3 / max(r) > seconds:
                break
    return {"rates": rates, "sizes": sizes, "share": min(shares),
            "others": others_share(before, cpu_busy_jiffies(), time.perf_counter() - wall)}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bandwidth_bytes_per_s(device: torch.device, n_bytes: int = 256 << 20, seconds: float = 0.4) -> float:
    """Bytes moved per second by a tensor copy (median timing): each copy reads and writes n_bytes."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times, deadline = [], time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < deadline:
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n_bytes / statistics.median(times)


def device_profile(device: torch.device, bandwidth: float | None = None, peak_rounds: list | None = None) -> dict:
    """The step-time model's description of this device (trainwise.measure.kernels), as JSON. The
    reference steps are sampled after every part (the machine's state drifts over seconds: their
    fastest sample is what in_step is fitted on), and a round of peak timings is added to peak_rounds
    half-way through."""
    dtypes = {name: DTYPES[name] for name in ("fp32", "bf16")}
    took, clock = {}, time.perf_counter()
    refs = ReferenceSteps(device)  # real steps, sampled between the other parts
    refs.sample()
    probes = [reference_speed(device)]  # the speed probe's own reading, at the start, middle and end

    def lap(part: str) -> None:  # seconds each part took (the whole must stay under a minute on a small CPU)
        nonlocal clock
        took[part] = took.get(part, 0.0) + time.perf_counter() - clock
        refs.sample()
        clock = time.perf_counter()

    def per_dtype(part: str, measure) -> dict:
        out = {}
        for name, dt in dtypes.items():
            out[name] = measure(dt, device)
            lap(part)
        return out

    grids = per_dtype("matmul", K.matmul_grid)
    # large matmuls: compute-bound at the best throughput of the grid (as the peak: the fast end is what
    # repeats); their operands stream at least once at the copy bandwidth
    bandwidth = bandwidth or bandwidth_bytes_per_s(device)
    matmul = {name: [0.0, max(2.0 * m * k * n / t for m, k, n, t in grid), bandwidth] for name, grid in grids.items()}
    elementwise = per_dtype("elementwise", K.elementwise_grid)
    if peak_rounds is not None:
        peak_rounds.append(peak_round(device))
        lap("peak")
    probes.append(reference_speed(device))
    lap("probe")
    attention = per_dtype("attention", K.attention_fits)
    optimizer = K.optimizer_fit(device)
    lap("optimizer")
    partial = Profile(matmul=matmul, elementwise=elementwise, attention=attention, optimizer=optimizer,
                      overhead=[0.0, 0.0], source="calibrated")
    steps = refs.fit(partial.on_device(device.type, machine_key(device), torch.get_num_threads()))
    took["steps"] = time.perf_counter() - clock
    clock = time.perf_counter()
    probes.append(reference_speed(device))
    took["probe"] += time.perf_counter() - clock
    return {"matmul": matmul, "matmul_grid": grids, "elementwise": elementwise, "attention": attention,
            "optimizer": optimizer, "overhead": steps["overhead"], "in_step": steps["in_step"],
            "in_step_by": steps["in_step_by"],
            "reference_steps": steps["rows"], "reference_fastest_s": steps["fastest"],
            # the speed probe's own reading at calibration (the same protocol as every later probe: a
            # fastest over many samples is faster than one over a probe's few, so only like compares),
            # each reference's median of three readings spread over the calibration: a VM switches
            # between a fast and a slow state for seconds at a time (ReferenceSteps), one ~1 s reading
            # lands in either. The fastest of the three would be a baseline later probes, one reading each,
            # rarely reach, while a run reads its probes by a 15% band (cost.steptime.probed_seconds)
            "probe_baseline_s": [statistics.median(t) for t in zip(*probes)], "probe_readings_s": probes,
            "reference_samples": len(refs.times), "source": "calibrated",
            "seconds": took, "version": PROFILE_VERSION}


def measure_peak(device: torch.device, rounds: list[dict] | None = None, bandwidth: float | None = None) -> dict:
    """{"peak_flops", "bandwidth_bytes_per_s", "method", "measured_at", "measured_unix"}; on a CPU also
    "cpu_share", "others_share" and "busy": True when other processes held more than BUSY_OTHERS of the
    cores while the peak was timed (without /proc: when our threads got under BUSY_SHARE of the wall).
    The peak is the PEAK_QUANTILE of every repetition of `rounds` (peak_round; default: one round now)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    rounds = rounds or [peak_round(device)]
    result = {
        "peak_flops": {name: _quantile([r for rd in rounds for r in rd["rates"][name]], PEAK_QUANTILE)
                       for name in rounds[0]["rates"]},
        "bandwidth_bytes_per_s": bandwidth or bandwidth_bytes_per_s(device),
        "method": f"{PEAK_QUANTILE:.0%} quantile of repeated dense matmuls of square sizes "
                  f"{rounds[0]['sizes']} in "
                  f"{len(rounds)} rounds; bandwidth from a 256 MiB copy; profile: trainwise.measure.kernels",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "measured_unix": time.time(),
    }
    if kind == "cpu":
        result["cpu_share"] = min(rd["share"] for rd in rounds)
        others = [rd["others"] for rd in rounds if rd["others"] is not None]
        if others:
            result["others_share"] = max(others)
        if (result["others_share"] > BUSY_OTHERS) if others else result["cpu_share"] < BUSY_SHARE:
            result["busy"] = True
    return result


def calibrate(device: torch.device | str = "cpu", refresh: bool = False, threads: int | None = None) -> dict:
    """_calibrate with torch set to `threads` threads (e.g. 1 for each of 2 torchrun ranks on 2 cores,
    which torchrun starts with OMP_NUM_THREADS=1); the thread count is part of the cache key."""
    if threads is None or threads == torch.get_num_threads():
        return _calibrate(device, refresh)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _calibrate(device, refresh)
    finally:
        torch.set_num_threads(before)


def quiet_now(seconds: float = QUIET_CHECK_S) -> bool:
    """Other processes keep at most BUSY_OTHERS of the cores busy over the next `seconds` (True off Linux)."""
    before, start = cpu_busy_jiffies(), time.perf_counter()
    time.sleep(seconds)
    share = others_share(before, cpu_busy_jiffies(), time.perf_counter() - start)
    return share is None or share <= BUSY_OTHERS


def _measure_again(key: str, entry: dict) -> bool:
    """A stale calibration (busy, or over a day old: hardware.cache.stale) is measured again once the
    machine is quiet; until then it serves, and says so wherever it is used (cache.calibration_note)."""
    if not cache.stale(entry) or time.time() - _found_busy.get(key, -RECHECK_S) < RECHECK_S:
        return False
    if quiet_now():
        return True
    _found_busy[key] = time.time()
    return False


def _calibrate(device: torch.device | str = "cpu", refresh: bool = False) -> dict:
    """Return (and cache) {"peak_flops": {dtype: FLOP/s}, "bandwidth_bytes_per_s": B/s, "profile": {...}};
    on a CPU also "others_share" (the cores other processes used meanwhile) and, above BUSY_OTHERS,
    "busy": True. A busy measurement is cached (so that a machine that is never quiet does not pay the
    measurement every run), measured again as soon as the machine is quiet, and it never replaces a quiet
    one; so is one over a day old. An entry of an older trainwise (no "profile") is measured again."""
    device = torch.device(device)
    path = cache.calibration_path()
    key = machine_key(device)
    cached = cache.read_json(path)
    old = cached.get(key)
    if old and old.get("profile", {}).get("version") != PROFILE_VERSION:  # an older trainwise's: measure again
        old = None
    if old and not refresh and not _measure_again(key, old):
        return old
    with cache.file_lock(path):
        fresh = cache.read_json(path).get(key)  # another process (a torchrun rank) may have measured meanwhile
        if fresh and fresh.get("profile", {}).get("version") == PROFILE_VERSION \
                and fresh.get("measured_unix", 0) > (old or {}).get("measured_unix", 0) \
                and not refresh:
            return fresh
        return _measure_and_cache(device, path, key, old)


def _measure_and_cache(device: torch.device, path: Path, key: str, old: dict | None) -> dict:
    # The measurements draw random tensors: a run that calibrates between seeding and its first step
    # must draw the same dropout masks as one that found the calibration cached (exact resume).
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _measure_and_cache_unseeded(device, path, key, old)


def _measure_and_cache_unseeded(device: torch.device, path: Path, key: str, old: dict | None) -> dict:
    keep_freed_memory()  # measure under the allocator the trainer runs with
    began = time.perf_counter()
    first = peak_round(device)
    result = {"machine": key, **measure_peak(device, [first])}
    if result.get("busy") and old and not old.get("busy"):
        # the quiet measurement stays in the cache, and its profile serves (a busy one is too slow)
        return {**result, "profile": old["profile"], "profile_from": old["measured_at"]}
    cache.drop_kernel_table(key)  # the profile and the kernels it is fitted with: one state of the machine
    rounds = [first]  # peak timings at the start, half-way and at the end: the peak spans the drift
    profile = device_profile(device, result["bandwidth_bytes_per_s"], rounds)
    rounds.append(peak_round(device))
    result = {"machine": key, **measure_peak(device, rounds, result["bandwidth_bytes_per_s"]), "profile": profile}
    result["calibration_s"] = time.perf_counter() - began
    cached = cache.read_json(path)
    cached[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, cached)
    except OSError:
        pass  # a read-only home still gets a measured peak, just not a cached one
    return result


def calibrate_link() -> dict:
    """Under torchrun (every rank calls it, process group initialised): measure the collectives
    (kernels.collective_fit) and, over gloo, each data-parallel strategy's communication as a training
    step runs it (reference.strategy_links), and cache them; rank 0 writes. `trainwise hardware --calibrate`
    under torchrun does this, and so does a CPU run under torchrun that finds none cached."""
    result = {**K.collective_fit(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if result["backend"] == "gloo":
        result["strategies"] = strategy_links()
    if result["rank"] == 0:
        cache.update_json(cache.calibration_path(),
                          lambda entries: entries.update({cache.link_key(result["backend"], result["world"]): result}))
    dist.barrier()
    return result


