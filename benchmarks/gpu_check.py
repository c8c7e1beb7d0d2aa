"""Does the default config train well on this GPU? One look at the real trainer on a CUDA device.

Trains RunConfig() (built-in corpus) for --steps steps through trainwise.trainer.loop.train and prints
steady-state tokens/s and MFU (from metrics.jsonl), peak memory, the SDPA backend that runs, the
precision chosen and the AdamW path; then a short torch.compile run and a short fp16 + GradScaler run.
The GPU is calibrated first (`trainwise hardware --calibrate`: matmul shapes, bandwidth, attention,
optimizer, overhead), and each of the three runs prints the step-time model's predicted step time
against its measured steady state (from its verify.json).
On a CPU (`--device cpu --steps 5`, the smoke test) memory is the trainer's verify.json
peak_memory_bytes and the fp16 run is skipped.

    python benchmarks/gpu_check.py                              # cuda, 100 steps, + compile and fp16 runs
    python benchmarks/gpu_check.py --device cpu --steps 5 --no-compile
    python benchmarks/gpu_check.py --json out.json --set train.micro_batch=32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainwise import rundir
from trainwise.config import RunConfig, apply_overrides, load_config
from trainwise.runtime.precision import autocast
from trainwise.runtime.step import build_model, build_step
from trainwise.trainer.loop import train
from trainwise.verify.verify import steady_step_time


def run(device: str, steps: int, overrides: list[str], out: Path) -> dict:
    """Train for `steps` steps in `out`; the steady-state numbers of its metrics.jsonl and verify.json."""
    base = [f"train.device={device}", f"train.max_steps={steps}", f"train.log_every={max(1, steps // 10)}",
            "train.checkpoint_every=0"]
    cfg = apply_overrides(RunConfig(), base + overrides)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    result = train(cfg, out=out, quiet=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_time_s, n_rows = steady_step_time(out)  # rows after the first log interval, but the metered ones
    tokens_per_s = rows[0]["tokens_per_s"] * rows[0]["step_time_s"] / step_time_s  # tokens per step / time
    verify = json.loads((out / "verify.json").read_text())
    stats = {"steps": steps, "steady_rows": n_rows, "tokens_per_s": tokens_per_s,
             "mfu": rows[0]["mfu"] / rows[0]["tokens_per_s"] * tokens_per_s,  # mfu is linear in tokens/s
             "precision": verify["run"]["precision"], "peak_source": verify["run"]["peak_source"],
             "final_loss": result.train_loss, "val_loss": result.val_loss,
             "verify_peak_memory_bytes": verify["peak_memory_bytes"]["measured"],
             # the step-time model (cost.steptime) against the run's steady state, as verify.json has them
             "step_time_predicted_s": verify["step_time_s"]["predicted"],
             "step_time_measured_s": verify["step_time_s"]["measured"],
             "step_time_error": verify["step_time_s"]["error"], "time_source": verify.get("time_source")}
    if device.startswith("cuda"):  # the whole run: training, evaluation, sampling and verify's extra step
        stats["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        stats["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    scaler = [json.loads(p.read_text()).get("scaler") for p in (out / "checkpoints").glob("*/trainer.json")]
    if scaler and scaler[0]:
        stats["grad_scaler_scale"] = scaler[0]["scale"]
    return stats


def sdpa_backend(run_dir: Path, device: str, precision: str) -> dict:
    """Which attention kernels one forward of the run's model launches (torch.profiler), and the flags."""
    cfg = load_config(run_dir / rundir.CONFIG)
    model = build_model(cfg.model, device)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len), device=device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.no_grad(), autocast(torch.device(device), precision):
        model(x, x)  # warm-up: the profiled forward sees steady kernels
        with torch.profiler.profile(activities=activities) as prof:
            model(x, x)
    names = sorted({e.key for e in prof.key_averages()
                    if any(k in e.key.lower() for k in ("flash", "efficient_attention", "mem_eff", "cudnn_attention",
                                                         "attention_math", "fmha"))})
    joined = " ".join(names).lower()
    kernel = ("flash" if "flash" in joined else "efficient" if "efficient" in joined or "mem_eff" in joined or
              "fmha" in joined else "cudnn" if "cudnn" in joined else "math")
    flags = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
             for name in ("flash", "mem_efficient", "math", "cudnn")
             if hasattr(torch.backends.cuda, f"{name}_sdp_enabled")}
    return {"backend": kernel, "profiled_ops": names, "enabled_flags": flags}


def optimizer_path(device: str) -> str:
    """What the trainer's step builder picks for parameters on this device (runtime.optim.build_optimizer)."""
    cfg = RunConfig()
    dev = torch.device(device)
    d = build_step(build_model(cfg.model, dev), cfg.train, dev, "fp32").optimizer.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"


def mem(n_bytes: int | None) -> str:
    return "n/a" if n_bytes is None else f"{n_bytes / 1e6:,.1f} MB ({n_bytes / 2**20:,.1f} MiB)"


def report(r: dict) -> None:
    m = r["main"]
    print(f"device           {r['device_name']}")
    print(f"precision        {m['precision']}   (MFU peak: {m['peak_source']})")
    print(f"tokens/s         {m['tokens_per_s']:,.0f}   steady state over {m['steady_rows']} logged rows "
          f"of {m['steps']} steps")
    print(f"MFU              {m['mfu']:.1%}")
    if "cuda_max_allocated_bytes" in m:
        print(f"peak allocated   {mem(m['cuda_max_allocated_bytes'])}   (torch.cuda.max_memory_allocated)")
        print(f"peak reserved    {mem(m['cuda_max_reserved_bytes'])}   (torch.cuda.max_memory_reserved)")
    print(f"peak memory      {mem(m['verify_peak_memory_bytes'])}   (verify.json peak_memory_bytes, one step)")
    s = r["sdpa"]
    print(f"SDPA backend     {s['backend']}   ops: {', '.join(s['profiled_ops']) or 'none matched'}")
    print(f"SDPA flags       {' '.join(f'{k}={v}' for k, v in s['enabled_flags'].items())}")
    print(f"AdamW            {r['optimizer']}")
    print(f"loss             train {m['final_loss']:.3f}, val {m['val_loss']:.3f}")
    for name in ("compile", "fp16"):
        c = r[name]
        if "skipped" in c:
            print(f"{name:<16} skipped: {c['skipped']}")
            continue
        extra = f", GradScaler scale {c['grad_scaler_scale']:g}" if "grad_scaler_scale" in c else ""
        print(f"{name:<16} ok: {c['tokens_per_s']:,.0f} tokens/s over {c['steps']} steps "
              f"({c['tokens_per_s'] / m['tokens_per_s']:.2f}x the main run), loss {c['final_loss']:.3f}{extra}")
    print(f"step-time model  (calibration: {r['calibration']})")
    print(f"  {'run':<8} {'predicted s':>11} {'measured s':>10} {'error':>7}  source")
    for name in ("main", "compile", "fp16"):
        c = r[name]
        if "skipped" not in c and c.get("step_time_predicted_s") and c.get("step_time_measured_s"):
            print(f"  {name:<8} {c['step_time_predicted_s']:>11.4g} {c['step_time_measured_s']:>10.4g} "
                  f"{c['step_time_error']:>+7.1%}  {c['time_source']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    p.add_argument("--steps", type=int, default=100, help="steps of the main run (default 100)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also run 20 steps with train.compile=true (default: on)")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="calibrate the GPU first (`trainwise hardware --calibrate`), so that the step-time model's "
                        "predictions are calibrated; --no-calibrate shows the table defaults (default: on)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="also write the results as JSON ('-': stdout)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for every run, as in `trainwise train --set`")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("gpu_check: this PyTorch sees no CUDA GPU; use --device cpu for the smoke test.", file=sys.stderr)
        return 2
    calibration = "not asked (--no-calibrate): a GPU plans from its table entry"
    if cuda and args.calibrate:  # the step-time model then prices this GPU as measured, not from its table
        from trainwise.measure.calibrate import calibrate

        t0 = time.perf_counter()
        cal = calibrate(args.device)
        calibration = (f"{time.perf_counter() - t0:.0f} s; measured bf16 peak {cal['peak_flops']['bf16'] / 1e12:,.1f} "
                       f"TFLOP/s, copy bandwidth {cal['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s")
    elif not cuda:
        calibration = "this CPU's (the trainer calibrates it on its first run)"
    results = {"device": args.device, "calibration": calibration,
               "device_name": torch.cuda.get_device_name(args.device) if cuda else "cpu",
               "torch": torch.__version__, "optimizer": optimizer_path(args.device)}
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        results["main"] = run(args.device, args.steps, args.set, Path(tmp) / "main")
        results["sdpa"] = sdpa_backend(Path(tmp) / "main", args.device, results["main"]["precision"])
        results["compile"] = (run(args.device, 20, args.set + ["train.compile=true"], Path(tmp) / "compile")
                              if args.compile else {"skipped": "--no-compile"})
        results["fp16"] = (run(args.device, 10, args.set + ["train.precision=fp16"], Path(tmp) / "fp16")
                           if cuda else {"skipped": "fp16 + GradScaler needs a CUDA GPU"})
    report(results)
    if args.json:
        text = json.dumps(results, indent=1)
        sys.stdout.write(text + "\n") if args.json == "-" else Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
