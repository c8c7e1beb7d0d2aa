"""Which device a plan or a run is priced on, resolved in one place: a table accelerator, this machine
as calibrated (`cpu`, or `cuda` for this machine's GPU), or a bare peak FLOP/s. The planner, the trainer's
MFU, the report's roofline and `trainwise hardware` all ask here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainwise.errors import TrainwiseError
from trainwise.hardware.cache import cached, cached_link, calibration_note
from trainwise.hardware.profile import Profile, table_profile
from trainwise.hardware.table import get_accelerator, lookup_cuda_device
from trainwise.measure.calibrate import calibrate


@dataclass
class Hardware:
    name: str
    peak_flops: float
    bandwidth_bytes_per_s: float | None = None
    memory_bytes: int | None = None
    profile: Profile | None = None  # what the step-time model prices operators with (cost.steptime)
    cuda: bool = False  # a GPU: CUDA kernels, communication overlapped with backward
    peak_source: str = ""  # where peak_flops comes from, as a person reads it (MFU is against it)
    calibration: dict | None = None  # this machine's calibration (hardware.cache), where it is one

    @property
    def calibration_note(self) -> str:
        """'' or why the calibration may not describe the machine now (busy, old): on every line using it."""
        return calibration_note(self.calibration) if self.calibration else ""


def resolve_hardware(gpu: str | None, peak_flops: float | None = None, bandwidth: float | None = None,
                     memory: int | None = None, dtype: str = "bf16", threads: int | None = None) -> Hardware:
    """--gpu NAME from the table (a key, an alias or a CUDA device name), overridden by --peak-flops /
    --bandwidth / --memory where given. `cpu` is this machine as calibrated (with `threads` torch
    threads, e.g. per torchrun rank); `cuda` this machine's GPU: its table entry, priced by its
    calibration if one is cached, else at the step-time model's default efficiencies (uncalibrated); an
    unknown GPU is calibrated. A given --peak-flops drops the profile: time then comes from the assumed
    MFU."""
    if gpu and gpu.lower() == "cpu":  # this machine, as `trainwise hardware --calibrate` measured it
        measured = calibrate("cpu", threads=threads)
        peak = measured["peak_flops"].get(dtype, measured["peak_flops"]["fp32"])
        busy = " while busy: too low, see `trainwise hardware --calibrate`" if measured.get("busy") else ""
        note = calibration_note(measured)
        hw = Hardware(f"this CPU (measured{busy})", peak, measured["bandwidth_bytes_per_s"], None,
                      Profile.from_json(measured["profile"]).on_device("cpu", measured["machine"], threads),
                      peak_source=f"measured {dtype} matmul peak of this cpu" + (f"; {note}" if note else ""),
                      calibration=measured)
        _use_measured_link(hw.profile, "gloo", threads and (os.cpu_count() or 1) // threads)
    elif gpu and gpu.lower() == "cuda":  # this machine's GPU
        hw = _this_gpu(dtype)
    elif gpu:
        acc = get_accelerator(gpu)
        hw = Hardware(acc.name, acc.peak(dtype), acc.bandwidth_bytes_per_s, acc.memory_bytes,
                      table_profile(acc.peak_flops, acc.bandwidth_bytes_per_s) if acc.bandwidth_bytes_per_s else None,
                      cuda=True, peak_source=f"{acc.name} datasheet ({dtype})")
    elif peak_flops is not None:
        hw = Hardware("custom", peak_flops)
    else:
        raise TrainwiseError("give the hardware: --gpu NAME (see `trainwise hardware`), --gpu cpu (this machine's "
                             "measured peak) or --peak-flops P (FLOP/s).")
    if peak_flops is not None:
        hw.peak_flops, hw.profile, hw.peak_source, hw.calibration = float(peak_flops), None, "given (--peak-flops)", None
    if bandwidth:
        hw.bandwidth_bytes_per_s = float(bandwidth)
    if memory:
        hw.memory_bytes = int(memory)
    if hw.peak_flops <= 0:
        raise TrainwiseError("--peak-flops must be positive.")
    return hw


def _this_gpu(dtype: str) -> Hardware:
    """The GPU this process uses: its datasheet peak (for MFU), priced by its cached calibration or, without
    one, at the table's default efficiencies; a GPU the table lacks is calibrated for its peak."""
    name, entry = torch.cuda.get_device_name(), cached("cuda")
    acc = lookup_cuda_device(name)
    if acc is None and entry is None:
        entry = calibrate("cuda")
    profile = (Profile.from_json(entry["profile"]).on_device("cuda", entry["machine"], None) if entry else
               table_profile(acc.peak_flops, acc.bandwidth_bytes_per_s) if acc.bandwidth_bytes_per_s else None)
    if acc is not None:
        peak, source = acc.peak(dtype), f"{acc.name} datasheet ({dtype})"
    else:
        peak, source = entry["peak_flops"].get(dtype, 0.0), f"measured {dtype} matmul peak of this cuda"
    hw = Hardware(name, peak, acc.bandwidth_bytes_per_s if acc else entry["bandwidth_bytes_per_s"],
                  acc.memory_bytes if acc else None, profile, cuda=True, peak_source=source, calibration=entry)
    _use_measured_link(profile, "nccl", torch.cuda.device_count())
    return hw


def device_hardware(device: torch.device, dtype: str) -> Hardware:
    """The hardware a run on `device` is priced on (cpu: calibrated; cuda: this GPU)."""
    return resolve_hardware("cuda" if device.type == "cuda" else "cpu", dtype=dtype)


def _use_measured_link(profile: Profile | None, backend: str, world: int | None) -> None:
    """The collectives as `trainwise hardware --calibrate` measured them under torchrun, if it did."""
    if profile is not None and world and world > 1 and (link := cached_link(backend, world)):
        profile.link, profile.link_source = link, f"calibrated ({backend}, {world} ranks)"
