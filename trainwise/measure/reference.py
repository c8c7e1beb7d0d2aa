"""Reference steps: real eager training steps of small models, timed over a calibration, from which the
step-time model learns what a real step adds to its kernels timed one by one (per-step and per-op
overhead, the in-step factor), and the speed probe that says how far the machine moved since; under
torchrun on CPUs, reference steps of each data-parallel strategy for its communication as a step runs it.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from trainwise.config import ModelConfig, TrainConfig
from trainwise.cost.comm import comm_seconds
from trainwise.cost.memory import DTYPE_BYTES
from trainwise.cost.params import params as count_params
from trainwise.cost.steptime import kernels_to_time, op_seconds
from trainwise.cost.time import fit_linear
from trainwise.measure.kernels import time_kernel_pass
from trainwise.measure.load import cpu_busy_jiffies, load_factor, others_share
from trainwise.measure.record import param_numels, step_ops
from trainwise.runtime.distributed import Dist
from trainwise.runtime.precision import resolve_precision
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
    slow state; a step fitted in a slow spell predicts long (benchmarks/RESULTS.md has the figures)."""

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
        """{"overhead": [s per step, s per op], "in_step": x, "in_step_by": {precision: x},
        "rows": [[name, s, kernels s, calls], ...],
        "fastest": [s, ...]} (rows: without the optimizer update; fastest: whole steps), in two
        stages, each well determined (one fit of the three traded its terms off, in_step 0.9-1.7 between
        calibrations): the overhead-bound references (d_model 16, the first OVERHEAD_REFERENCES) give the
        per-step and per-op costs (Python, dispatch, autograd); the others, in_step: what their kernels
        lose inside a step (operands evicted by the step's other work, allocation), their median, and
        "in_step_by" the median of each compute precision's: bf16 and fp32 kernels lose different shares
        inside a step on some CPUs, and one factor for both priced fp32 steps long and bf16 steps short
        (benchmarks/RESULTS.md, "One in-step factor per compute precision")."""
        profile.kernels.update(self.kernels)
        profile.new_kernels.update(self.kernels)
        table = []
        fastest = self.fastest()
        for (name, ops, _, tensors, params), t in zip(self.refs, fastest):
            t_opt = profile.optimizer[0] * tensors + profile.optimizer[1] * params
            table.append([name, t - t_opt, sum(op_seconds(op, profile)[0] for op in ops), sum(op.calls for op in ops)])
        profile.save_kernels()
        per_step, per_op = overhead_fit([(calls, t - kernels) for _, t, kernels, calls in table[:OVERHEAD_REFERENCES]])
        by_precision: dict[str, list[float]] = {}
        for (_, _, _, precision), (_, t, kernels, calls) in zip(REFERENCE_STEPS[OVERHEAD_REFERENCES:],
                                                                 table[OVERHEAD_REFERENCES:]):
            by_precision.setdefault(precision, []).append(max((t - per_step - per_op * calls) / kernels, 0.5))
        ratios = [r for rs in by_precision.values() for r in rs]
        return {"overhead": [per_step, per_op], "in_step": statistics.median(ratios) if ratios else 1.0,
                "in_step_by": {precision: statistics.median(rs) for precision, rs in by_precision.items()},
                "rows": table, "fastest": fastest}


def overhead_fit(rows: list[tuple[int, float]]) -> list[float]:
    """[s per step, s per op call] from the overhead-bound references' (op calls, step - its kernels): the
    per-call cost is the slope between the fewest and the most calls, the per-step cost what is left at
    the fewest (at least 0). The kernels of a reference step are priced one by one and can come to more
    than its whole step: a fit in relative error, with that row floored at 1 us, puts both costs at 0 and
    prices the smallest steps of benchmarks/time_model.py short; the slope between the two rows holds."""
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
    ratios (now / then) for the overhead-bound references, the kernel-bound ones and all of them, and on
    a CPU the share of the cores other processes kept busy meanwhile with what it costs a step
    (measure.load.load_factor: the fastest samples step around it, a run's steps do not;
    cost.steptime.probed_seconds scales a prediction by them)."""
    before, wall = cpu_busy_jiffies(), time.perf_counter()
    now = reference_speed(device, seconds)
    share = others_share(before, cpu_busy_jiffies(), time.perf_counter() - wall) if device.type == "cpu" else None
    split = OVERHEAD_REFERENCES
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "unix": time.time(), "now_s": now, "calibrated_s": calibrated_s,
            "overhead_ratio": sum(now[:split]) / sum(calibrated_s[:split]),
            "kernel_ratio": sum(now[split:]) / sum(calibrated_s[split:]), "ratio": sum(now) / sum(calibrated_s),
            "others_share": share, "load_factor": load_factor(share, torch.get_num_threads())}


# Three reference models for the data-parallel strategies' communication as a training step runs it: the
# same depth (so the same number of collectives), parameter bytes 7x and 50x apart (the per-byte term), the
# smallest's excess nearly all per-message cost (fitted to the larger two alone, ddp's per-hop term moved
# tenfold between calibrations: benchmarks/RESULTS.md); unlike the configurations benchmarks/time_model.py
# checks. (model, micro-batch, T), in the recipe a run on this CPU takes by default
# (runtime.precision.resolve_precision): bf16 where it multiplies bf16 natively, else fp32.
STRATEGY_REFERENCES = (
    (dict(vocab_size=512, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128), 2, 64),
    (dict(vocab_size=1024, d_model=128, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=384), 4, 128),
    (dict(vocab_size=2048, d_model=384, n_layers=2, n_heads=6, n_kv_heads=2, ffn_hidden=1024), 4, 128),
)
# DDP, whose reducer all-reduces the gradients in buckets from hooks during the backward (zero1's too:
# cost.steptime prices zero1 at this fit), and the FSDP2 strategies, whose collectives run block by block
# between the compute. DDP's excess over the unsharded step is 2-3x what its all-reduces cost timed alone
# (RESULTS.md, "DDP's collectives as its steps run them").
STRATEGIES_FITTED = ("ddp", "zero2", "fsdp")
# A sharded step read no slower than the unsharded one is the machine's noise, not a measurement (its fit would
# price the strategy's collectives at nothing): its reference is timed again, at most this many times in all.
STRATEGY_PASSES = 3


def strategy_links(turns: int = 12) -> dict:
    """Under torchrun on CPUs (every rank calls it, the gloo process group initialised): for each of
    STRATEGIES_FITTED, [latency s, bytes/s] of cost.comm.comm_seconds's ring model fitted to what
    the strategy adds to the forward and backward of STRATEGY_REFERENCES (trainwise's own step, sharded as the
    trainer shards it) over the same step unsharded, both ranks computing at once. A collective timed alone on idle
    ranks (kernels.collective_fit) leaves out what a step's collectives cost on cores that also compute: DDP's
    reducer runs its hooks and walks the autograd graph, FSDP2 copies each block's parameters in and out of its
    gathered buffer, casts them, waits for the slower rank at every block, and gloo's threads share the cores with
    the kernels: several times what the link timed alone prices (benchmarks/RESULTS.md, "The optimizer's operands in
    memory; collectives as a step runs them"). Unsharded and sharded steps are
    timed in turns, one step of each after another, `turns` times after a warm-up, each the fastest of its
    steps on the slower rank: a VM's speed moves over seconds, and steps taken in turns draw their fastest from
    the same stretches of it. A reference whose sharded step still reads no slower is timed again
    (STRATEGY_PASSES). Returns
    {strategy: {"link": [s, bytes/s], "rows": [[L, B, excess s], ...]}}: excess = L x latency + B /
    bandwidth (L, B: comm_seconds at unit latency and at unit inverse bandwidth)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows: dict[str, list] = {s: [] for s in STRATEGIES_FITTED}
    with torch.random.fork_rng():  # a run that calibrates here draws the same numbers as one that did not
        for model, batch, seq in STRATEGY_REFERENCES:
            _strategy_rows(ModelConfig(**model, max_seq_len=seq), batch, seq, rank, world, turns, rows)
    out = {}
    for strategy, table in rows.items():
        latency, inv_bw = fit_linear([(r[:2], max(r[2], 1e-6)) for r in table])
        out[strategy] = {"link": [latency, 1.0 / inv_bw if inv_bw > 0 else 1e30], "rows": table}
    return out


def _strategy_rows(cfg: ModelConfig, batch: int, seq: int, rank: int, world: int, turns: int,
                   rows: dict[str, list]) -> None:
    """One reference of strategy_links: its unsharded and sharded steps timed in turns, a row per strategy."""
    cpu = torch.device("cpu")
    precision, _ = resolve_precision("auto", cpu)
    batches = random_batches(cfg.vocab_size, batch, seq, 1, cpu, seed=rank)
    steps_of = {}
    for strategy in ("none", *STRATEGIES_FITTED):
        torch.manual_seed(0)
        steps_of[strategy] = build_step(build_model(cfg, cpu), TrainConfig(), cpu, precision, optimizer=False,
                                        dist=Dist(strategy, rank, world, rank) if strategy != "none" else None)
        steps_of[strategy](batches)  # warm-up
    best = dict.fromkeys(steps_of, float("inf"))
    for _ in range(STRATEGY_PASSES):
        for _ in range(turns):
            for strategy, step in steps_of.items():
                dist.barrier()
                start = time.perf_counter()
                step(batches)
                best[strategy] = min(best[strategy], time.perf_counter() - start)
        slowest = torch.tensor([best[s] for s in steps_of], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slower rank is what a step waits for
        seconds = dict(zip(steps_of, slowest.tolist()))  # the same on every rank, and so is the test below
        if all(seconds[s] > seconds["none"] for s in STRATEGIES_FITTED):
            break
    n = count_params(cfg).total
    gathered = DTYPE_BYTES[precision] * n  # FSDP2 gathers the parameters in the compute dtype
    tensors = [4 * numel for numel in param_numels(cfg)]  # fp32 gradients: DDP's buckets
    for strategy in STRATEGIES_FITTED:
        terms = [sum(comm_seconds(strategy, world, 4 * n, 4 * n, cfg.n_layers, 1, link, gathered, 1, tensors).values())
                 for link in ([1.0, float("inf")], [0.0, 1.0])]
        rows[strategy].append([*terms, max(seconds[strategy] - seconds["none"], 0.0)])
