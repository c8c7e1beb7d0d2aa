"""Predicted vs measured steady-state step time on this CPU, over 38 training configurations.

Each configuration is planned with the step-time model (`trainwise plan --gpu cpu`: cost.steptime on
this machine's calibration) and then run for real: single-process ones in this process, through the
trainer's own step (trainwise.runtime.step.train_step, compiled with train.parallelize.apply_compile
where marked), built afresh for each of --rounds rounds over all configurations (one model in the
process at a time, as in a run), two warm-up steps, each keeping its fastest round's median step;
ddp/fsdp ones through `torchrun --nproc_per_node 2 -m trainwise train` (gloo, one thread per rank; the
collectives calibrated first, `torchrun --nproc_per_node 2 -m trainwise hardware --calibrate`), the lower
quartile of the logged step times after the first two.
error = measured / predicted - 1, against the prediction as calibrated and against the prediction for
the machine as probed (cost.steptime.probed_seconds: the trainer's speed probe of the calibration's
reference steps, taken right before each round of each configuration, as a run takes it right before
its steps, and again after the round where it read outside the band, as a run does at its end:
cost.steptime.settled_probe; a figure is paired with its round's probe; torchrun ones, whose ranks run
one thread each, the calibrated prediction). The probe moves a prediction beyond the band a run's
closing table reads it by, cost.steptime.PROBE_WARN.

    python benchmarks/time_model.py                 # all configurations (~5-10 min on a quiet 2-core CPU)
    python benchmarks/time_model.py --only 1,19     # a few, by number
    python benchmarks/time_model.py --json out.json
    python benchmarks/time_model.py --stability 5   # five calibrations in a row: each figure's spread
    python benchmarks/time_model.py --fit-compiled  # the compiled step's element-wise factor, on other configs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainwise.config import ModelConfig, RunConfig, TrainConfig, apply_overrides, save_config
from trainwise.cost.layout import Layout
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import Machine, Run
from trainwise.cost.steptime import PROBE_WARN, probed_seconds, settled_probe
from trainwise.hardware.cache import cached_link, cpu_model
from trainwise.measure.calibrate import calibrate
from trainwise.measure.reference import probe_speed
from trainwise.planner.plan import plan_for_run, plan_run
from trainwise.runtime.allocator import keep_freed_memory
from trainwise.runtime.step import build_model, build_step, random_batches

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=704, max_seq_len=512)
TINY = dict(vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=192, max_seq_len=512)
MEDIUM = dict(vocab_size=4096, d_model=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_hidden=1024, max_seq_len=512)
WIDE = dict(vocab_size=4096, d_model=512, n_layers=2, n_heads=8, n_kv_heads=8, ffn_hidden=1408, max_seq_len=512)
GPT2ISH = dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden=1024, max_seq_len=512,
               activation="gelu", norm="layernorm", position="learned", bias=True)
MOE = dict(SMALL, n_experts=4, top_k=2, expert_ffn_hidden=352)
MOE8 = dict(SMALL, n_experts=8, top_k=2, expert_ffn_hidden=352, max_seq_len=1024)
LONG = dict(SMALL, max_seq_len=1024)
SHALLOW_WIDE = dict(vocab_size=4096, d_model=768, n_layers=1, n_heads=12, n_kv_heads=4, ffn_hidden=2048,
                    max_seq_len=512)
DEEP_NARROW = dict(vocab_size=4096, d_model=128, n_layers=12, n_heads=4, n_kv_heads=2, ffn_hidden=384,
                   max_seq_len=512)


@dataclass
class Case:
    name: str
    model: dict
    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    checkpointing: str = "none"
    precision: str = "bf16"
    compiled: bool = False
    strategy: str = "none"  # ddp / fsdp: 2 gloo ranks under torchrun
    results: dict = field(default_factory=dict)


CASES = [
    Case("small", SMALL, 16, 256), Case("small fp32", SMALL, 16, 256, precision="fp32"),
    Case("small B4", SMALL, 4, 256), Case("small T128", SMALL, 16, 128),
    Case("small K2", SMALL, 8, 256, grad_accum=2), Case("small selective", SMALL, 16, 256, checkpointing="selective"),
    Case("small full", SMALL, 16, 256, checkpointing="full"),
    Case("small fp32 full K2", SMALL, 8, 256, 2, "full", "fp32"),
    Case("tiny", TINY, 8, 128), Case("tiny fp32", TINY, 32, 64, precision="fp32"),
    Case("medium", MEDIUM, 8, 256), Case("medium fp32", MEDIUM, 4, 256, precision="fp32"),
    Case("medium T512", MEDIUM, 4, 512), Case("wide fp32", WIDE, 8, 128, precision="fp32"),
    Case("small B2 T64", SMALL, 2, 64), Case("moe", MOE, 8, 256), Case("moe fp32", MOE, 4, 128, precision="fp32"),
    Case("moe T512", MOE, 4, 512), Case("small compiled", SMALL, 16, 256, compiled=True),
    Case("small fp32 compiled", SMALL, 8, 256, precision="fp32", compiled=True),
    Case("tiny compiled", TINY, 8, 128, compiled=True), Case("medium K4", MEDIUM, 4, 256, grad_accum=4),
    Case("gpt2-style", GPT2ISH, 8, 256), Case("small ddp", SMALL, 8, 256, strategy="ddp"),
    Case("small fsdp", SMALL, 8, 256, strategy="fsdp"),
    Case("tiny ddp fp32", TINY, 8, 128, precision="fp32", strategy="ddp"),
    # settings beyond the defaults: MoE (top-1 and top-2, 4-8 experts, T 128-1024), fp32 shapes, checkpointing
    # x accumulation, long sequences
    Case("moe E8 top1 T128", dict(MOE8, top_k=1), 16, 128), Case("moe E8 T1024", MOE8, 2, 1024),
    Case("moe E4 top1 T1024", dict(MOE, top_k=1, max_seq_len=1024), 2, 1024),
    Case("moe E8 fp32", MOE8, 4, 256, precision="fp32"),
    Case("shallow-wide fp32", SHALLOW_WIDE, 8, 128, precision="fp32"),
    Case("deep-narrow fp32", DEEP_NARROW, 8, 256, precision="fp32"),
    Case("small selective K4", SMALL, 4, 256, 4, "selective"), Case("medium full K2", MEDIUM, 4, 256, 2, "full"),
    Case("small full K4", SMALL, 4, 256, 4, "full"),
    Case("deep-narrow selective K2", DEEP_NARROW, 8, 256, 2, "selective"),
    Case("small T1024", LONG, 2, 1024), Case("small T1024 full", LONG, 2, 1024, checkpointing="full"),
]


def predict(case: Case):
    """The plan of the configuration: its step_seconds as calibrated and its StepTime (plan.step)."""
    if case.strategy != "none":
        return plan_for_run(run_config(case, 10), case.precision, 0.0, device="cpu", world_size=2)
    return plan_run(Run(ModelConfig(**case.model), micro_batch=case.micro_batch, seq_len=case.seq_len,
                        grad_accum=case.grad_accum, recipe=get_recipe("fp32" if case.precision == "fp32" else "amp"),
                        checkpointing=case.checkpointing, compiled=case.compiled,
                        layout=Layout(micro_batches=case.grad_accum), tokens=1, machine=Machine(gpu="cpu")))


class LocalRun:
    """One single-process configuration, built for a round of measurement: the trainer's step
    (built by trainwise.runtime.step, compiled where marked), two warm-up steps (compile happens in the
    first), then per round the median of the steps of about round_s seconds. Each step gets new token
    ids, as training does (an MoE layer then routes anew every step)."""

    def __init__(self, case: Case):
        cpu = torch.device("cpu")
        torch.manual_seed(0)
        cfg = ModelConfig(**case.model)
        train_step = build_step(build_model(cfg), TrainConfig(activation_checkpointing=case.checkpointing), cpu,
                                case.precision, compile=case.compiled)
        seeds = iter(range(1 << 30))
        self.step = lambda: train_step(random_batches(cfg.vocab_size, case.micro_batch, case.seq_len,
                                                      case.grad_accum, cpu, seed=next(seeds)))
        for _ in range(2):
            self.step()

    def round(self, min_steps: int = 3, round_s: float = 1.0) -> float:
        times, start = [], time.perf_counter()
        while len(times) < min_steps or time.perf_counter() - start < round_s:
            t = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times)


def probed_round(run: LocalRun, references: list[float]) -> tuple[float, dict]:
    """One round of a configuration with the speed probe a run takes: before it, and after it where the
    first reading is outside PROBE_WARN (cost.steptime.settled_probe, as the trainer does)."""
    probe = probe_speed(torch.device("cpu"), references)
    seconds = run.round()
    if abs(probe["ratio"] - 1) > PROBE_WARN:  # the band probed_seconds reads a probe by
        probe = settled_probe(probe, probe_speed(torch.device("cpu"), references))
    return seconds, probe


def run_config(case: Case, steps: int) -> RunConfig:
    sets = [f"train.{k}={v}" for k, v in dict(micro_batch=case.micro_batch, seq_len=case.seq_len, max_steps=steps,
                                             grad_accum_steps=case.grad_accum, precision=case.precision,
                                             activation_checkpointing=case.checkpointing, log_every=1,
                                             eval_every=0, checkpoint_every=0, sample_tokens=8, device="cpu",
                                             compile="true" if case.compiled else "false").items()]
    sets += [f"model.{k}={v}" for k, v in case.model.items() if k != "vocab_size"]
    sets += [f"tokenizer.vocab_size={case.model['vocab_size']}", f"parallel.strategy={case.strategy}"]
    return apply_overrides(RunConfig(), sets)


def measure_torchrun(case: Case, steps: int = 20) -> float:
    """Lower quartile of the logged step times after the first two steps of a 2-rank gloo run of the
    trainer (one run: its steps span the time the rounds of a local configuration span)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "run.toml"
        save_config(run_config(case, steps), cfg_path)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "trainwise", "train", "--config", str(cfg_path), "--out", str(Path(tmp) / "run")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    return statistics.quantiles([r["step_time_s"] for r in rows[2:]], n=4)[0]


# Compiled configurations unlike any of CASES, for --fit-compiled
FIT_COMPILED = [Case("fit bf16", dict(vocab_size=2048, d_model=192, n_layers=3, n_heads=3, n_kv_heads=1, ffn_hidden=512,
                                      max_seq_len=192), 8, 192, compiled=True),
                Case("fit fp32", dict(vocab_size=2048, d_model=192, n_layers=3, n_heads=3, n_kv_heads=1, ffn_hidden=512,
                                      max_seq_len=192), 4, 192, precision="fp32", compiled=True)]


def fit_compiled(rounds: int) -> int:
    """The factor cost.steptime.COMPILED_ELEMENTWISE: measured compiled step = its matmuls + optimizer +
    overhead as predicted + f x its element-wise work priced at eager rates, solved for f on FIT_COMPILED."""
    from trainwise.cost.steptime import op_seconds

    fs = []
    for case in FIT_COMPILED:
        run = LocalRun(case)
        measured = min(run.round() for _ in range(rounds))
        del run
        torch._dynamo.reset()
        plan = plan_run(Run(ModelConfig(**case.model), micro_batch=case.micro_batch, seq_len=case.seq_len,
                            recipe=get_recipe("fp32" if case.precision == "fp32" else "amp"), compiled=True, tokens=1,
                            machine=Machine(gpu="cpu")))
        st, prof = plan.step, plan.hardware.profile
        fused = [t for t in st.ops if t.op.cls not in ("matmul", "attention") and t.op.phase != "optimizer"]
        rest = st.seconds - sum(t.seconds for t in fused)
        # (the plan's: x the factor of the step's compute precision)
        eager = prof.in_step_for(case.precision) * sum(op_seconds(t.op, prof)[0] for t in fused)
        f = (measured - rest) / eager
        fs.append(f)
        print(f"{case.name}: measured {measured:.4f} s = {rest:.4f} s (matmuls, optimizer, overhead) + "
              f"f x {eager:.4f} s (element-wise at eager rates) -> f = {f:.3f}")
    print(f"COMPILED_ELEMENTWISE = {{'fp32': {fs[1]:.2f}, 'bf16': {fs[0]:.2f}}} (CPU {cpu_model()})")
    return 0


def figures(cal: dict) -> dict[str, float]:
    """Every figure of a calibration, flattened: peaks, bandwidth, the profile's rates and overheads."""
    out = {f"peak {k}": v for k, v in cal["peak_flops"].items()}
    out["copy bandwidth"] = cal["bandwidth_bytes_per_s"]
    p = cal["profile"]
    for dt, (_, peak, bw) in p["matmul"].items():
        out[f"matmul {dt} P"], out[f"matmul {dt} BW"] = peak, bw
    for dt, classes in p["elementwise"].items():
        out.update({f"{cls} {dt} BW @{q / 2**20:.2g} MiB": bw for cls, grid in classes.items() for q, bw in grid})
    for dt, phases in p["attention"].items():
        out.update({f"attention {dt} {ph}": v[1] for ph, v in phases.items()})
    out["optimizer s/tensor"], out["optimizer s/param"] = p["optimizer"]
    out["overhead s/step"], out["overhead s/op"] = p["overhead"]
    out["in-step factor"] = p["in_step"]
    out.update({f"in-step factor {prec}": x for prec, x in p.get("in_step_by", {}).items()})
    return out


def stability(n: int) -> int:
    """n calibrations in a row (a fresh cache each): each figure's spread max/min - 1 and the time taken."""
    runs, took = [], []
    for i in range(n):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["TRAINWISE_CACHE"] = tmp
            load = os.getloadavg()[0]
            cal = calibrate("cpu", refresh=True)
            runs.append(figures(cal))
            took.append(cal["calibration_s"])
            print(f"calibration {i + 1}: {cal['calibration_s']:.1f} s, load {load:.2f}, busy={cal.get('busy', False)}, "
                  f"others' share {cal.get('others_share', float('nan')):.0%}", flush=True)
    print(f"{'figure':<34} {'min':>11} {'max':>11} {'spread':>7}")
    worst = 0.0
    for key in runs[0]:
        vals = [r[key] for r in runs]
        spread = max(vals) / min(vals) - 1 if min(vals) > 0 else float("inf")
        worst = max(worst, spread)
        print(f"{key:<34} {min(vals):>11.4g} {max(vals):>11.4g} {spread:>+7.1%}")
    print(f"worst spread {worst:.1%}; calibration took {min(took):.1f}-{max(took):.1f} s")
    return 0


def main() -> int:
    keep_freed_memory()  # as `trainwise train` runs (train.allocator)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated case numbers (1-based)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--rounds", type=int, default=3, help="measurement rounds per local configuration (default 3)")
    ap.add_argument("--fit-compiled", action="store_true", help="instead: fit cost.steptime.COMPILED_ELEMENTWISE")
    ap.add_argument("--stability", type=int, metavar="N", help="instead: N calibrations in a row, each figure's spread")
    args = ap.parse_args()
    if args.stability:
        return stability(args.stability)
    if args.fit_compiled:
        return fit_compiled(args.rounds)
    cases = [CASES[int(i) - 1] for i in args.only.split(",")] if args.only else CASES
    load0 = os.getloadavg()
    t0 = time.time()
    calibrate("cpu")
    if any(c.strategy != "none" for c in cases):
        calibrate("cpu", threads=1)  # what each of the 2 torchrun ranks runs with (OMP_NUM_THREADS=1)
        if cached_link("gloo", 2) is None:  # the collectives, as a torchrun run measures them when it finds none
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "trainwise", "hardware", "--calibrate"], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                           check=True, capture_output=True, timeout=600)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}; load average at start "
          f"{load0[0]:.2f} (1 min); calibration ready after {time.time() - t0:.0f} s")
    references = calibrate("cpu")["profile"]["probe_baseline_s"]
    print(f"{'#':>2} {'config':<24} {'B':>3} {'T':>4} {'K':>2} {'ckpt':<9} {'prec':<4} {'comp':<4} {'strategy':<8} "
          f"{'calibrated s':>12} {'probed s':>9} {'measured s':>10} {'err cal':>7} {'err probed':>10} {'load':>5}")
    # Rounds: every local configuration is measured ROUNDS times, one after the other, and keeps its
    # fastest round's median. This machine's speed drifts by up to 30% over seconds (the same step, run
    # again in the same process: 0.37-0.50 s); interference only ever adds time, so the fastest round is
    # the steady state, as the calibration's lower quartiles are.
    # (A compiled configuration is measured in its rounds right after it is built: building the next one
    # resets dynamo, which would recompile it inside a round.)
    # Each configuration's round comes right after a speed probe (~1 s), which its figure is paired
    # with: the machine's fast and slow states last seconds to tens of seconds, so only a probe next to
    # the steps describes them (one probe per round, a minute before some of its configurations, read
    # 1.16 when they ran in the fast state).
    rounds: dict[int, list[tuple[float, dict]]] = {}
    for case in cases:
        if case.strategy == "none" and case.compiled:
            run = LocalRun(case)
            rounds[id(case)] = []
            for _ in range(args.rounds):
                rounds[id(case)].append(probed_round(run, references))
            del run
            torch._dynamo.reset()
    # Each eager configuration is built afresh for each of its rounds and dropped after it, so that the
    # process holds one model at a time, as a run's does: with all of them alive at once, the largest
    # step (`small`, B16 x T256) read 0.40-0.56 s in every round, against 0.29-0.31 s with one or two
    # configurations in the process (AMX Xeon, 2026-12-01; benchmarks/RESULTS.md, "Operands in memory").
    local = [c for c in cases if c.strategy == "none" and not c.compiled]
    rounds.update({id(c): [] for c in local})
    for _ in range(args.rounds):
        for case in local:
            run = LocalRun(case)
            rounds[id(case)].append(probed_round(run, references))
            del run
    probes = [p for r in rounds.values() for _, p in r]
    errors, probed_errors, moe_errors = [], [], []
    for case in cases:
        i = CASES.index(case) + 1
        plan = predict(case)
        predicted = plan.step_seconds
        load = os.getloadavg()[0]
        if case.strategy != "none":
            measured, probe, probed = measure_torchrun(case), None, predicted
        else:
            measured, probe = min(rounds[id(case)], key=lambda r: r[0])
            probed = probed_seconds(plan.step, probe)
        err, err_probed = measured / predicted - 1, measured / probed - 1
        errors.append(abs(err))
        probed_errors.append(abs(err_probed))
        if case.model.get("n_experts"):
            moe_errors.append(abs(err_probed))
        case.results = {"predicted_s": predicted, "probed_s": probed, "measured_s": measured, "error": err,
                        "error_probed": err_probed, "probe_ratio": probe and probe["ratio"], "load_1min": load,
                        "rounds_s": [r for r, _ in rounds.get(id(case), [])]}
        print(f"{i:>2} {case.name:<24} {case.micro_batch:>3} {case.seq_len:>4} {case.grad_accum:>2} "
              f"{case.checkpointing:<9} {case.precision:<4} {'yes' if case.compiled else 'no':<4} {case.strategy:<8} "
              f"{predicted:>12.4f} {probed:>9.4f} {measured:>10.4f} {err:>+7.1%} {err_probed:>+10.1%} {load:>5.2f}",
              flush=True)
    ratios = sorted(p["ratio"] for p in probes)
    if ratios:
        print(f"speed probes before the rounds (reference steps now / at calibration): {len(ratios)}, "
              f"min {ratios[0]:.3f}, median {statistics.median(ratios):.3f}, max {ratios[-1]:.3f}")
    print(f"|error| against the probed prediction: median {statistics.median(probed_errors):.1%}, worst "
          f"{max(probed_errors):.1%} over {len(probed_errors)} configs"
          + (f"; MoE median {statistics.median(moe_errors):.1%} over {len(moe_errors)}" if moe_errors else ""))
    print(f"|error| against the calibrated prediction: median {statistics.median(errors):.1%}, "
          f"worst {max(errors):.1%}; load average at end {os.getloadavg()[0]:.2f}; {time.time() - t0:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "probes": probes,
                                               "cases": [{"name": c.name, **c.results} for c in cases]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
