"""Train-step throughput of trainwise side by side with nanoGPT's model.py on this machine.

A train step = forward + loss, backward, gradient clipping at 1.0 (both trainers do it), AdamW step,
zero_grad(set_to_none=True). Variants, all at the same model shape and the same batch (B, T):

  nanogpt          nanoGPT's GPT, its own configure_optimizers(0.1, 6e-4, (0.9, 0.95), 'cpu'), fp32
                   (nanoGPT's train.py uses a nullcontext, i.e. fp32, on CPU)
  nanogpt bf16     the same under torch.autocast('cpu', bfloat16): nanoGPT's train.py with dtype='bfloat16'
                   where its ctx is an autocast (its GPU default), i.e. the peer at its best in eager mode
  nanogpt bf16 compile
                   the same plus `model = torch.compile(model)`, as its train.py does with compile=True
  tw-gpt2 bf16     trainwise Transformer with nanoGPT's architecture (gelu, layernorm, learned
                   positions, bias, tied embeddings, MHA), the trainer's own path: model and AdamW from
                   trainwise.runtime.step.build_step, bf16 autocast from trainwise.runtime.precision
  tw-gpt2 fp32     the same model and optimizer without autocast
  tw-llama bf16    trainwise's default Llama-style block (swiglu, rmsnorm, rope, no bias, GQA with
                   n_kv_heads = n_heads // 2) at the same vocab / d_model / layers / heads, bf16

`tw-* compile` variants are built as `trainwise train` compiles (build_step(..., compile=True): the
compiled CPU attention, then torch.compile of the whole model). Ratios are reported against every nanoGPT
variant in the run (per round, median).

The matmul-only bound of a trainwise variant (--bound): the matmuls one step runs, recorded with their
shapes, strides and dtypes by a dispatch mode on one eager step, each shape then timed alone on this
CPU (best of a few repeats) and summed over calls. Attention counts as the six batched matmuls of its
explicit form (QK^T, PV forward; four in backward, full T x T), which is what the compiled CPU step
runs (trainwise.model.transformer.explicit_attention). step / bound says how far the step is from
"nothing but matmuls".

Steps are interleaved (one step of each variant per round, in turn) so that load from other
processes on a shared machine hits every variant alike; the table reports median tokens/s and the
median over rounds of the per-round ratio trainwise / nanoGPT. MFU = measured tokens/s x model FLOPs
per token (trainwise.cost.flops.flops_per_token_train) / calibrated matmul peak of the dtype the
matmuls run in (trainwise.measure.calibrate).

nanoGPT is NOT part of trainwise: pass a local checkout with --nanogpt DIR (the directory holding
model.py). Example:
    python benchmarks/bench_nanogpt.py --nanogpt /tmp/nanogpt --shape default,nanogpt --steps 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from trainwise.config import ModelConfig as _Model, TrainConfig as _Train  # noqa: E402

SHAPES = {
    # trainwise's default ModelConfig / TrainConfig shape, read from the config so it follows the defaults
    "default": dict(vocab=_Model().vocab_size, d_model=_Model().d_model, layers=_Model().n_layers,
                    heads=_Model().n_heads, T=_Train().seq_len, B=_Train().micro_batch),
    # nanoGPT's model at a small-LM scale: its shakespeare model's width and depth with a BPE-sized vocab
    "nanogpt": dict(vocab=8192, d_model=384, layers=6, heads=6, T=256, B=8),
    # nanoGPT's config/train_shakespeare_char.py shape (its batch_size is 64)
    "shakespeare": dict(vocab=65, d_model=384, layers=6, heads=6, T=256, B=64),
}

GET_NANOGPT = """nanoGPT checkout not found: --nanogpt {path!r} has no model.py.
Get one (it is only run for measurement, never copied into trainwise), e.g.:
    git clone https://github.com/karpathy/nanoGPT /tmp/nanogpt
or copy just its model.py into a directory and pass that directory:
    mkdir -p /tmp/nanogpt && curl -L -o /tmp/nanogpt/model.py \\
        https://raw.githubusercontent.com/karpathy/nanoGPT/master/model.py
then run:  python benchmarks/bench_nanogpt.py --nanogpt /tmp/nanogpt"""


def load_nanogpt(directory: str):
    path = Path(directory).expanduser() / "model.py"
    if not path.is_file():
        print(GET_NANOGPT.format(path=directory), file=sys.stderr)
        sys.exit(2)
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt_model"] = module
    spec.loader.exec_module(module)
    return module


class Variant:
    """One model + optimizer + autocast context, and the wall time of each timed step."""

    def __init__(self, name, model, optimizer, ctx_factory, model_cfg, matmul_dtype):
        self.name, self.model, self.optimizer = name, model, optimizer
        self.ctx_factory, self.model_cfg, self.matmul_dtype = ctx_factory, model_cfg, matmul_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.times: list[float] = []
        model.train()

    def step(self, x, y) -> float:
        start = time.perf_counter()
        with self.ctx_factory():
            out = self.model(x, y)
        loss = out[1] if isinstance(out, tuple) else out  # nanoGPT returns (logits, loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def nanogpt_variant(name: str, shape: dict, nanogpt, cfg) -> Variant:
    """nanoGPT as its train.py runs it: fp32 on CPU by default; `bf16` = its autocast context with
    dtype='bfloat16'; `compile` = its `model = torch.compile(model)`."""
    import contextlib
    import io

    conf = nanogpt.GPTConfig(block_size=shape["T"], vocab_size=shape["vocab"], n_layer=shape["layers"],
                             n_head=shape["heads"], n_embd=shape["d_model"], dropout=0.0)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints parameter counts
        model = nanogpt.GPT(conf)
        opt = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95),
                                         device_type="cpu")
    words = name.split()
    if "compile" in words:
        model = torch.compile(model)
    if "bf16" in words:
        return Variant(name, model, opt, lambda: torch.autocast("cpu", dtype=torch.bfloat16), cfg, "bf16")
    return Variant(name, model, opt, contextlib.nullcontext, cfg, "fp32")


def build_variants(shape: dict, nanogpt, which: list[str]) -> list[Variant]:
    from trainwise.config import ModelConfig, TrainConfig
    from trainwise.runtime.precision import autocast
    from trainwise.runtime.step import build_model, build_step

    cpu = torch.device("cpu")
    common = dict(vocab_size=shape["vocab"], d_model=shape["d_model"], n_layers=shape["layers"],
                  n_heads=shape["heads"], max_seq_len=shape["T"], dropout=0.0)
    gpt2_cfg = ModelConfig(name="tw-gpt2", activation="gelu", norm="layernorm", position="learned", bias=True,
                           tie_embeddings=True, n_kv_heads=shape["heads"], **common)
    llama_cfg = ModelConfig(name="tw-llama", activation="swiglu", norm="rmsnorm", position="rope", bias=False,
                            tie_embeddings=True, n_kv_heads=max(1, shape["heads"] // 2), **common)
    variants = []
    for name in which:
        torch.manual_seed(0)
        if name.startswith("nanogpt"):
            variants.append(nanogpt_variant(name, shape, nanogpt, gpt2_cfg))
            continue
        arch, precision, *compiled = name.split()
        cfg = gpt2_cfg if arch == "tw-gpt2" else llama_cfg
        # "tw-llama bf16 compile": the trainer's train.compile=true path (runtime.step's builder)
        step = build_step(build_model(cfg), TrainConfig(), cpu, precision, compile=bool(compiled))
        variants.append(Variant(name, step.model, step.optimizer, lambda p=precision: autocast(cpu, p), cfg, precision))
    return variants


MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")


class _MatmulRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts each matmul of a step by (op, input sizes/strides/dtypes, other args); SDPA calls are
    counted as the batched matmuls of explicit attention at the same q/k/v shapes."""

    def __init__(self):
        super().__init__()
        self.calls: dict = {}

    def add(self, func, args, kwargs, n=1):
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        key = (func, spec, tuple((tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor)
                                 else a for a in flat))
        self.calls[key] = self.calls.get(key, 0) + n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func._overloadpacket)
        if name in MATMULS:
            self.add(func, args, kwargs)
        elif "scaled_dot_product" in name:
            q = args[0] if "backward" not in name else args[1]  # backward ops take grad_out first
            B, nh, T, hd = q.shape
            scores = (torch.empty(B * nh, T, hd, dtype=q.dtype), torch.empty(B * nh, hd, T, dtype=q.dtype))
            mix = (torch.empty(B * nh, T, T, dtype=q.dtype), torch.empty(B * nh, T, hd, dtype=q.dtype))
            backward = "backward" in name  # forward: QK^T, PV; backward: dO V^T; P^T dO, dS K, dS^T Q
            self.add(torch.ops.aten.bmm.default, scores, {}, 1)
            self.add(torch.ops.aten.bmm.default, mix, {}, 3 if backward else 1)
        return func(*args, **kwargs)


def _time_call(key, repeats: int = 5) -> float:
    """Best-of-`repeats` seconds of one recorded matmul on fresh tensors of its sizes, strides, dtypes."""
    func, spec, flat = key
    g = torch.Generator().manual_seed(0)
    real = [torch.empty_strided(a[0], a[1], dtype=a[2]).normal_(generator=g) if isinstance(a, tuple)
            and len(a) == 3 and isinstance(a[2], torch.dtype) else a for a in flat]
    args, kwargs = torch.utils._pytree.tree_unflatten(real, spec)
    func(*args, **kwargs)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        func(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best


def matmul_bound(model_cfg, B: int, T: int, precision: str) -> dict:
    """Seconds of a step's matmuls alone (see the module docstring): one eager trainwise step recorded,
    every distinct matmul timed alone, summed over its calls."""
    from trainwise.config import TrainConfig
    from trainwise.runtime.step import build_model, build_step, random_batches

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    step = build_step(build_model(model_cfg), TrainConfig(), cpu, precision)
    rec = _MatmulRecorder()
    with rec:
        step(random_batches(model_cfg.vocab_size, B, T, 1, cpu))
    seconds = sum(n * _time_call(key) for key, n in rec.calls.items())
    return {"matmul_bound_s": seconds, "matmul_calls": sum(rec.calls.values()), "distinct_matmuls": len(rec.calls)}


def run_shape(shape_name: str, shape: dict, nanogpt, steps: int, warmup: int, which: list[str],
              peaks: dict, log, bound: bool = False) -> dict:
    from trainwise.cost.flops import flops_per_token_train

    B, T = shape["B"], shape["T"]
    # Forget the previous shape's graphs: recompiling the same forward at a new shape would otherwise
    # switch dynamo to dynamic shapes (slower code, and an inductor error seen with nanoGPT's model).
    torch._dynamo.reset()
    variants = build_variants(shape, nanogpt, which)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, shape["vocab"], (B, T + 1), generator=g) for _ in range(4)]
    log(f"[{shape_name}] vocab {shape['vocab']} d_model {shape['d_model']} layers {shape['layers']} "
        f"heads {shape['heads']} B {B} T {T}; warmup {warmup}, {steps} timed steps each, interleaved")
    for i in range(warmup + steps):
        data = batches[i % len(batches)]
        x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        order = variants if i % 2 == 0 else variants[::-1]  # alternate order so no variant always goes first
        for v in order:
            t = v.step(x, y)
            if i >= warmup:
                v.times.append(t)
        if i >= warmup:
            log("  step %d: " % (i - warmup) + ", ".join(f"{v.name} {B * T / v.times[-1]:,.0f} tok/s"
                                                         for v in variants))
    peers = [v for v in variants if v.name.startswith("nanogpt")]
    bounds = {}
    rows = []
    for v in variants:
        tok_s = [B * T / t for t in v.times]
        flops = flops_per_token_train(v.model_cfg, T)
        med = statistics.median(tok_s)
        row = {
            "shape": shape_name, "variant": v.name, "B": B, "T": T,
            "params": sum(p.numel() for p in v.model.parameters()),
            "median_tok_s": med, "min_tok_s": min(tok_s), "max_tok_s": max(tok_s),
            "median_step_s": statistics.median(v.times),
            "flops_per_token": flops,
            "mfu_vs_own_dtype_peak": med * flops / peaks[v.matmul_dtype],
            "mfu_vs_bf16_peak": med * flops / peaks["bf16"],
            "mfu_vs_fp32_peak": med * flops / peaks["fp32"],
            "matmul_dtype": v.matmul_dtype,
            "ratios": {},
        }
        for peer in peers:
            ratios = [pt / vt for pt, vt in zip(peer.times, v.times)]  # per-round tokens/s ratio
            row["ratios"][peer.name] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        if bound and v.name.startswith("tw-"):
            key = (v.model_cfg.name, v.matmul_dtype)
            if key not in bounds:
                bounds[key] = matmul_bound(v.model_cfg, B, T, v.matmul_dtype)
            row.update(bounds[key])
            row["step_over_bound"] = row["median_step_s"] / row["matmul_bound_s"]
        rows.append(row)
    return {"shape": shape_name, "config": shape, "steps": steps, "warmup": warmup, "rows": rows}


def print_table(results: list[dict], peaks: dict) -> None:
    from trainwise.hardware.cache import cpu_model

    print(f"\nCPU: {cpu_model()}; torch {torch.__version__}, threads {torch.get_num_threads()}; "
          f"load average at the end {Path('/proc/loadavg').read_text().split()[:3]}")
    print(f"peaks (trainwise.measure.calibrate method): fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s")
    peers = [r["variant"] for r in results[0]["rows"] if r["variant"].startswith("nanogpt")]
    head = (f"{'shape':<9} {'B x T':<7} {'variant':<21} {'tok/s (med)':>11} {'ms/step':>8} "
            + "".join(f"{'vs ' + p:>28}" for p in peers) + f" {'MFU own':>8} {'step/matmul bound':>18}")
    print(head)
    print("-" * len(head))
    for res in results:
        for r in res["rows"]:
            ratios = "".join(f"{q['median']:>13.2f}x [{q['min']:.2f}-{q['max']:.2f}]" for q in r["ratios"].values())
            bound = (f"{r['step_over_bound']:.2f}x of {r['matmul_bound_s'] * 1e3:.0f} ms"
                     if "step_over_bound" in r else "")
            print(f"{r['shape']:<9} {str(r['B']) + 'x' + str(r['T']):<7} {r['variant']:<21} "
                  f"{r['median_tok_s']:>11,.0f} {r['median_step_s'] * 1e3:>8.0f} {ratios} "
                  f"{r['mfu_vs_own_dtype_peak']:>8.1%} {bound:>18}")
    print("vs X = median over rounds of (variant tok/s / X tok/s in the same round) [min-max]; MFU own = model "
          "FLOPs/s against the calibrated peak of the dtype the matmuls run in; step/matmul bound = median step "
          "time / the step's matmuls timed alone at their shapes (ms = 1e-3 s).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanogpt", required=True, help="directory of a nanoGPT checkout (holding model.py)")
    ap.add_argument("--shape", default="default,nanogpt",
                    help=f"comma-separated shapes of {', '.join(SHAPES)} (default: default,nanogpt; 'both' = "
                         "default,shakespeare, as before)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    ap.add_argument("--batch", type=int, default=0,
                    help="micro-batch B for every shape (default: the shape's own, 16 / 8 / 64)")
    ap.add_argument("--variants",
                    default="nanogpt bf16,nanogpt bf16 compile,tw-llama bf16,tw-llama bf16 compile",
                    help="comma-separated subset of: nanogpt, nanogpt bf16, nanogpt bf16 compile, tw-gpt2 bf16, "
                         "tw-gpt2 fp32, tw-llama bf16, tw-llama fp32; append ' compile' to a trainwise variant "
                         "for train.compile=true")
    ap.add_argument("--bound", action="store_true",
                    help="also time each trainwise variant's matmuls alone (the matmul-only bound of its step)")
    ap.add_argument("--peaks", choices=["measure", "cached"], default="measure",
                    help="matmul peaks for MFU: 'measure' (default) re-runs calibrate()'s matmul timing now "
                         "without touching its cache; 'cached' uses calibrate('cpu'), measured on an earlier, "
                         "quiet run")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="also write the results as JSON to PATH ('-' or no PATH: stdout)")
    ap.add_argument("--allocator", choices=["trainwise", "default"], default="trainwise",
                    help="'trainwise' (default): glibc keeps freed memory, as `trainwise train` sets it "
                         "(trainwise.runtime.allocator), for EVERY variant of this process, nanoGPT included; "
                         "'default': glibc's own thresholds for all")
    args = ap.parse_args(argv)

    if args.allocator == "trainwise":
        from trainwise.runtime.allocator import keep_freed_memory

        keep_freed_memory()
    nanogpt = load_nanogpt(args.nanogpt)
    from trainwise.measure.calibrate import calibrate, measure_peak

    if args.peaks == "cached":
        peaks = calibrate("cpu")["peak_flops"]
    else:  # calibrate()'s own method, measured now and not written to its cache
        peaks = measure_peak(torch.device("cpu"))["peak_flops"]
    which = [w.strip() for w in args.variants.split(",") if w.strip()]
    names = ["default", "shakespeare"] if args.shape == "both" else [n.strip() for n in args.shape.split(",")]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--shape {', '.join(unknown)}: choose from {', '.join(SHAPES)}")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    results = []
    for name in names:
        shape = dict(SHAPES[name])
        if args.batch:
            shape["B"] = args.batch
        results.append(run_shape(name, shape, nanogpt, args.steps, args.warmup, which, peaks, log, args.bound))
    print_table(results, peaks)
    if args.json is not None:
        from trainwise.hardware.cache import cpu_model

        payload = json.dumps({"cpu": cpu_model(), "allocator": args.allocator, "peaks": peaks,
                              "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "loadavg": Path("/proc/loadavg").read_text().split()[:3], "results": results}, indent=1)
        if args.json == "-":
            print(payload)
        else:
            Path(args.json).write_text(payload + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
