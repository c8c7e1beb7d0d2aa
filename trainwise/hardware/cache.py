"""The calibration files: what trainwise measured about this machine, read and written here, timed
elsewhere (trainwise.measure.calibrate, trainwise.measure.kernels).

    $TRAINWISE_CACHE/calibration.json   {machine key: peak FLOP/s per dtype, bandwidth, profile (the
                                         step-time model's description of the device), ...;
                                         link keys: the collectives under torchrun}
    $TRAINWISE_CACHE/kernels.json       {machine key|vN: {kernel: seconds per call}}, matmul and
                                         attention calls timed at the shapes plans needed

A machine key names the device, the torch threads and the torch version: a figure measured under one
does not describe another. Writers take a file lock and rename a temporary file into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import time
from pathlib import Path

import torch

from trainwise.files import write_json_atomic

CALIBRATION = "calibration.json"
KERNELS = "kernels.json"
PROFILE_VERSION = 13  # the calibration's format: a cached calibration of another version is measured again


def cache_root(root: str | Path | None = None) -> Path:
    """The cache directory: `root` if given, else $TRAINWISE_CACHE, else ~/.cache/trainwise. It holds
    the calibration and kernel table (here) and the tokenized corpora (trainwise.data.corpus)."""
    if root is None:
        root = os.environ.get("TRAINWISE_CACHE") or Path.home() / ".cache" / "trainwise"
    return Path(root).expanduser()


def calibration_path() -> Path:
    return cache_root() / CALIBRATION


def kernels_path() -> Path:
    return cache_root() / KERNELS


def machine_key(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_model()
    return f"{device.type}|{name}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock beside `path` (PATH.lock) while the block runs: one calibration per machine at a
    time (concurrent ones, the ranks of a torchrun job starting together, would measure each other's
    load, and the waiting one then reads the result), one writer of a JSON file at a time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "w")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def update_json(path: Path, change) -> None:
    """Apply change(entries) to the JSON file under its lock (concurrent writers take turns) and write it
    back atomically; nothing happens on a read-only home."""
    try:
        with file_lock(path):
            entries = read_json(path)
            change(entries)
            write_json_atomic(path, entries)
    except OSError:
        pass


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def link_key(backend: str, world: int) -> str:
    """The collectives' cache key: the machine and torch, not the torch threads (a rank runs with one)."""
    return f"link|{backend}|world={world}|{cpu_model()}|torch={torch.__version__}"


def cached_link(backend: str, world: int) -> dict | None:
    """This machine's collectives over `world` ranks as calibrate_link measured them, or None: "link"
    [latency s, bytes/s] of collectives alone, and over gloo "strategies" {strategy: {"link": ...}} (as a
    training step runs them). An entry from before the strategies (ddp among them) were measured reads as none,
    over gloo."""
    entry = read_json(calibration_path()).get(link_key(backend, world))
    return entry if entry and (backend != "gloo" or "ddp" in entry.get("strategies", {})) else None


def cached(device: torch.device | str) -> dict | None:
    """This device's cached calibration with a profile, or None; measures nothing (a GPU run must not
    spend half a minute calibrating: without `trainwise hardware --calibrate` it is priced from published
    figures, trainwise.cost.cluster)."""
    entry = read_json(calibration_path()).get(machine_key(torch.device(device)))
    return entry if entry and entry.get("profile", {}).get("version") == PROFILE_VERSION else None


def kernel_table(machine: str) -> dict[str, float]:
    """{kernel: seconds per call} of the matmul and attention calls timed on this machine (measure.kernels
    .time_new_kernels), keyed by machine_key (device, threads, torch) and the profile's version
    (a new timing protocol times them again)."""
    return read_json(kernels_path()).get(f"{machine}|v{PROFILE_VERSION}", {})


def drop_kernel_table(machine: str) -> None:
    """Forget the kernels timed on this machine before a new calibration: their times are taken with the
    in-step factor fitted against them, and a VM's speed can move by up to 2x between hours (a profile
    cached in a fast hour then predicted every step ~40% short, benchmarks/RESULTS.md). Kernels are
    timed again on demand, a few ms each."""
    def drop(table: dict) -> None:
        for k in [k for k in table if k.startswith(f"{machine}|v")]:
            del table[k]

    update_json(kernels_path(), drop)


def save_kernel_table(machine: str, new: dict[str, float]) -> None:
    """Add kernels timed on this machine to the table (atomically; concurrent writers take turns)."""
    update_json(kernels_path(),  # a read-only home times them again next time
                 lambda table: table.setdefault(f"{machine}|v{PROFILE_VERSION}", {}).update(new))


STALE_S = 24 * 3600  # a calibration older than this is measured again when the machine is quiet


def age_s(entry: dict) -> float:
    return time.time() - entry.get("measured_unix", 0.0)


def stale(entry: dict) -> bool:
    """A calibration to measure again when the machine is quiet: taken on a busy machine, or over a day old."""
    return bool(entry.get("busy")) or age_s(entry) > STALE_S


def calibration_note(entry: dict) -> str:
    """'' for a fresh, quiet calibration; else what is wrong with it, for every line that uses it."""
    notes = [note] if (note := busy_note(entry)) else []
    if age_s(entry) > STALE_S:
        notes.append(f"calibrated {age_s(entry) / 86400:.1f} days ago ({entry.get('measured_at', '?')}): this "
                     "machine may run differently now; it is measured again when the machine is quiet, or run "
                     "`trainwise hardware --calibrate`")
    return "; ".join(notes)


def save_probe(device: torch.device, reading: dict) -> None:
    """Keep a speed probe's reading with this device's calibration ("last_probe")."""
    key = machine_key(device)

    def store(entries: dict) -> None:
        if key in entries:
            entries[key]["last_probe"] = reading

    update_json(calibration_path(), store)


def busy_note(result: dict) -> str:
    """'' for a trustworthy measurement; else a sentence saying why the peak is too low and what to do."""
    if not result.get("busy"):
        return ""
    held = (f"other processes kept {result['others_share']:.0%} of the cores busy" if "others_share" in result
            else f"its matmul threads got {result['cpu_share']:.0%} of the wall time")
    return (f"measured while other work held the CPU ({held}), so this peak is too low and MFU reads too high: "
            f"run `trainwise hardware --calibrate` on a quiet machine (a run an hour later measures again on its own)")
