"""What verify measures of a run, attached to the training loop from outside: the loop runs each
optimizer step inside `StepObserver.step(i)` and hands it the gradients before they are freed; it does not
know what is measured.

    the step's peak     measure.memtrack.StepPeakMeter over the last step (under torchrun the median of
                        the last PEAK_STEPS but the first two: steady_peak), verify.json's "step peak"
    messages            runtime.comms.CommCounter over the last step of a torchrun job, per collective
    states              this rank's parameter, gradient and optimizer bytes at the last step, and zero2's
                        gathered parameters (runtime.distributed), for the per-rank check
    routing             under expert parallelism, the assignments the rank routed to each expert in the last
                        step (runtime.expert_parallel.routed_tokens after each forward): the plan's all-to-alls
                        are evaluated at them
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterable, Iterator

import torch

from trainwise.measure.memtrack import StepPeakMeter
from trainwise.runtime import distributed, expert_parallel
from trainwise.runtime.comms import CommCounter
from trainwise.runtime.step import TrainingStep

# Under torchrun a collective's buffers are freed by whichever thread lets go last, the run's or gloo's
# worker, as the two are scheduled: the meter leaves out what the worker frees (measure.memtrack._own_events),
# which reads a step low when the worker happens to free a buffer the run still used at the peak (an
# all-gather's output under FSDP2: -6% of a tiny model's step), and high when the profiler misses a worker's
# free or a buffer slips past it (+4 to +18% on the tests' models). Each is one step's accident, so the
# step's own peak is the median of several (five, where a run has them).
PEAK_STEPS = 5


def steady_peak(peaks: list[int]) -> int:
    """The peak of a repeated step from its measured repetitions: the median (the lower middle of an even
    count), so that neither a step read high nor one read low decides it."""
    return statistics.median_low(peaks)


class StepObserver:
    def __init__(self, step: TrainingStep, d: distributed.Dist, max_steps: int, foreign: set[int]):
        self._step, self._d, self._max_steps, self._foreign = step, d, max_steps, foreign
        self._gathered = distributed.gathered_params_meter(step.model, d)
        self._first_measured: int | None = None  # set by the process's first step (a resumed run's too)
        self._meter: StepPeakMeter | None = None
        self.peak_bytes: int | None = None  # peak allocated bytes of the measured steps (steady_peak)
        self.comm: dict | None = None  # what this rank sent in the last step, per collective
        self._grad_bytes = 0
        self._expert_tokens: torch.Tensor | None = None
        self._own_s = 0.0  # seconds the meter took to start and stop, not yet handed to the loop (own_seconds)
        self._metered = 0  # steps run under the meter, not yet handed to the loop (metered_steps)

    def _last(self, i: int) -> bool:
        return self._d.active and i + 1 == self._max_steps

    @contextlib.contextmanager
    def step(self, i: int) -> Iterator[None]:
        """Around optimizer step `i` (0-based)."""
        if self._first_measured is None:
            # the last step, or under torchrun the last PEAK_STEPS; never the process's first (its states come
            # after its peak) nor under torchrun its second (DDP replaces its gradient buckets then), unless
            # there is no other
            settled = i + (2 if self._d.active else 1)
            self._first_measured = max(self._max_steps - (PEAK_STEPS if self._d.active else 1),
                                       min(settled, self._max_steps - 1))
        if i >= self._first_measured and self._meter is None:  # one stretch, each measured step a span of it
            began = time.perf_counter()
            self._meter = StepPeakMeter(self._step.device, self._foreign)
            self._meter.start()
            distributed.barrier(self._d)  # the ranks leave the meter's start together (own_seconds)
            self._own_s += time.perf_counter() - began
        counter = CommCounter() if self._last(i) else None
        self._metered += self._meter is not None
        try:
            with counter or contextlib.nullcontext(), self._meter.span() if self._meter else contextlib.nullcontext():
                yield
        except BaseException:
            self.close(together=False)  # the other ranks may not be coming: no barrier
            raise
        if i + 1 == self._max_steps:
            self.close()
        if counter is not None:
            self.comm = counter.result()

    def close(self, together: bool = True) -> None:
        """End the measured stretch (after the last step, or where a step failed: together=False, each rank on
        its own): the step's peak."""
        if self._meter is not None:
            began = time.perf_counter()
            meter, self._meter = self._meter, None
            meter.stop()
            self.peak_bytes = steady_peak(meter.span_peaks or [meter.peak_bytes])
            if together:
                distributed.barrier(self._d)
            self._own_s += time.perf_counter() - began

    def own_seconds(self) -> float:
        """Seconds the meter spent starting and stopping since the last call (a CPU profiler's start walks the
        live tensors, its stop reads every allocation event: 0.3 s each for a tiny model), which the loop leaves
        out of step_time_s as it leaves out checkpoint saves. Under torchrun the ranks wait for one another at
        the end of each (a barrier): a rank that started or stopped its meter first would otherwise wait at the
        step's next collective for the others, and count their meters' time as its step's."""
        seconds, self._own_s = self._own_s, 0.0
        return seconds

    def metered_steps(self) -> int:
        """Steps run under the peak meter since the last call. On a CPU its profiler records every operator, and
        a metered step takes longer than the run's others: the loop marks the metrics rows that hold one
        (`metered_steps`), and verify measures the step time on the rows without (verify.steady_step_time)."""
        steps, self._metered = self._metered, 0
        return steps

    def forward(self, i: int) -> None:
        """After each micro-batch's forward of step `i`."""
        tokens = expert_parallel.routed_tokens(self._step.model) if self._last(i) else None
        if tokens is not None:
            self._expert_tokens = tokens if self._expert_tokens is None else self._expert_tokens + tokens

    def gradients(self, i: int, grads: Iterable[torch.Tensor | None]) -> None:
        """The gradients of step `i` after the update, before they are freed."""
        grads = list(grads)
        if self._last(i):
            self._grad_bytes = distributed.local_bytes(grads)
        if self._meter is not None:  # DDP's buckets: resident all along, reachable only through the grads
            self._meter.resident(grads)

    def rank_measurements(self) -> dict:
        """This rank's states, step peak and messages at the last step, for verify.per_rank."""
        ts = self._step
        measured = distributed.rank_state_bytes(ts.params, ts.optimizer, self._grad_bytes, self._gathered["bytes"])
        tokens = None if self._expert_tokens is None else self._expert_tokens.tolist()
        return {**measured, "peak_memory_bytes": self.peak_bytes, "comm": self.comm, "expert_tokens": tokens}
