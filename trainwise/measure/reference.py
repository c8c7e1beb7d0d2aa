"""Reference steps: real eager training steps of small models, timed over a calibration, from which the
step-time model learns what a real step adds to its kernels timed one by one (per-step and per-op
overhead, the in-step factor), and the speed probe that says how far the machine moved since.
"""

from __future__ import annotations

import statistics
import time

import torch

from trainwise.config import ModelConfig, TrainConfig
from trainwise.cost.steptime import kernels_to_time, op_seconds
from trainwise.measure.kernels import time_kernel_pass
from trainwise.measure.record import step_ops
from trainwise.runtime.step import build_model, build_step, random_batches

# Reference steps the step fit runs: unlike the configurations benchmarks/time_model.py checks, and from
# overhead-bound (d_model 16) to kernel-bound (d_model 192), fp32 and bf16: (model, micro-batch, T, precision)
REFERENCE_STEPS = (
    (dict(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=32), 1, 8, "fp32"),
    (dict(vocab_size=64, d_model=16, n_layers=6, n_heads=2, n_kv_heads=2, ffn_hidden=32), 1, 8, "fp32"),
    (dict(vocab_size=1024, d_model=128, n_layers=3, n_heads=2, n_kv_heads=2, ffn_hidden=384), 16, 64, "bf16"),
    (dict(vocab_size=2048, d_model=192, n_layers=2, n_heads=3, n_kv_heads=1, ffn_hidden=512), 8, 192, "bf16"),
    (dict(vocab_size=2048, d_model=192, n_layers=2, n_heads=3, n_kv_heads=1, ffn_hidden=512), 4, 192, "fp32"),
)


OVERHEAD_REFERENCES = 2  # the first two: kernels ~10% of their step, the rest Python, dispatch, autograd
SAMPLE_S = 0.01  # seconds of calls per reference step and sample (at least one call)


class ReferenceSteps:
    """Real eager steps of REFERENCE_STEPS with the trainer's own step, sampled again and again over the
    whole calibration (sample() after each of its parts), each keeping its fastest, and their matmul and
    attention calls timed alone in the same samples; then fit(profile) says what a real eager step adds to its
    kernels timed one by one: t = per step + per op x calls + in_step x (its operators' times from
    `profile`, a hardware.profile.Profile) + its optimizer update.

    Why samples spread so widely: a VM can switch between a fast and a slow state for seconds to tens
    of seconds at a time, in one process with nothing else running, and small kernels lose most in the
    slow state; a step fitted in a slow spell predicted the default model's step 15-20% long
    (benchmarks/RESULTS.md, "On an AMD EPYC")."""

    def __init__(self, device: torch.device, time_kernels: bool = True):
        """time_kernels=False: the steps only (a speed probe), without their operator lists."""
        self.refs, self.times, self.device = [], [], device
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.kernels: dict[str, float] = {}  # the references' matmuls and attention calls: fastest seconds
        self.time_kernels, self.todo = time_kernels, {}
        for model, batch, seq, precision in REFERENCE_STEPS:
            cfg = ModelConfig(**model, max_seq_len=seq)
            ops = [op for op in step_ops(cfg, batch, seq, precision) if op.phase != "optimizer"] if time_kernels else []
            with torch.random.fork_rng():
                torch.manual_seed(0)
                train_step = build_step(build_model(cfg, device), TrainConfig(), device, precision)
            batches = random_batches(cfg.vocab_size, batch, seq, 1, device)
            step = lambda train_step=train_step, batches=batches: train_step(batches)  # noqa: E731
            step()
            tensors = train_step.params
            self.refs.append((f"d{cfg.d_model} L{cfg.n_layers} B{batch} T{seq} {precision}", ops, step,
                              len(tensors), sum(p.numel() for p in tensors)))

    def sample(self) -> None:
        """Time each reference step once more (the overhead-bound ones for SAMPLE_S, a few calls), and
        (time_kernels) each of their matmul and attention calls alone once more: a fraction of a second. The
        steps and their kernels are timed side by side, so in_step compares one state of the machine."""
        if self.time_kernels:
            self.todo = self.todo or kernels_to_time([op for ref in self.refs for op in ref[1]], {})
            time_kernel_pass(self.todo, self.device.type, self.kernels, budget_s=0.0)  # 4 calls each, the fastest
        row = []
        for _, _, step, _, _ in self.refs:
            best, end = float("inf"), time.perf_counter() + SAMPLE_S
            while best == float("inf") or time.perf_counter() < end:
                start = time.perf_counter()
                step()
                self.sync()  # a GPU step is timed to its end, not to its launch
                best = min(best, time.perf_counter() - start)
            row.append(best)
        self.times.append(row)

    def fastest(self) -> list[float]:
        """Each reference step's fastest sample, seconds."""
        return list(map(min, zip(*self.times)))

    def fit(self, profile) -> dict:
        """{"overhead": [s per step, s per op], "in_step": x, "rows": [[name, s, kernels s, calls], ...],
        "fastest": [s, ...]} (rows: without the optimizer update; fastest: whole steps), in two
        stages, each well determined (one fit of the three traded its terms off, in_step 0.9-1.7 between
        calibrations): the overhead-bound references (d_model 16, the first OVERHEAD_REFERENCES) give the
        per-step and per-op costs (Python, dispatch, autograd); the others, in_step: what their kernels
        lose inside a step (operands evicted by the step's other work, allocation), their median."""
        profile.kernels.update(self.kernels)
        profile.new_kernels.update(self.kernels)
        table = []
        fastest = self.fastest()
        for (name, ops, _, tensors, params), t in zip(self.refs, fastest):
            t_opt = profile.optimizer[0] * tensors + profile.optimizer[1] * params
            table.append([name, t - t_opt, sum(op_seconds(op, profile)[0] for op in ops), sum(op.calls for op in ops)])
        profile.save_kernels()
        per_step, per_op = overhead_fit([(calls, t - kernels) for _, t, kernels, calls in table[:OVERHEAD_REFERENCES]])
        ratios = [(t - per_step - per_op * calls) / kernels for _, t, kernels, calls in table[OVERHEAD_REFERENCES:]]
        in_step = statistics.median(ratios) if ratios else 1.0
        return {"overhead": [per_step, per_op], "in_step": max(in_step, 0.5), "rows": table, "fastest": fastest}


def overhead_fit(rows: list[tuple[int, float]]) -> list[float]:
    """[s per step, s per op call] from the overhead-bound references' (op calls, step - its kernels): the
    per-call cost is the slope between the fewest and the most calls, the per-step cost what is left at
    the fewest (at least 0). The kernels of a reference step are priced one by one and can come to more
    than its whole step (a fresh calibration on an AMD EPYC: 1.21 ms of kernels in a 1.06 ms step): a fit
    in relative error, with that row floored at 1 us, then put both costs at 0 and the smallest steps of
    benchmarks/time_model.py 27% short; the slope between the two rows (4.6 us per call there) holds."""
    (c0, r0), (c1, r1) = min(rows), max(rows)
    per_op = max((r1 - r0) / (c1 - c0), 0.0) if c1 > c0 else max(r1, 0.0) / max(c1, 1)
    return [max(r0 - per_op * c0, 0.0), per_op]


PROBE_S = 0.6  # seconds of reference-step samples in a speed probe (at least one sample)


def reference_speed(device: torch.device, seconds: float = PROBE_S) -> list[float]:
    """The calibration's reference steps timed again now: each one's fastest over `seconds` of samples
    (seconds per step), to hold against the same reading at calibration (profile "probe_baseline_s"): what a
    step-time error owes to this machine's speed having moved rather than to the model. The global RNG
    is left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        refs = ReferenceSteps(device, time_kernels=False)
        end = time.perf_counter() + seconds
        while not refs.times or time.perf_counter() < end:
            refs.sample()
    return refs.fastest()


def probe_speed(device: torch.device, calibrated_s: list[float], seconds: float = PROBE_S) -> dict:
    """A speed probe (about a second): the reference steps now against their calibrated fastest, as
    ratios (now / then) for the overhead-bound references, the kernel-bound ones and all of them
    (cost.steptime.probed_seconds scales a prediction by them)."""
    now = reference_speed(device, seconds)
    split = OVERHEAD_REFERENCES
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "unix": time.time(), "now_s": now, "calibrated_s": calibrated_s,
            "overhead_ratio": sum(now[:split]) / sum(calibrated_s[:split]),
            "kernel_ratio": sum(now[split:]) / sum(calibrated_s[split:]), "ratio": sum(now) / sum(calibrated_s)}
