"""Tracked memory of one training step, per category, on CPU and CUDA (and on fake tensors).

Built on `torch.distributed._tools.mem_tracker.MemTracker`, which sees every tensor storage created
and freed through the dispatcher and files it under parameters, buffers, gradients, optimizer states,
activations (created in forward) or temporaries (created in backward and the optimizer step). It
works the same on fake tensors, so `trainwise plan --simulate` uses it too.

What we read from it, to compare with the planner's terms:
  params, buffers      what the model holds;
  grads                gradients held at the end of the last backward (all of them, before the step);
  optimizer            optimizer states after the step;
  activations          tensors alive at the end of the (last) forward that the forward created: what
                       autograd saved for backward plus the loss;
  peak                 the largest total of all categories at any moment of the step, and its split.
On CUDA, `torch.cuda.max_memory_allocated`/`max_memory_reserved` are read as well (allocated is what
tensors use, reserved adds the caching allocator's slack); they are reported separately.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

CATEGORIES = {
    _MemRefType.PARAM: "params", _MemRefType.BUFFER: "buffers", _MemRefType.GRAD: "grads",
    _MemRefType.OPT: "optimizer", _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporaries",
    _MemRefType.OTH: "other",
}


@dataclass
class MemoryBreakdown:
    params: int
    buffers: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int  # temporaries alive at the peak
    peak_bytes: int  # tracked total at the peak
    peak_split: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _split(snapshot: dict) -> dict[str, int]:
    out = {name: 0 for name in CATEGORIES.values()}
    for device_stats in snapshot.values():
        for kind, nbytes in device_stats.items():
            if kind in CATEGORIES:
                out[CATEGORIES[kind]] += int(nbytes)
    return out


def track_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, batches: list,
                     device: torch.device, precision: str, grad_clip: float = 1.0) -> MemoryBreakdown:
    """Run one training step (`trainwise.measure.step.train_step`) under MemTracker and read it.
    The optimizer should already hold its states (one step taken before) for a steady-state figure."""
    from trainwise.measure.step import train_step

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    seen: dict[str, dict[str, int]] = {}
    tracker = MemTracker()
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))

    def hook(phase: str) -> None:
        seen[phase] = _split(tracker.get_tracker_snapshot("current"))
        if phase == "backward":
            tracker.reset_mod_stats()  # the next micro-batch calls the modules again (grad accumulation)

    with tracker:
        train_step(model, optimizer, batches, device, precision, grad_clip, hook=hook)
    peak = _split(tracker.get_tracker_snapshot("peak"))
    after = seen.get("step", seen["backward"])
    return MemoryBreakdown(
        params=after["params"], buffers=after["buffers"], grads=seen["backward"]["grads"],
        optimizer=after["optimizer"], activations=seen["forward"]["activations"],
        temporaries=peak["temporaries"], peak_bytes=sum(peak.values()), peak_split=peak, device=str(device),
        cuda_max_allocated_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        cuda_max_reserved_bytes=torch.cuda.max_memory_reserved(device) if cuda else None,
    )
