"""Profile: what a device does per unit of work, the step-time model's description of it (trainwise.cost
.steptime prices a step's operators with it). Data only: a calibration (trainwise.measure.calibrate)
measures one, `table_profile` makes one from a datasheet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwise.hardware.cache import kernel_table, save_kernel_table

# Uncalibrated accelerators: fractions of the datasheet figure a well-fed kernel reaches, round figures
# of the commonly reported range (not measured by trainwise): large bf16 GEMMs 70-80% of an A100/H100's
# dense peak, flash attention 50-70% forward and less backward, element-wise kernels 70-90% of HBM
# bandwidth; a PyTorch eager op costs ~5-10 us of launch and Python. `benchmarks/gpu_check.py` measures.
DEFAULT_EFFICIENCY = {"matmul": 0.7, "attention_forward": 0.5, "attention_backward": 0.35, "bandwidth": 0.7}
DEFAULT_OVERHEAD = [1e-3, 6e-6]  # [seconds per step, seconds per eager op] on a GPU host
ADAMW_BYTES_PER_PARAM = 28  # fused AdamW, fp32: read+write param, m, v (24) + read grad (4)


@dataclass
class Profile:
    """What a device does per unit of work (how cost.steptime uses each figure: its module docstring).
    Rates in FLOP/s and bytes/s."""

    matmul: dict[str, list[float]]  # dtype -> [c s, P FLOP/s, BW bytes/s]
    elementwise: dict[str, dict[str, list[list[float]]]]  # dtype -> class -> [[bytes per call, bytes/s], ...]
    attention: dict[str, dict[str, list[float]]]  # dtype -> "forward"/"backward" -> [c s, FLOP/s]
    optimizer: list[float]  # [s per parameter tensor, s per parameter] of clip + AdamW step
    overhead: list[float]  # [s per step, s per eager op call]
    source: str  # "calibrated" | "table defaults"
    link: list[float] = field(default_factory=lambda: [5e-5, 1e9])  # collectives: [latency s, bytes/s]
    link_source: str = "default"
    in_step: float = 1.0  # a real step's kernels take this times their time alone (calibrated: step_fit)
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
                   in_step=d.get("in_step", 1.0))

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


def table_profile(peak_flops: dict[str, float], bandwidth: float) -> Profile:
    """A datasheet's peaks and bandwidth at DEFAULT_EFFICIENCY: the model of an uncalibrated GPU."""
    e = DEFAULT_EFFICIENCY
    bw = e["bandwidth"] * bandwidth
    classes = ("elementwise/other", "activation", "norm", "softmax/cross-entropy")
    dtypes = {"fp32": peak_flops.get("tf32", peak_flops.get("fp32"))}
    for name in ("bf16", "fp16"):
        dtypes[name] = peak_flops.get(name, peak_flops.get({"bf16": "fp16", "fp16": "bf16"}[name]))
    dtypes = {k: v for k, v in dtypes.items() if v}
    return Profile(
        matmul={d: [0.0, e["matmul"] * p, bw] for d, p in dtypes.items()},
        elementwise={d: {c: [[1.0, bw]] for c in classes} for d in dtypes},
        attention={d: {"forward": [0.0, e["attention_forward"] * p], "backward": [0.0, e["attention_backward"] * p]}
                   for d, p in dtypes.items()},
        optimizer=[0.0, ADAMW_BYTES_PER_PARAM / bw], overhead=list(DEFAULT_OVERHEAD), source="table defaults",
        link=[1e-5, 100e9], link_source="default (100 GB/s, 10 us; interconnect not in the table)")


