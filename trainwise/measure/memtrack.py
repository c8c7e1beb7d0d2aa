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

MemTracker sees only what passes the dispatcher, so not a compiled step (inductor allocates its buffers
directly). `StepPeakMeter` measures the peak at the allocator instead, whatever runs: the trainer wraps
its last step in it (verify.json's peak; per rank under torchrun, its last three steps after the first two).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from trainwise.runtime.step import TrainingStep

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


def track_train_step(step: TrainingStep, batches: list) -> MemoryBreakdown:
    """Run one training step under MemTracker and read it. The optimizer should already hold its states
    (one step taken before) for a steady-state figure."""
    model, optimizer, device = step.model, step.optimizer, step.device
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
        step(batches, hook=hook)
    peak = _split(tracker.get_tracker_snapshot("peak"))
    after = seen.get("step", seen["backward"])
    return MemoryBreakdown(
        params=after["params"], buffers=after["buffers"], grads=seen["backward"]["grads"],
        optimizer=after["optimizer"], activations=seen["forward"]["activations"],
        temporaries=peak["temporaries"], peak_bytes=sum(peak.values()), peak_split=peak, device=str(device),
        cuda_max_allocated_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        cuda_max_reserved_bytes=torch.cuda.max_memory_reserved(device) if cuda else None,
    )


def _storages(tensors, device: torch.device) -> dict[int, int]:
    """{storage address: bytes} of these tensors on `device` (a DTensor counts its local shard; views
    share their base's storage, counted once)."""
    out = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.device.type != device.type or t.is_meta or isinstance(t, FakeTensor):
            continue
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # fake/functional tensors (compile's caches) hold no memory
            continue
        if storage.nbytes() and ptr:
            out[ptr] = storage.nbytes()
    return out


def live_tensors(collect: bool = True):
    """Every tensor Python can reach (what the process holds between steps: parameters, buffers,
    optimizer states, FSDP2's shard storage, batches); collect=False: garbage in reference cycles too."""
    import gc
    import warnings

    if collect:  # garbage in reference cycles is not resident: the allocator may reuse it any time
        gc.collect()
    with warnings.catch_warnings():  # isinstance on deprecated module proxies warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    yield from objects


def _is_tensor(obj) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:  # a dead weak proxy
        return False


def foreign_storages(device: torch.device) -> set[int]:
    """Storage addresses alive now, before a run builds anything: StepPeakMeter leaves them out."""
    return set() if device.type == "cuda" else set(_storages(live_tensors(), device))


class StepPeakMeter:
    """Peak bytes allocated on the device over a stretch of code, whatever runs it: eager, compiled
    (inductor allocates outside the dispatcher, where MemTracker cannot see) or FSDP2/DDP hooks.

    CUDA: torch.cuda.max_memory_allocated, reset at start (the caching allocator's own count).
    CPU: the bytes resident at the start (the storages of every tensor Python can reach) + the highest
      running total of the allocations and frees the CPU allocator reports to torch.profiler while the
      stretch runs (profile_memory=True). Storages that exist throughout but that Python cannot reach
      (DDP's gradient buckets live in C++) are added when the caller shows a view of them at the end
      (`resident`: e.g. the gradients before zero_grad, views into those buckets).
    Used as: meter.start(); ...; meter.resident(tensors); meter.stop() -> peak bytes. Several repetitions
    of a step measured in one stretch, each `with meter.span():`, give each its own peak (`span_peaks`)
    for the price of one start and stop (each reads every tensor Python reaches)."""

    def __init__(self, device: torch.device, foreign: set[int] = frozenset()):
        """foreign: storage addresses that are not the run's (foreign_storages() before the run began:
        whatever else the process holds, e.g. a notebook's tensors or an earlier run's garbage)."""
        self.device = device
        self.foreign = foreign
        self.peak_bytes: int | None = None
        self.span_peaks: list[int] = []  # the peak within each span, in order (stop)
        self._prof = None
        self._filter: _StderrFilter | None = None
        self._base: dict[int, int] = {}
        self._late: dict[int, int] = {}

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        from torch.profiler import ProfilerActivity, profile

        self._base = {ptr: n for ptr, n in _storages(live_tensors(), self.device).items() if ptr not in self.foreign}
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._filter = _StderrFilter(_UNKNOWN_BLOCK)  # over the whole stretch: see _UNKNOWN_BLOCK
        _quiet_stderr(self._prof.__enter__)

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        """A stretch whose own peak goes to span_peaks (CPU: at `stop`; CUDA: the device's peak, reset here)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.span_peaks.append(torch.cuda.max_memory_allocated(self.device))
            return
        with torch.profiler.record_function(_SPAN):
            yield

    def resident(self, tensors) -> None:
        """Tensors alive at this point whose storage may predate `start` without Python reaching it."""
        if self._prof is not None:
            self._late.update(_storages(tensors, self.device))

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return self.peak_bytes
        _quiet_stderr(lambda: self._prof.__exit__(None, None, None))
        self._filter.close()
        self._filter = None
        events, spans = _allocations(self._prof)
        allocated = {ptr for _, _, ptr, _ in events}
        late = {ptr: n for ptr, n in self._late.items() if ptr not in self._base and ptr not in allocated}
        counted = {**self._base, **late}
        base = sum(counted.values())
        reachable = set(_storages(live_tensors(collect=False), self.device)) | set(self._late)
        highs = [None] * len(spans)
        running = highest = 0
        for t, nbytes in _own_events(events, counted, reachable):
            for i, (begin, end) in enumerate(spans):
                if highs[i] is None and t >= begin:  # what the span starts with counts in its peak
                    highs[i] = running
                if begin <= t <= end:
                    highs[i] = max(highs[i], running + nbytes)
            running += nbytes
            highest = max(highest, running)
        self._prof = None
        self.span_peaks = [base + (running if high is None else high) for high in highs]
        self.peak_bytes = base + highest
        return self.peak_bytes


# While the profiler records memory, freeing a block allocated before it started makes PyTorch's CPU
# allocator log "[W... CPUAllocator.cpp:...] Memory block of unknown size was allocated before the profiling
# started, ..." (c10's LOG(WARNING): written to file descriptor 2 by C++, not a Python warning, on the first
# such free in the process and every 1000th after). A training step frees such blocks all the time (the
# previous step's gradients and batch); the meter has no use for those frees (the blocks are in the bytes
# resident at start), and a user can do nothing about the line, which lands in the middle of the progress bar.
_UNKNOWN_BLOCK = re.compile(rb"\[W[^\n]*?Memory block of unknown size[^\n]*\n")


class _StderrFilter:
    """File descriptor 2 through a pipe until close(): a thread passes everything on to the real stderr at
    once (a progress bar keeps moving, a traceback still shows), except the lines that match `drop`.

    Should close() never come (an exception in the measured step), the thread keeps passing everything on,
    and at exit the descriptor is put back and the pipe drained, so nothing written meanwhile is lost."""

    def __init__(self, drop: re.Pattern):
        self.drop, self.thread = drop, None
        _flush_stderr()  # what Python wrote before goes straight out
        try:
            self.real = os.dup(2)
        except OSError:  # no descriptor 2 to filter
            return
        try:
            read, self.write = os.pipe()
        except OSError:  # out of descriptors: the line may show, the measurement goes on
            os.close(self.real)
            return
        os.dup2(self.write, 2)
        self.thread = threading.Thread(target=self._pass_on, args=(read,), name="trainwise-stderr", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def _pass_on(self, read: int) -> None:
        pending = b""
        with open(read, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                pending = self.drop.sub(b"", pending + chunk)
                # a log line may arrive in pieces: hold back from its "[W" until its newline has come
                cut = pending.rfind(b"[W")
                if cut < 0 or b"\n" in pending[cut:]:
                    cut = len(pending)
                self._out(pending[:cut])
                pending = pending[cut:]
        self._out(self.drop.sub(b"", pending))

    def _out(self, data: bytes) -> None:
        while data:
            try:
                data = data[os.write(self.real, data):]
            except OSError:  # the real stderr went away: nothing to pass on to
                return

    def close(self) -> None:
        """Put the real stderr back and pass on what is still in the pipe."""
        if self.thread is None:
            return
        thread, self.thread = self.thread, None
        atexit.unregister(self.close)
        _flush_stderr()
        os.dup2(self.real, 2)
        os.close(self.write)  # the pipe ends here, unless a process started meanwhile inherited it
        thread.join(timeout=1.0)
        if not thread.is_alive():  # else it keeps passing on that process's output, to the real stderr
            os.close(self.real)


def _flush_stderr() -> None:
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # no sys.stderr (pythonw), or a closed one
        pass


def _quiet_stderr(fn):
    """Run fn with file descriptor 2 on /dev/null: the profiler's C++ side (kineto) logs every start and
    stop to stderr, which would land in the middle of a training run's output."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        return fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _allocations(prof) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """(time ns, bytes (+ alloc, - free), address, thread) of every CPU allocator event, and (start ns, end ns)
    of every StepPeakMeter.span, each in time order, from one walk of the profiler's event tree."""
    from torch._C._profiler import _EventType

    out, spans, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            f = event.extra_fields
            out.append((event.start_time_ns, f.alloc_size, f.ptr, event.start_tid))
        elif event.name == _SPAN:
            spans.append((event.start_time_ns, event.end_time_ns))
        stack.extend(event.children)
    return sorted(out), sorted(spans)


_SPAN = "trainwise::measured_span"


def _own_events(events, counted: dict[int, int], reachable: set[int]) -> list[tuple[int, int]]:
    """The byte changes (time ns, bytes) of the run's own tensors among the allocator's `events`, in order.

    A collective's worker thread (gloo's) holds its input and output until it takes its next job, which on
    a busy machine can come after the step's peak or the step itself: a block the run allocated during
    the stretch and that another thread freed, or that is still allocated at the end while nothing reaches
    it (`reachable`: the storages Python reaches and the caller's `resident` ones), was the transport's
    to free and is left out. The profiler does not record every free of the worker's: an address allocated
    again with no free between ends the first block there. A free of a block allocated before the stretch
    counts only if its bytes are in `counted` (the resident bytes at start), else it is one of those
    buffers from an earlier step. PyTorch's CPU allocator reports no free of a block allocated while no
    profiler ran (it kept no size for it): a resident block whose address is allocated again ended there
    (DDP's first gradient buckets, replaced in its second iteration)."""
    born: dict[int, tuple[int, int, int]] = {}  # address -> (index of its allocation, bytes, thread)
    kept = [True] * len(events)
    ended: dict[int, int] = {}  # event index -> bytes of an unrecorded free just before it
    for i, (_, nbytes, ptr, tid) in enumerate(events):
        if nbytes > 0:
            if ptr in born:
                ended[i] = -born[ptr][1]
            elif ptr in counted:  # resident at start, freed unrecorded (allocated while no profiler ran)
                ended[i] = -counted.pop(ptr)
            born[ptr] = (i, nbytes, tid)
        elif ptr in born:
            j, _, alloc_tid = born.pop(ptr)
            kept[i] = kept[j] = tid == alloc_tid
        else:
            kept[i] = counted.pop(ptr, None) is not None
    for ptr, (j, _, _) in born.items():
        kept[j] = ptr in reachable
    out = []
    for i, (e, keep) in enumerate(zip(events, kept)):
        if i in ended:
            out.append((e[0], ended[i]))
        if keep:
            out.append((e[0], e[1]))
    return out
