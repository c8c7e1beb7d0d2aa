"""Profile: what a device does per unit of work, the step-time model's description of it (trainwise.cost
.steptime prices a step's operators with it). Data only: a calibration (trainwise.measure.calibrate)
measures one. (A GPU this machine has not calibrated is priced from published figures instead:
trainwise.cost.cluster.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwise.hardware.cache import kernel_table, save_kernel_table

# A GPU host's eager overhead, [seconds per step, seconds per eager op]: ~1 ms per step (optimizer launch,
# logging) and 5-10 us of Python and launch per op, round figures (cost.cluster adds the per-step term).
DEFAULT_OVERHEAD = [1e-3, 6e-6]


@dataclass
class Profile:
    """What a device does per unit of work (how cost.steptime uses each figure: its module docstring).
    Rates in FLOP/s and bytes/s."""

    matmul: dict[str, list[float]]  # dtype -> [c s, P FLOP/s, BW bytes/s]
    elementwise: dict[str, dict[str, list[list[float]]]]  # dtype -> class -> [[bytes per call, bytes/s], ...]
    attention: dict[str, dict[str, list[float]]]  # dtype -> "forward"/"backward" -> [c s, FLOP/s]
    optimizer: list[float]  # [s per parameter tensor, s per parameter] of clip + AdamW step
    overhead: list[float]  # [s per step, s per eager op call]
    source: str  # "calibrated"
    link: list[float] = field(default_factory=lambda: [5e-5, 1e9])  # collectives: [latency s, bytes/s]
    link_source: str = "default"
    # per data-parallel strategy, its collectives as a training step runs them (calibrated under torchrun
    # over gloo: measure.reference.strategy_links): {strategy: [latency s, bytes/s]}, else `link`
    strategy_links: dict[str, list[float]] = field(default_factory=dict)
    in_step: float = 1.0  # a real step's kernels take this times their time alone (calibrated: step_fit)
    # the same per compute precision of the step ({"fp32": x, "bf16": x}: measure.reference.ReferenceSteps.fit)
    in_step_by: dict[str, float] = field(default_factory=dict)
    # seconds per call of matmuls and attention at given shapes (kernel_key); with `device` set, the
    # calls a plan needs and the table lacks are measured on this device (`threads` torch threads)
    kernels: dict[str, float] = field(default_factory=dict)
    device: str | None = None
    threads: int | None = None
    machine: str = ""
    new_kernels: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        return cls(**{k: d[k] for k in ("matmul", "elementwise", "attention", "optimizer", "overhead", "source")},
                   link=d.get("link", [5e-5, 1e9]), link_source=d.get("link_source", "default"),
                   in_step=d.get("in_step", 1.0), in_step_by=d.get("in_step_by", {}))

    def in_step_for(self, precision: str) -> float:
        """The in-step factor of a step computed in `precision` (fp16 autocast takes bf16's), else in_step."""
        return self.in_step_by.get("bf16" if precision == "fp16" else precision, self.in_step)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("kernels", "device", "threads", "new_kernels")}

    def on_device(self, device: str, machine: str, threads: int | None) -> Profile:
        """This profile measured here: kernels at new shapes may be timed on `device`, and the ones timed
        before on this machine (cache.kernel_table) are used."""
        self.device, self.machine, self.threads = device, machine, threads
        self.kernels = {**kernel_table(machine), **self.kernels}
        return self

    def save_kernels(self) -> None:
        """Cache the kernels timed since the last save (cache.save_kernel_table)."""
        if self.new_kernels and self.machine:
            save_kernel_table(self.machine, self.new_kernels)
            self.new_kernels = {}

