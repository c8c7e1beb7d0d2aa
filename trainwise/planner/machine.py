"""Which device a plan or a run is priced on, resolved in one place: a table accelerator, this machine
as calibrated (`cpu`, or `cuda` for this machine's GPU), or a bare peak FLOP/s. The planner, the trainer's
MFU, the report's roofline and `trainwise hardware` all ask here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from trainwise.errors import TrainwiseError
from trainwise.hardware.cache import cached, cached_link, calibration_note
from trainwise.hardware.profile import Profile
from trainwise.hardware.table import (ACCELERATORS, KERNEL_ATTENTION_TFLOPS, Accelerator, Node, get_accelerator,
                                      get_node, lookup_cuda_device, measured_on, node_from_line_rates, table_gpus)
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
    accelerator: Accelerator | None = None  # a table GPU: cost.cluster prices its steps from published figures
    node: Node | None = None  # the servers it comes in (GPUs per node, NVLink, network)

    @property
    def kernel_source(self) -> str:
        """Where a table GPU's step-time figures come from, as a person reads them."""
        a = self.accelerator
        if a is None:
            return ""
        kernels = (f"matmuls at MAMF {a.mamf / 1e12:.0f} TFLOP/s (Bekman, ml-engineering)" if a.mamf else
                   "no published MAMF: matmuls at 80% of peak (the H100's share)")
        attention = (f"cuDNN's and FlashAttention-2's measured attention rates (NVIDIA cudnn-frontend, "
                     f"{measured_on(a)})" if a.attention in KERNEL_ATTENTION_TFLOPS else
                     "FlashAttention-2 published rates (Dao 2023)" if a.attention else
                     "attention at the A100's FlashAttention-2 rates x MAMF ratio (none published)")
        if a.clock_share != 1.0:
            kernels += f"; every tensor-core kernel at {a.clock_share:.3f} of its published rate (held clocks)"
        n = self.node
        node = (f"{n.name}: NCCL all-reduce busbw {n.allreduce_busbw_intra / 1e9:.0f} GB/s in a node over {n.fabric}"
                + (f" ({n.pair_busbw / 1e9:.0f} GB/s in a bridged pair)" if n.pair_busbw else "")
                + f", {n.allreduce_busbw_inter / 1e9:.0f} GB/s per node across nodes"
                + (" (a ring at most the node's own)" if n.allreduce_busbw_inter > n.allreduce_busbw_intra else "")
                + f" ({n.source})"
                if n else "one device, no collectives")
        return f"{a.name}: {kernels}; {attention}; element-wise at {a.copy_fraction or 0.75:.0%} of HBM; {node}"

    @property
    def calibration_note(self) -> str:
        """'' or why the calibration may not describe the machine now (busy, old): on every line using it."""
        return calibration_note(self.calibration) if self.calibration else ""


def resolve_hardware(gpu: str | None, peak_flops: float | None = None, bandwidth: float | None = None,
                     memory: int | None = None, dtype: str = "bf16", threads: int | None = None, *,
                     gpus_per_node: int | None = None, intra_node_bw: float | None = None,
                     inter_node_bw: float | None = None, gpus: int = 1, clock_share: float | None = None) -> Hardware:
    """--gpu NAME from the table (a key, an alias or a CUDA device name), overridden by --peak-flops /
    --bandwidth / --memory where given. `cpu` is this machine as calibrated (with `threads` torch
    threads, e.g. per torchrun rank); `cuda` this machine's GPU: its table entry, priced by its
    calibration if one is cached, else like a table GPU; an unknown GPU is calibrated. A table GPU is
    priced from published microbenchmarks (cost.cluster) and comes in its node (hardware.table.NODES),
    whose GPUs per node and NVLink / network bandwidth per GPU --gpus-per-node, --intra-node-bw and
    --inter-node-bw override (the measured bus bandwidths scale with them); --clock-share holds its kernel rates
    to that share (a power limit below the TDP). A given --peak-flops drops every model of the device: time
    then comes from the assumed MFU."""
    if dtype == "fp8" and gpu and gpu.lower() in ("cpu", "cuda"):
        raise TrainwiseError(
            f"--precision fp8 plans the FP8 tensor cores of a GPU of the table, from published kernel figures; "
            f"--gpu {gpu} is priced by this machine's calibration, which measures no FP8 GEMMs. Plan a table GPU "
            f"with FP8 (--gpu {table_gpus(lambda a: 'fp8' in a.peak_flops)}), or this machine with --precision bf16.")
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
        if not torch.cuda.is_available():
            raise TrainwiseError("--gpu cuda means this machine's GPU, and PyTorch sees none here (a CPU build of "
                                 "torch, or no GPU): plan a GPU of the table by name (--gpu h100-sxm, see "
                                 "`trainwise hardware`), or this machine's CPU with --gpu cpu.")
        hw = _this_gpu(dtype)
    elif gpu:
        acc = get_accelerator(gpu)
        if dtype == "fp8" and "fp8" not in acc.peak_flops:
            with_fp8 = table_gpus(lambda a: "fp8" in a.peak_flops)
            raise TrainwiseError(
                f"--precision fp8 needs FP8 tensor cores and their published peak, and the table has no FP8 figure "
                f"for the {acc.name} (its published peaks: {', '.join(acc.peak_flops)}). Plan it with --precision "
                f"bf16, or plan a GPU with FP8: {with_fp8}.")
        hw = Hardware(acc.name, acc.peak(dtype), acc.bandwidth_bytes_per_s, acc.memory_bytes, None, cuda=True,
                      peak_source=f"{acc.name} datasheet ({dtype})",
                      accelerator=acc if acc.bandwidth_bytes_per_s else None,
                      node=get_node(acc.node) if acc.node else None)
    elif peak_flops is not None:
        hw = Hardware("custom", peak_flops)
    else:
        raise TrainwiseError("give the hardware: --gpu NAME (see `trainwise hardware`), --gpu cpu (this machine's "
                             "measured peak) or --peak-flops P (FLOP/s).")
    if peak_flops is not None:
        hw.peak_flops, hw.profile = float(peak_flops), None
        hw.peak_source, hw.calibration = "given (--peak-flops)", None
        hw.accelerator = None
    if hw.accelerator is not None:
        hw.node = _node(hw, gpus, gpus_per_node, intra_node_bw, inter_node_bw)
    for name, value in (("--bandwidth", bandwidth), ("--memory", memory)):
        if value is not None and not value > 0:
            raise TrainwiseError(f"{name} = {value:g} must be positive: the device's memory {name[2:]} "
                                 f"({'bytes/s' if name == '--bandwidth' else 'bytes, e.g. 80GiB'}).")
    if bandwidth:  # the cluster model prices memory-bound kernels at the accelerator's bandwidth
        hw.bandwidth_bytes_per_s = float(bandwidth)
        if hw.accelerator is not None:
            hw.accelerator = replace(hw.accelerator, bandwidth_bytes_per_s=float(bandwidth))
    if clock_share is not None:
        if hw.accelerator is None or not 0 < clock_share <= 1:
            raise TrainwiseError(
                f"--clock-share {clock_share:g} holds a table GPU's published kernel rates to that share (a power "
                "limit below its TDP: 0 < share <= 1, e.g. 0.92); " + (
                    "give a share in (0, 1]." if hw.accelerator is not None else
                    f"{hw.name} is not priced from published kernel rates: plan a table GPU (--gpu h100-sxm), or "
                    "give its lower peak with --peak-flops."))
        hw.accelerator = replace(hw.accelerator, clock_share=float(clock_share))
    if memory:
        hw.memory_bytes = int(memory)
        if hw.accelerator is not None:
            hw.accelerator = replace(hw.accelerator, memory_bytes=int(memory))
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
    profile = Profile.from_json(entry["profile"]).on_device("cuda", entry["machine"], None) if entry else None
    if acc is not None:
        peak, source = acc.peak(dtype), f"{acc.name} datasheet ({dtype})"
    else:
        peak, source = entry["peak_flops"].get(dtype, 0.0), f"measured {dtype} matmul peak of this cuda"
    hw = Hardware(name, peak, acc.bandwidth_bytes_per_s if acc else entry["bandwidth_bytes_per_s"],
                  acc.memory_bytes if acc else None, profile, cuda=True, peak_source=source, calibration=entry,
                  accelerator=acc if profile is None else None, node=get_node(acc.node) if acc and acc.node else None)
    _use_measured_link(profile, "nccl", torch.cuda.device_count())
    return hw


def device_hardware(device: torch.device, dtype: str) -> Hardware:
    """The hardware a run on `device` is priced on (cpu: calibrated; cuda: this GPU)."""
    return resolve_hardware("cuda" if device.type == "cuda" else "cpu", dtype=dtype)


def _use_measured_link(profile: Profile | None, backend: str, world: int | None) -> None:
    """The collectives as `trainwise hardware --calibrate` (or a CPU run) measured them under torchrun, if
    it did: alone, and over gloo each strategy's as a training step runs them."""
    if profile is not None and world and world > 1 and (entry := cached_link(backend, world)):
        profile.link = entry["link"]
        profile.link_source = f"calibrated ({backend}, {world} ranks, {entry['measured_at']})"
        profile.strategy_links = {s: v["link"] for s, v in entry.get("strategies", {}).items()}


def _node(hw: Hardware, gpus: int, gpus_per_node: int | None, intra: float | None, inter: float | None) -> Node | None:
    """The node of a table GPU with the user's overrides: GPUs per node; NVLink and network bandwidth per GPU
    per direction, the NCCL bus bandwidths measured on the node scaled by the same ratio."""
    node = hw.node
    if node is None:
        if gpus > 1 and not (gpus_per_node and intra and inter):
            raise TrainwiseError(
                f"--gpu {hw.accelerator.name} with --gpus {gpus}: trainwise's cluster model prices the collectives "
                f"of GPU nodes (NCCL over NVLink, PCIe or Infinity Fabric, and their NICs), and the table has no "
                f"node of {hw.accelerator.name} (a TPU pod's ICI torus is not modelled). Plan one device "
                "(--gpus 1), or describe a node with --gpus-per-node N, --intra-node-bw B and --inter-node-bw B "
                "(bytes/s per device per direction).")
        if not (gpus_per_node and intra and inter):
            return None
        node = node_from_line_rates("given node", gpus_per_node, "given links", intra, inter * gpus_per_node,
                                    "--gpus-per-node, --intra-node-bw, --inter-node-bw; NCCL's share of each")
    for name, value in (("--gpus-per-node", gpus_per_node), ("--intra-node-bw", intra), ("--inter-node-bw", inter)):
        if value is not None and value <= 0:
            raise TrainwiseError(f"{name} = {value} must be positive.")
    a = (intra or node.intra_bytes_per_s) / node.intra_bytes_per_s
    b = (inter or node.inter_bytes_per_s) / node.inter_bytes_per_s
    g = gpus_per_node or node.gpus
    return replace(node, gpus=g,
                   intra_bytes_per_s=node.intra_bytes_per_s * a, inter_bytes_per_s=node.inter_bytes_per_s * b,
                   allreduce_busbw_intra=node.allreduce_busbw_intra * a,
                   alltoall_busbw_intra=node.alltoall_busbw_intra * a,
                   allreduce_busbw_inter=node.allreduce_busbw_inter * b * g / node.gpus,
                   alltoall_busbw_inter=node.alltoall_busbw_inter * b)
