"""Train-step throughput of trainwise side by side with nanoGPT's model.py on this machine.

A train step = forward + loss, backward, gradient clipping at 1.0 (both trainers do it), AdamW step,
zero_grad(set_to_none=True). Variants, all at the same model shape and the same batch (B, T):

  nanogpt          nanoGPT's GPT, its own configure_optimizers(0.1, 6e-4, (0.9, 0.95), 'cpu'), fp32
                   (nanoGPT's train.py uses a nullcontext, i.e. fp32, on CPU)
  tw-gpt2 bf16     trainwise Transformer with nanoGPT's architecture (gelu, layernorm, learned
                   positions, bias, tied embeddings, MHA), the trainer's own path: bf16 autocast from
                   trainwise.train.precision.autocast, AdamW from build_optimizer(model, TrainConfig())
  tw-gpt2 fp32     the same model and optimizer without autocast
  tw-llama bf16    trainwise's default Llama-style block (swiglu, rmsnorm, rope, no bias, GQA with
                   n_kv_heads = n_heads // 2) at the same vocab / d_model / layers / heads, bf16

Steps are interleaved (one step of each variant per round, in turn) so that load from other
processes on a shared machine hits every variant alike; the table reports median tokens/s and the
median over rounds of the per-round ratio trainwise / nanoGPT. MFU = measured tokens/s x model FLOPs
per token (trainwise.cost.flops.flops_per_token_train) / calibrated matmul peak of the dtype the
matmuls run in (trainwise.measure.calibrate).

nanoGPT is NOT part of trainwise: pass a local checkout with --nanogpt DIR (the directory holding
model.py). Example:
    python benchmarks/bench_nanogpt.py --nanogpt /tmp/nanogpt --shape both --steps 8
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


def build_variants(shape: dict, nanogpt, which: list[str]) -> list[Variant]:
    from trainwise.config import ModelConfig, TrainConfig
    from trainwise.model import Transformer
    from trainwise.train.optim import build_optimizer
    from trainwise.train.precision import autocast

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
        if name == "nanogpt":
            conf = nanogpt.GPTConfig(block_size=shape["T"], vocab_size=shape["vocab"], n_layer=shape["layers"],
                                     n_head=shape["heads"], n_embd=shape["d_model"], dropout=0.0)
            import contextlib
            import io
            with contextlib.redirect_stdout(io.StringIO()):  # it prints parameter counts
                model = nanogpt.GPT(conf)
                opt = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95),
                                                 device_type="cpu")
            variants.append(Variant(name, model, opt, contextlib.nullcontext, gpt2_cfg, "fp32"))
            continue
        arch, precision, *compiled = name.split()
        cfg = gpt2_cfg if arch == "tw-gpt2" else llama_cfg
        model = Transformer(cfg)
        if compiled:  # "tw-llama bf16 compile": the trainer's train.compile=true path
            from trainwise.train.parallelize import apply_compile

            apply_compile(model)
        opt = build_optimizer(model, TrainConfig())
        variants.append(Variant(name, model, opt, lambda p=precision: autocast(cpu, p), cfg, precision))
    return variants


def run_shape(shape_name: str, shape: dict, nanogpt, steps: int, warmup: int, which: list[str],
              peaks: dict, log) -> dict:
    from trainwise.cost.flops import flops_per_token_train

    B, T = shape["B"], shape["T"]
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
    base = variants[0] if variants[0].name == "nanogpt" else None
    rows = []
    for v in variants:
        tok_s = [B * T / t for t in v.times]
        flops = flops_per_token_train(v.model_cfg, T)
        med = statistics.median(tok_s)
        row = {
            "shape": shape_name, "variant": v.name, "B": B, "T": T,
            "params": sum(p.numel() for p in v.model.parameters()),
            "median_tok_s": med, "min_tok_s": min(tok_s), "max_tok_s": max(tok_s),
            "flops_per_token": flops,
            "mfu_vs_own_dtype_peak": med * flops / peaks[v.matmul_dtype],
            "mfu_vs_bf16_peak": med * flops / peaks["bf16"],
            "mfu_vs_fp32_peak": med * flops / peaks["fp32"],
            "matmul_dtype": v.matmul_dtype,
        }
        if base is not None:
            ratios = [bt / vt for bt, vt in zip(base.times, v.times)]  # per-round tokens/s ratio
            row["ratio_vs_nanogpt_median"] = statistics.median(ratios)
            row["ratio_vs_nanogpt_min"] = min(ratios)
            row["ratio_vs_nanogpt_max"] = max(ratios)
        rows.append(row)
    return {"shape": shape_name, "config": shape, "steps": steps, "warmup": warmup, "rows": rows}


def print_table(results: list[dict], peaks: dict) -> None:
    print(f"\npeaks (trainwise.measure.calibrate method): fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s; torch {torch.__version__}, threads {torch.get_num_threads()}")
    head = (f"{'shape':<12} {'B x T':<9} {'variant':<14} {'tok/s (median)':>15} {'ratio vs nanoGPT':>22} "
            f"{'MFU own':>8} {'MFU bf16':>9} {'MFU fp32':>9}")
    print(head)
    print("-" * len(head))
    for res in results:
        for r in res["rows"]:
            ratio = ""
            if "ratio_vs_nanogpt_median" in r:
                ratio = (f"{r['ratio_vs_nanogpt_median']:.2f}x "
                         f"[{r['ratio_vs_nanogpt_min']:.2f}-{r['ratio_vs_nanogpt_max']:.2f}]")
            print(f"{r['shape']:<12} {str(r['B']) + 'x' + str(r['T']):<9} {r['variant']:<14} "
                  f"{r['median_tok_s']:>15,.0f} {ratio:>22} {r['mfu_vs_own_dtype_peak']:>8.1%} "
                  f"{r['mfu_vs_bf16_peak']:>9.1%} {r['mfu_vs_fp32_peak']:>9.1%}")
    print("ratio = median over rounds of (trainwise tok/s / nanoGPT tok/s in the same round) [min-max]; "
          "MFU own = against the peak of the dtype the matmuls run in (nanoGPT and fp32 rows: fp32).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanogpt", required=True, help="directory of a nanoGPT checkout (holding model.py)")
    ap.add_argument("--shape", choices=["default", "shakespeare", "both"], default="both")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    ap.add_argument("--batch", type=int, default=0,
                    help="micro-batch B for every shape (default: the shape's own, 16 / 64)")
    ap.add_argument("--variants", default="nanogpt,tw-gpt2 bf16,tw-gpt2 fp32,tw-llama bf16",
                    help="comma-separated subset of: nanogpt, tw-gpt2 bf16, tw-gpt2 fp32, tw-llama bf16, "
                         "tw-llama fp32; append ' compile' to a trainwise variant for train.compile=true")
    ap.add_argument("--peaks", choices=["measure", "cached"], default="measure",
                    help="matmul peaks for MFU: 'measure' (default) re-runs calibrate()'s matmul timing now "
                         "without touching its cache; 'cached' uses calibrate('cpu'), measured on an earlier, "
                         "quiet run")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="also write the results as JSON to PATH ('-' or no PATH: stdout)")
    args = ap.parse_args(argv)

    nanogpt = load_nanogpt(args.nanogpt)
    from trainwise.measure.calibrate import calibrate, matmul_flops_per_s
    from trainwise.train.precision import DTYPES

    if args.peaks == "cached":
        peaks = calibrate("cpu")["peak_flops"]
    else:  # calibrate()'s own method, measured now and not written to its cache
        cpu = torch.device("cpu")
        peaks = {d: max(matmul_flops_per_s(cpu, DTYPES[d], n)[0] for n in (1024, 2048)) for d in ("fp32", "bf16")}
    which = [w.strip() for w in args.variants.split(",") if w.strip()]
    names = ["default", "shakespeare"] if args.shape == "both" else [args.shape]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    results = []
    for name in names:
        shape = dict(SHAPES[name])
        if args.batch:
            shape["B"] = args.batch
        results.append(run_shape(name, shape, nanogpt, args.steps, args.warmup, which, peaks, log))
    print_table(results, peaks)
    if args.json is not None:
        payload = json.dumps({"peaks": peaks, "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "results": results}, indent=1)
        if args.json == "-":
            print(payload)
        else:
            Path(args.json).write_text(payload + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
