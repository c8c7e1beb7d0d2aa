"""`trainwise plan`, `trainwise mem` and `trainwise hardware`: a thin layer over trainwise.cost."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainwise.config import ModelConfig
from trainwise.cost.hardware import ACCELERATORS
from trainwise.cost.memory import OPTIMIZER_MOMENTS, RECIPE_ALIASES, RECIPES, parse_bytes, tensor_bytes
from trainwise.cost.plan import fit, fmt_bytes, global_batch_sequences, plan_run
from trainwise.cost.time import DEFAULT_MFU
from trainwise.errors import TrainwiseError

PLAN_EXAMPLES = """examples:
  trainwise plan --model llama-3-8b --tokens 15e12 --gpu h100 --gpus 1024 --zero 3 --seq-len 8192
  trainwise plan --params 1e9 --tokens 1e10 --peak-flops 100e12 --precision fp32 --json
  trainwise plan --model config.json --tokens 1e11 --gpu a100-80gb --fit --global-batch 512
  trainwise plan --model config.json --tokens 1e11          (no hardware: everything but time)
  trainwise plan --model llama-3-8b --fit --memory-budget 80GiB --global-batch-tokens 4e6 --seq-len 8192
"""


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number (e.g. 1e10)") from None


def _int(text: str) -> int:
    value = _number(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"'{text}' must be a whole number")
    return int(value)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="parameters, FLOPs, memory and time of a run, before running it",
                              epilog=PLAN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="preset name, trainwise TOML, or Hugging Face config.json")
    p.add_argument("--params", type=_number, help="parameter count N alone (6ND rule; activations unknown)")
    p.add_argument("--tokens", type=_number, default=None, help="training tokens D")
    p.add_argument("--seq-len", type=_int, help="sequence length T")
    p.add_argument("--micro-batch", type=_int, help="sequences per micro-batch B")
    p.add_argument("--grad-accum", type=_int, help="gradient accumulation steps K")
    p.add_argument("--precision", help=f"recipe: {', '.join(list(RECIPES) + list(RECIPE_ALIASES))}")
    p.add_argument("--optimizer", choices=list(OPTIMIZER_MOMENTS), help="adamw, sgd, sgd-momentum")
    p.add_argument("--checkpointing", choices=["none", "selective", "full"])
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage (FSDP = 3)")
    p.add_argument("--tp", type=_int, default=1)
    p.add_argument("--pp", type=_int, default=1)
    p.add_argument("--gpus", type=_int, default=1)
    p.add_argument("--gpu", help="accelerator name (see `trainwise hardware`)")
    p.add_argument("--peak-flops", type=_number, help="peak FLOP/s per device (overrides --gpu)")
    p.add_argument("--bandwidth", type=_number, help="memory bandwidth, bytes/s")
    p.add_argument("--memory", help="device memory capacity (bytes or 80GiB)")
    p.add_argument("--memory-budget", help="per-device budget for `fits` (bytes, 80GiB or 80GB)")
    p.add_argument("--mfu", type=_number, default=None,
                   help="what-if: time at this model FLOP utilisation instead of the step-time model (which "
                        f"prices each operator on --gpu cpu or a table GPU; else {DEFAULT_MFU} is assumed)")
    p.add_argument("--price", type=_number, help="$ per device-hour")
    p.add_argument("--causal-halving", action="store_true", help="halve attention score/value FLOPs (causal)")
    p.add_argument("--fit", action="store_true", help="search micro-batch, grad-accum, checkpointing, ZeRO")
    p.add_argument("--global-batch", type=_int, help="--fit target, in sequences")
    p.add_argument("--global-batch-tokens", type=_number,
                   help="--fit target, in tokens (rounded to whole sequences, and said so)")
    p.add_argument("--json", action="store_true", help="print JSON only (SI units)")
    p.add_argument("--explain", action="store_true", help="print each formula with the numbers substituted")
    p.add_argument("--simulate", action="store_true",
                   help="also run one training step on fake tensors and print tracked vs analytic memory")
    p.set_defaults(func=cmd_plan)

    m = subparsers.add_parser("mem", help="bytes of one tensor",
                              epilog="example:\n  trainwise mem --shape 8,1024,4096 --dtype bf16",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--shape", required=True, help="comma-separated sizes, e.g. 8,1024,4096")
    m.add_argument("--dtype", default="fp32")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_mem)

    h = subparsers.add_parser("hardware", help="the table of known accelerators")
    h.add_argument("--json", action="store_true")
    h.add_argument("--calibrate", action="store_true",
                   help="measure this machine's matmul peak (fp32, bf16) and memory bandwidth, and cache it")
    h.set_defaults(func=cmd_hardware)


def load_model(spec: str) -> tuple[ModelConfig, dict]:
    """Preset name, .toml (trainwise config, returns its [train] section too) or config.json."""
    from trainwise.config import load_config
    from trainwise.hf_config import load_hf_config
    from trainwise.presets import PRESETS, get_preset

    path = Path(spec)
    if spec in PRESETS:
        return get_preset(spec), {}
    if spec.endswith(".toml"):
        from trainwise.cost.plan import train_settings

        cfg = load_config(path)
        return cfg.model, {**train_settings(cfg.train), "tokens": cfg.train.max_steps * cfg.train.tokens_per_step}
    if spec.endswith(".json") or path.is_file():
        return load_hf_config(path), {}
    return get_preset(spec), {}  # raises with the closest preset names


def cmd_plan(args: argparse.Namespace) -> int:
    model, train = (load_model(args.model) if args.model else (None, {}))
    run_tokens = train.pop("tokens", None)  # a trainwise TOML knows its run length
    if args.tokens is None and run_tokens and not args.simulate:
        args.tokens = run_tokens
    if model is None and args.params is None:
        raise TrainwiseError("give --model PRESET|FILE or --params N.")
    if args.tokens is None and args.simulate:
        args.tokens = 1.0  # --simulate is about one step; time figures then cover one token
        if not args.gpu and not args.peak_flops:
            args.peak_flops = 1e12  # no time figures are shown; any peak will do
    if args.tokens is None and not args.fit:
        raise TrainwiseError("give --tokens D, the number of training tokens.")
    run = dict(seq_len=2048 if model is None else min(2048, model.max_seq_len), micro_batch=1, grad_accum=1,
               precision="bf16", optimizer="adamw", checkpointing="none")
    run.update(train)
    for key in run:
        if getattr(args, key, None) is not None:
            run[key] = getattr(args, key)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    hw = dict(gpu=args.gpu, peak_flops=args.peak_flops, tp=args.tp, pp=args.pp, gpus=args.gpus, mfu=args.mfu,
              causal_halving=args.causal_halving)
    if args.fit:
        return _cmd_fit(args, model, run, budget, hw)
    plan = plan_run(model, params_count=args.params if model is None else None, tokens=args.tokens, zero=args.zero,
                    bandwidth=args.bandwidth, memory=parse_bytes(args.memory) if args.memory else None,
                    memory_budget=budget, price=args.price, **run, **hw)
    if args.simulate:
        return _cmd_simulate(args, model, run, plan)
    scaling = _scaling_prediction(args.model, model, args.tokens)
    if args.json:
        print(json.dumps({**plan.to_json(), **({"predicted_loss": scaling} if scaling else {})}, indent=2))
    elif args.explain:
        print(plan.explain())
    else:
        print(_plan_table(plan))
    if scaling and not args.json:
        lo, hi = scaling["loss_p5_p95"]
        recipe = f"{scaling['recipe']['schedule']}-LR " if scaling["recipe"] else ""
        print(f"{'predicted val loss':<22} {scaling['loss']:.4f} nats/token (5-95%: {lo:.4f}-{hi:.4f}; `trainwise scale` "
              f"fit of this corpus, for a {recipe}run like the fitted ones{'; extrapolated' if scaling['extrapolates'] else ''})")
        if scaling["repetition_note"]:
            print(f"{'':<22} warning: {scaling['repetition_note']}")
    return 0


def _scaling_prediction(spec: str | None, model, tokens: float) -> dict | None:
    """The stored `trainwise scale` fit's loss for this model on its corpus (a TOML's [data], else the
    built-in corpus), or None where no fit exists."""
    if model is None:
        return None
    from trainwise.config import load_config
    from trainwise.scale.fitting import plan_prediction

    return plan_prediction(model, tokens, load_config(spec).data if spec.endswith(".toml") else None)


def _plan_table(plan) -> str:
    j, rows = plan.to_json(), []
    mdl, fl, mem, t = j["model"], j["flops"], j["memory"], j["time"]
    rows += [("model", mdl["name"]), ("params total", f"{mdl['params_total']:,}"),
             ("params active", f"{mdl['params_active']:,}"), ("params embedding", f"{mdl['params_embedding']:,}"),
             ("params non-embedding", f"{mdl['params_non_embedding']:,}"), ("tokens", f"{j['tokens']:.4g}"),
             ("FLOPs / token (train)", f"{fl['per_token_train']:.4g} FLOPs ({fl['convention']})"),
             ("FLOPs total", f"{fl['total']:.4g} FLOPs")]
    for key in ("params", "grads", "optimizer", "master", "states", "activations"):
        rows.append((f"{key} / device", fmt_bytes(mem[f"{key}_bytes"])))
    rows += [("total / device", fmt_bytes(mem["per_device_bytes"])), ("budget / device", fmt_bytes(mem["budget_bytes"])),
             ("fits", {True: "yes", False: "NO", None: "unknown"}[mem["fits"]])]
    if plan.hardware is None:
        rows.append(("time", t["note"]))
    else:
        hw = plan.hardware
        rows += [("hardware", f"{plan.gpus} x {hw.name} @ {hw.peak_flops:.4g} FLOP/s"),
                 ("step time", f"{t['step_seconds']:.4g} s per step of {plan.tokens_per_step:,} tokens, "
                               f"{t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%} ({_source(t['source'])})"),
                 ("time", f"{t['seconds']:.4g} s = {t['days']:.2f} days = {t['device_hours']:,.1f} device-hours")]
    if "cost_usd" in t:
        rows.append(("cost", f"${t['cost_usd']:,.0f}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows + [("note", n) for n in plan.notes])


def _source(source: str) -> str:
    """How a plan's time was obtained, as a person reads it (plan.json keeps the DESIGN.md word)."""
    return {"calibrated": "step-time model, calibrated on this machine",
            "table defaults": "step-time model from table, uncalibrated: datasheet x default efficiencies"}.get(
        source, "assumed MFU: a what-if, not a prediction")


def _cmd_fit(args, model, run, budget, hw) -> int:
    if model is None:
        raise TrainwiseError("--fit needs a model config (--model), not only --params.")
    if budget is None:
        if not args.gpu:
            raise TrainwiseError("--fit needs --memory-budget or a --gpu whose capacity is known.")
        budget = _gpu_capacity(args.gpu)
    seq = run["seq_len"]
    if not args.global_batch and not args.global_batch_tokens:
        raise TrainwiseError("--fit needs a target: --global-batch SEQUENCES or --global-batch-tokens TOKENS.")
    dp = hw["gpus"] // (hw["tp"] * hw["pp"]) or 1
    gb, note = global_batch_sequences(seq, dp, sequences=args.global_batch, tokens=args.global_batch_tokens)
    good, bad = fit(model, global_batch=gb, memory_budget=budget, seq_len=seq, precision=run["precision"],
                    optimizer=run["optimizer"], **hw)
    if args.json:
        print(json.dumps({"global_batch": {"sequences": gb, "tokens": gb * seq, "seq_len": seq, "note": note},
                          "best": [c.__dict__ for c in good[:3]], "rejected": [c.__dict__ for c in bad]}, indent=2))
        return 0 if good else 1
    if note:
        print(f"note: {note}")
    print(f"fit: {gb} sequences x {seq} tokens per step, budget {fmt_bytes(budget)} per device; "
          "step FLOPs = one optimizer step on all devices, recompute included")
    timed = bool(good) and good[0].step_seconds is not None
    print(f"{'micro_batch':>11} {'grad_accum':>10} {'checkpointing':>13} {'zero':>4} {'memory/device':>28} "
          f"{'step FLOPs':>10}" + (f" {'step time':>10} {'tokens/s':>10}" if timed else ""))
    for c in good[:3]:
        print(f"{c.micro_batch:>11} {c.grad_accum:>10} {c.checkpointing:>13} {c.zero:>4} "
              f"{fmt_bytes(c.per_device_bytes):>28} {c.step_flops:>10.3g}"
              + (f" {c.step_seconds:>9.3g}s {c.tokens_per_s:>10,.0f}" if timed else ""))
    if good and not timed:
        print("(no hardware given: ranked by step FLOPs; add --gpu NAME or --peak-flops P for step times)")
    elif good:
        b = good[0]
        print(f"fastest: micro-batch {b.micro_batch} x {b.grad_accum} accumulation steps, {b.checkpointing} "
              f"checkpointing, ZeRO-{b.zero}: {b.tokens_per_s:,.0f} tokens/s predicted "
              f"({'step-time model' if args.mfu is None and args.gpu and not args.peak_flops else 'assumed MFU'})")
    if not good:
        print("no candidate fits; raise --gpus, --tp/--pp or the budget.")
    print(f"rejected ({len(bad)}):")
    for c in bad[:20]:
        print(f"  B={c.micro_batch} K={c.grad_accum} {c.checkpointing} ZeRO-{c.zero}: {c.reason}")
    if len(bad) > 20:
        print(f"  ... and {len(bad) - 20} more (use --json for all)")
    return 0 if good else 1


def _gpu_capacity(name: str) -> int:
    from trainwise.cost.hardware import get_accelerator

    if name.lower() == "cpu":  # this machine: the memory available now (cgroup limit or MemAvailable)
        from trainwise.train.memcheck import cpu_available_bytes

        return cpu_available_bytes()[0]
    acc = get_accelerator(name)
    if acc.memory_bytes is None:
        raise TrainwiseError(f"{acc.name} has no known capacity; pass --memory-budget.")
    return acc.memory_bytes


def cmd_mem(args: argparse.Namespace) -> int:
    try:
        shape = [int(float(s)) for s in args.shape.split(",") if s.strip()]
    except ValueError:
        raise TrainwiseError(f"--shape '{args.shape}' must be comma-separated integers, e.g. 8,1024,4096.") from None
    t = tensor_bytes(shape, args.dtype)
    if args.json:
        print(json.dumps({"shape": list(t.shape), "dtype": t.dtype, "bytes": t.bytes, "MB": t.mb, "MiB": t.mib}))
    else:
        print(f"shape {tuple(t.shape)} {t.dtype}: {t.bytes:,} bytes = {t.mb:,.1f} MB = {t.mib:,.2f} MiB")
    return 0


def cmd_hardware(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _cmd_calibrate(args)
    if args.json:
        print(json.dumps({k: {"name": a.name, "peak_flops": a.peak_flops, "bandwidth_bytes_per_s": a.bandwidth_bytes_per_s,
                              "memory_bytes": a.memory_bytes} for k, a in ACCELERATORS.items()}, indent=2))
        return 0
    print(f"{'key':<10} {'name':<18} {'bf16 TFLOP/s':>12} {'fp32 TFLOP/s':>12} {'GB/s':>7} {'memory':>26}")
    for k, a in ACCELERATORS.items():
        bf16 = a.peak_flops.get("bf16", a.peak_flops.get("fp16"))
        fp32 = a.peak_flops.get("fp32")
        print(f"{k:<10} {a.name:<18} {bf16 / 1e12 if bf16 else float('nan'):>12.1f} "
              f"{fp32 / 1e12 if fp32 else float('nan'):>12.1f} {a.bandwidth_bytes_per_s / 1e9:>7.0f} "
              f"{fmt_bytes(a.memory_bytes):>26}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainwise")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except TrainwiseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())


def _cmd_simulate(args, model, run, plan) -> int:
    """Planner vs one fake-tensor training step of the trainer's recipe (fp32, or bf16 autocast = amp)."""
    from trainwise.measure.simulate import simulate_report, simulate_step

    if model is None:
        raise TrainwiseError("--simulate needs a model config (--model), not only --params.")
    precision = "fp32" if run["precision"] == "fp32" else "bf16"
    if run["precision"] not in ("fp32", "amp"):
        run = {**run, "precision": "amp"}  # what trainwise's trainer runs for bf16: autocast over fp32
        plan = plan_run(model, tokens=args.tokens or 1, zero=args.zero, **run, gpu=args.gpu,
                        peak_flops=args.peak_flops or (None if args.gpu else 1e12), mfu=args.mfu)
    mem = simulate_step(model, run["micro_batch"], run["seq_len"], precision, run["checkpointing"],
                        "adamw" if run["optimizer"] == "adamw" else "sgd", run["grad_accum"])
    if args.json:
        print(json.dumps({"plan": plan.to_json(), "simulated": mem.to_json()}, indent=2, default=str))
        return 0
    print(f"{model.name}: B={run['micro_batch']} T={run['seq_len']} K={run['grad_accum']}, recipe {plan.recipe.name}, "
          f"{run['checkpointing']} checkpointing; one step simulated on fake tensors (nothing allocated)")
    print(simulate_report(plan, mem))
    return 0


def _cmd_calibrate(args) -> int:
    import os

    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: the collectives between the ranks
        return _cmd_calibrate_link(args)

    from trainwise.cost.hardware import lookup_cuda_device
    from trainwise.measure.calibrate import busy_note, calibrate

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out = {}
    for dev in devices:
        out[dev] = calibrate(dev, refresh=True)
        if dev == "cuda":
            acc = lookup_cuda_device(torch.cuda.get_device_name())
            out[dev]["table"] = None if acc is None else {"name": acc.name, "peak_flops": acc.peak_flops,
                                                          "bandwidth_bytes_per_s": acc.bandwidth_bytes_per_s}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for dev, r in out.items():
        print(f"{r['machine']}")
        for dtype, p in r["peak_flops"].items():
            table = (r.get("table") or {}).get("peak_flops", {}).get(dtype)
            extra = f"  (table: {table / 1e12:,.1f} TFLOP/s)" if table else ""
            print(f"  {dtype:<5} matmul peak {p / 1e9:,.1f} GFLOP/s measured{extra}")
        print(f"  memory bandwidth {r['bandwidth_bytes_per_s'] / 1e9:,.2f} GB/s measured"
              + ("" if r.get("busy") else " (cached)"))
        if prof := r.get("profile"):  # what the step-time model prices operators with
            for dtype, (_, p, bw) in prof["matmul"].items():
                print(f"  {dtype:<5} large matmuls (1024-4096) t = F/P + Q/BW: P = {p / 1e9:,.1f} GFLOP/s, "
                      f"BW = {bw / 1e9:,.2f} GB/s (smaller ones: timed at their shape when a plan needs them)")
            for dtype, classes in prof["elementwise"].items():
                rates = ", ".join(f"{q / 2**20:.3g} MiB {r / 1e9:,.1f}" for q, r in classes["elementwise/other"])
                print(f"  {dtype:<5} element-wise x*y, bytes per call: GB/s: {rates}")
            att = prof["attention"].get("bf16", {})
            if att:
                print(f"  bf16  attention kernel: forward {att['forward'][1] / 1e9:,.1f}, backward "
                      f"{att['backward'][1] / 1e9:,.1f} GFLOP/s")
            print(f"  optimizer step {prof['optimizer'][0] * 1e6:,.1f} us per tensor + {prof['optimizer'][1] * 1e9:,.2f} "
                  f"ns per parameter; eager overhead {prof['overhead'][0] * 1e3:,.2f} ms per step + "
                  f"{prof['overhead'][1] * 1e6:,.1f} us per op; kernels in a real step x{prof.get('in_step', 1.0):.3g} "
                  "their time alone")
            if "calibration_s" in r:
                print(f"  calibration took {r['calibration_s']:.1f} s")
        if note := busy_note(r):
            print(f"  warning: {note}")
    return 0


def _cmd_calibrate_link(args) -> int:
    """`torchrun --nproc_per_node N -m trainwise hardware --calibrate`: latency and bandwidth of the
    collectives (gloo on CPU, NCCL on GPUs), cached for the step-time model's communication terms."""
    import torch
    import torch.distributed as dist

    from trainwise.measure.calibrate import calibrate_link

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        r = calibrate_link()
    finally:
        dist.destroy_process_group()
    if r["rank"] == 0:
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"{r['backend']} collectives over {r['world']} ranks: latency {r['link'][0] * 1e6:,.1f} us per hop, "
                  f"bandwidth {r['link'][1] / 1e9:,.2f} GB/s (ring model, cached for `trainwise plan`)")
    return 0
