"""Predicted vs measured: the planner's numbers held against one real step of the run.

`measure_step` runs two extra training steps on a copy of the trained model and optimizer (the run's
weights, optimizer state, sampler and RNG are untouched), one under the FLOP counter and one under the
memory tracker (by category). The peak is the run's own last step where the loop measured it
(measure.memtrack.StepPeakMeter: compiled when the run compiles). `build_verify` pairs those with the plan
and the logged step times into verify.json (docs/ARCHITECTURE.md, "verify.json"): every entry
{"predicted", "measured", "error"}, error = measured / predicted - 1.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from trainwise import rundir
from trainwise.config import RunConfig, load_config
from trainwise.cost.steptime import PROBE_WARN, probed_seconds
from trainwise.errors import TrainwiseError
from trainwise.measure.flopcount import FlopCount, count_train_step
from trainwise.measure.memtrack import MemoryBreakdown, track_train_step
from trainwise.planner.plan import plan_for_run
from trainwise.runtime.step import TrainingStep, build_model, build_step, random_batches


@dataclass
class StepMeasurement:
    flops: FlopCount
    memory: MemoryBreakdown


def fresh_copy(cfg: RunConfig, model: torch.nn.Module, optimizer_state: dict | None, device: torch.device,
               precision: str) -> TrainingStep:
    """A new step (runtime.step's builder, eager: the tracker cannot see inside compiled code) whose model
    holds the run's weights and whose optimizer the run's states (`optimizer_state`; None: a fresh one),
    so a step on it changes nothing of the run. (deepcopy would keep checkpoint wrappers bound to the
    original.)"""
    copy = build_model(cfg.model, device)
    copy.load_state_dict(model.state_dict())
    return build_step(copy, cfg.train, device, precision, optimizer_state=optimizer_state)


def measure_step(cfg: RunConfig, model: torch.nn.Module, optimizer_state: dict | None, device: torch.device,
                 precision: str) -> StepMeasurement:
    """FLOPs and memory of one training step (K micro-batches, clip, optimizer step) on a copy.
    Token ids are seeded random ids of the run's shapes: FLOPs and memory depend on shapes only."""
    t = cfg.train
    batches = random_batches(cfg.model.vocab_size, t.micro_batch, t.seq_len, t.grad_accum_steps, device, t.seed)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        step = fresh_copy(cfg, model, optimizer_state, device, precision)
        if not step.optimizer.state:  # no states yet: take one step so they exist
            step(batches[:1])
        # FLOPs and memory on two steps: FlopCounterMode's module tracking keeps each micro-batch's
        # checkpointed activations alive into the next, which made a K = 4, full-checkpointing step
        # read 2x its true peak.
        flops = count_train_step(step, batches)
        memory = track_train_step(step, batches)
    return StepMeasurement(flops, memory)


def steady_step_time(run_dir: Path) -> tuple[float | None, int]:
    """Mean logged step_time_s of a run over the steady state: every training row after the first log
    interval (which holds start-up: allocation, kernel selection), but those whose steps ran under the peak
    meter (`metered_steps`: its profiler slows them) where others remain. Returns (mean, rows used)."""
    rows = [r for r in rundir.read_metrics(run_dir) if "step_time_s" in r]
    rows = rows[1:] or rows
    steady = [r["step_time_s"] for r in ([r for r in rows if not r.get("metered_steps")] or rows)]
    return (statistics.fmean(steady) if steady else None), len(steady)


def entry(predicted: float | None, measured: float | None) -> dict:
    """A verify.json entry (docs/ARCHITECTURE.md, "verify.json"): {"predicted", "measured", "error"},
    error = measured / predicted - 1."""
    error = None
    if predicted and measured is not None:
        error = measured / predicted - 1
    return {"predicted": predicted, "measured": measured, "error": error}


def build_verify(cfg: RunConfig, plan, measured: dict, step_time_s: float | None, device: str,
                 peak_source: str, probe: dict | None = None) -> dict:
    """verify.json from a plan (planner.plan.Plan of this run) and the measured numbers:
    measured = {"flops_per_step", "model_flops_per_step", "peak_memory_bytes", "memory_bytes": {...}}."""
    t = cfg.train
    tokens_per_step = t.tokens_per_step
    flops_pred = plan.flops_per_token * tokens_per_step  # what runs, recompute included (HFU)
    model_flops_pred = plan.model_flops_per_token * tokens_per_step
    peak = plan.hardware.peak_flops
    time_pred = plan.step_seconds  # the step-time model where the device is profiled, else the assumed MFU
    mfu_meas = model_flops_pred / step_time_s / peak if step_time_s else None
    mem = measured["memory_bytes"]
    s = plan.states
    out = {
        "flops_per_step": entry(flops_pred, measured["flops_per_step"]),
        "peak_memory_bytes": entry(plan.peak_bytes, measured["peak_memory_bytes"]),
        "step_time_s": entry(time_pred, step_time_s),
        "mfu": entry(plan.mfu, mfu_meas),
        "time_source": plan.time_source,  # where predicted step time and MFU came from (plan.json's time.source)
        "memory_bytes": {
            "params": entry(s.params + s.master, mem["params"]),
            "grads": entry(s.grads, mem["grads"]),
            "optimizer": entry(s.optimizer, mem["optimizer"]),
            "activations": entry(plan.activations_bytes, mem["activations"]),
        },
        "device": device,
        "notes": [
            "error = measured / predicted - 1",
            f"FLOPs: planner (matmuls; backward = 2 x forward; recompute of {t.activation_checkpointing} "
            "checkpointing included) vs trainwise.measure.flopcount on one real step",
            (f"step time predicted by the step-time model ({plan.time_source}): the step's operators priced by "
             f"the device profile + eager overhead + communication (`trainwise plan --explain`); "
             if plan.step is not None else
             f"step time predicted = FLOPs per step / (peak {peak:.4g} FLOP/s x assumed MFU {plan.mfu}); ")
            + f"MFU against peak {peak:.4g} FLOP/s: {peak_source}",
            "step time measured = mean logged step_time_s after the first log interval",
            "memory by category measured with MemTracker on one extra real step of an eager copy of the "
            "trained model; peak predicted = cost.rank_memory.rank_peak",
            "peak measured = " + ("the peak allocated bytes of the run's last step as it ran (StepPeakMeter: "
                                  "CUDA allocator, or resident storages + the CPU allocator's events in "
                                  "torch.profiler)" if measured.get("peak_source") == "run"
                                  else "MemTracker's peak on the copy"),
        ],
    }
    out["peak_memory"] = {"source": measured.get("peak_source", "copy"),
                          "tracker_copy_bytes": measured.get("tracker_peak_bytes")}
    if probe is not None and plan.step is not None:  # the machine as probed (cost.steptime.settled_probe)
        out["step_time_probed_s"] = {**entry(probed_seconds(plan.step, probe), step_time_s), "probe": probe}
    if t.activation_checkpointing != "none":
        hfu = flops_pred / step_time_s / peak if step_time_s else None
        out["hfu"] = entry(plan.mfu * flops_pred / model_flops_pred, hfu)
    if measured.get("cuda_max_allocated_bytes") is not None:
        out["cuda"] = {"max_allocated_bytes": measured["cuda_max_allocated_bytes"],
                       "max_reserved_bytes": measured["cuda_max_reserved_bytes"]}
    return out


def measured_from_step(m: StepMeasurement, step_peak_bytes: int | None = None) -> dict:
    """The measured numbers of verify.json. peak_memory_bytes: the run's own last step (step_peak_bytes,
    measure.memtrack.StepPeakMeter: compiled when the run compiles, with its real scaler and wrappers)
    where the loop measured it, else MemTracker's peak on the copy."""
    mem = m.memory
    peak = mem.peak_bytes if step_peak_bytes is None else step_peak_bytes
    return {"flops_per_step": m.flops.total, "peak_memory_bytes": peak, "tracker_peak_bytes": mem.peak_bytes,
            "peak_source": "copy" if step_peak_bytes is None else "run",
            "memory_bytes": {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
                             "activations": mem.activations},
            "cuda_max_allocated_bytes": mem.cuda_max_allocated_bytes,
            "cuda_max_reserved_bytes": mem.cuda_max_reserved_bytes}


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "FLOPs":
        return f"{value:.4g} FLOPs"
    if unit == "bytes":
        return f"{value / 1e6:,.2f} MB ({value / 2**20:,.2f} MiB)"
    if unit == "s":
        return f"{value:.4g} s"
    return f"{value:.2%}"


def probe_line(probed: dict, calibrated_s: float) -> str:
    """What the speed probe at the start of a run found (probed: the probe's ratios and its prediction; with
    "readings", the start's and the end's, cost.steptime.settled_probe)."""
    readings = probed.get("readings", [])
    where = (f"speed probes at the start and the end read {', '.join(f'{r - 1:+.1%}' for r in readings)}; the one "
             f"nearest the calibration, at {probed['at']}" if len(readings) > 1 else f"speed probe at {probed['at']}")
    text = (f"{where}: the calibration's reference steps ran {probed['ratio'] - 1:+.1%} against "
            f"the calibration (eager overhead {probed['overhead_ratio'] - 1:+.1%}, kernels "
            f"{probed['kernel_ratio'] - 1:+.1%}): {probed['step_seconds']:.4g} s per step predicted for the machine "
            f"as probed, {calibrated_s:.4g} s as calibrated")
    if probed.get("load_factor", 1.0) != 1.0:  # measure.load.load_factor
        text += (f"; other processes kept {probed['others_share']:.0%} of the cores busy meanwhile, which a step "
                 f"waiting on its slowest thread pays x{probed['load_factor']:.3g} (in the probed prediction)")
    if abs(probed["ratio"] - 1) > PROBE_WARN:  # the band a run reads its probes by (cost.steptime.probed_seconds)
        text += (f"; this machine runs more than {PROBE_WARN:.0%} away from its calibration now: read the probed "
                 "prediction (`trainwise hardware --calibrate` measures it anew)")
    elif len(readings) > 1:
        text += (f"; the start read more than {PROBE_WARN:.0%} away and the end nearer: a move counts only when "
                 "both ends show it, so the calibrated speed stands")
    return text


def format_table(v: dict) -> str:
    rows = [("FLOPs / step", v["flops_per_step"], "FLOPs"), ("peak memory", v["peak_memory_bytes"], "bytes")]
    rows += [(f"  {k}", e, "bytes") for k, e in v["memory_bytes"].items()]
    rows += [("step time", v["step_time_s"], "s")]
    if "step_time_probed_s" in v:
        rows.append(("  as probed", v["step_time_probed_s"], "s"))
    rows.append(("MFU", v["mfu"], "%"))
    if "hfu" in v:
        rows.append(("HFU", v["hfu"], "%"))
    cells = [(name, _fmt(e["predicted"], u), _fmt(e["measured"], u),
              "n/a" if e["error"] is None else f"{e['error']:+.1%}") for name, e, u in rows]
    head = ("quantity", "predicted", "measured", "error")
    w = [max(len(r[i]) for r in cells + [head]) for i in range(4)]
    lines = [f"{head[0]:<{w[0]}}  {head[1]:>{w[1]}}  {head[2]:>{w[2]}}  {head[3]:>{w[3]}}"]
    lines.append("-" * len(lines[0]))
    lines += [f"{a:<{w[0]}}  {b:>{w[1]}}  {c:>{w[2]}}  {d:>{w[3]}}" for a, b, c, d in cells]
    lines.append(f"device: {v['device']}")
    if source := v.get("time_source"):
        lines.append(f"step time and MFU predicted from: {source}"
                     + (" (step-time model, `trainwise plan --explain` itemises it)"
                        if source != "assumed MFU (--mfu)" else ""))
    if probed := v.get("step_time_probed_s"):
        lines.append(probe_line({**probed["probe"], "step_seconds": probed["predicted"]},
                                v["step_time_s"]["predicted"]))
    if speed := v.get("machine_speed"):
        lines.append(f"machine speed: the calibration's reference steps (small models) took {speed['measured']:.4g} s "
                     f"after the run against {speed['predicted']:.4g} s when it was calibrated "
                     f"({speed['error']:+.1%}): this machine's speed has moved by up to that much (small kernels "
                     "move most), which every step-time error above includes")
    return "\n".join(lines)


def _stored_measurements(old: dict) -> dict:
    """What a run's verify.json measured, as build_verify takes it."""
    return {"flops_per_step": old["flops_per_step"]["measured"],
            "peak_memory_bytes": old["peak_memory_bytes"]["measured"],
            "memory_bytes": {k: e["measured"] for k, e in old["memory_bytes"].items()},
            "peak_source": old.get("peak_memory", {}).get("source", "copy"),
            "tracker_peak_bytes": old.get("peak_memory", {}).get("tracker_copy_bytes"),
            "cuda_max_allocated_bytes": old.get("cuda", {}).get("max_allocated_bytes"),
            "cuda_max_reserved_bytes": old.get("cuda", {}).get("max_reserved_bytes")}


def verify_run(run_dir: str | Path) -> dict:
    """Recompute verify.json of a finished run: re-plan from its config.toml, re-read metrics.jsonl,
    keep the measured FLOPs and memory from the stored verify.json."""
    run_dir = Path(run_dir)
    path = run_dir / rundir.VERIFY
    if not rundir.is_run_dir(run_dir):
        why = f"no {rundir.CONFIG} in it" if run_dir.is_dir() else "no such folder"
        raise TrainwiseError(f"'{run_dir}' is not a run directory ({why}); pass a directory `trainwise train --out` "
                             "wrote.")
    if not path.is_file():
        raise TrainwiseError(f"'{run_dir}' holds a run without {rundir.VERIFY}, which `trainwise train` writes at "
                             f"the end of a run: finish it (`trainwise train --resume {run_dir}`), then verify it.")
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        info = old.get("run", {})
        peak_flops, device, measured = info["peak_flops"], old["device"], _stored_measurements(old)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise TrainwiseError(f"{path} is not the verify.json `trainwise train` writes ({type(err).__name__}: "
                             f"{err}): its measurements cannot be read. `trainwise train` writes it at the end of a "
                             "run: train the run again (a new --out) to measure them anew.") from None
    cfg = load_config(run_dir / rundir.CONFIG)
    plan = plan_for_run(cfg, precision=info.get("precision", "fp32"), peak_flops=peak_flops,
                        device="cpu" if device == "cpu" else "cuda" if torch.cuda.is_available() else None,
                        compiled=info.get("compiled", False),
                        world_size=info.get("dp", info.get("world_size", 1)))
    step_time, _ = steady_step_time(run_dir)
    new = build_verify(cfg, plan, measured, step_time, device, info.get("peak_source", "stored"),
                       old.get("step_time_probed_s", {}).get("probe"))
    new["run"] = info
    for key in ("per_rank", "machine_speed"):  # measured when the run ended; kept as the run recorded them
        if key in old:
            new[key] = old[key]
    return new
