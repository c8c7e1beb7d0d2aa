"""The cluster step-time and memory model against published multi-GPU runs it was not fitted on.

The development set (docs/ARCHITECTURE.md, "The cluster model's development set"): Narayanan et al. 2021
(Megatron-LM, SC21) Table 1, ten GPT models on 32-3,072 A100 80GB; Korthikanti et al. 2022 Table 5, four
models with full recompute + tensor parallelism and with selective recompute + sequence parallelism; their
Figure 1 per-GPU memory. Each run is planned with `trainwise plan`'s own function (planner.plan.plan_run)
from the inputs the file gives: model shape, layout, batch, recompute, fp16 with Megatron-LM's mixed
precision (16-bit weights and activations, fp32 main gradients, master and Adam: 18 bytes per parameter),
unfused attention (2021-22: no FlashAttention), gradient all-reduce overlapped (torch DDP) up to 18.4B and
after backward (Megatron's local DDP) from 39.1B. Nothing below is fitted to these runs: every kernel and
collective figure is a published microbenchmark (trainwise.hardware.table, trainwise.cost.comm).

    python benchmarks/cluster_model.py                 # the table and the --fit (about a minute)
    python benchmarks/cluster_model.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from trainwise.cli import main as cli_main
from trainwise.config import ModelConfig
from trainwise.cost.layout import make_layout
from trainwise.cost.memory import get_recipe
from trainwise.cost.rank_memory import rank_peak
from trainwise.cost.run import Machine, Run
from trainwise.planner.plan import plan_run

GiB = 2**30


def gpt(name: str, heads: int, hidden: int, layers: int) -> ModelConfig:
    """GPT-style as Megatron-LM trains it: learned positions, LayerNorm, GELU, FFN 4h, biases, dropout 0.1
    (attention and hidden, Megatron's defaults), vocabulary 51,200, sequence 2,048, tied embeddings."""
    return ModelConfig(name=name, vocab_size=51200, d_model=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                       ffn_hidden=4 * hidden, activation="gelu", norm="layernorm", position="learned", bias=True,
                       dropout=0.1, max_seq_len=2048, tie_embeddings=True)


# Narayanan et al. 2021 Table 1 (+ its script run_table_1.sh): params B, heads, hidden, layers, TP, PP, DP,
# global batch, micro-batch, layers per virtual stage (None: no interleaving), iteration time s (derived from
# the published TFLOP/s/GPU with the paper's own FLOP count), DDP implementation.
NARAYANAN = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 16, None, 3.53, "torch"),
    (3.6, 32, 3072, 30, 2, 1, 32, 512, 16, None, 3.70, "torch"),
    (7.5, 32, 4096, 36, 4, 1, 32, 512, 16, None, 3.70, "torch"),
    (18.4, 48, 6144, 40, 8, 1, 32, 1024, 8, None, 9.40, "torch"),
    (39.1, 64, 8192, 48, 8, 2, 32, 1536, 4, None, 14.45, "local"),
    (76.1, 80, 10240, 60, 8, 4, 32, 1792, 2, 5, 16.06, "local"),
    (145.6, 96, 12288, 80, 8, 8, 24, 2304, 2, 5, 24.82, "local"),
    (310.1, 128, 16384, 96, 8, 16, 15, 2160, 1, 3, 37.61, "local"),
    (529.6, 128, 20480, 105, 8, 35, 9, 2520, 1, 1, 54.08, "local"),
    (1008.0, 160, 25600, 128, 8, 64, 6, 3072, 1, None, 102.63, "local"),
]
# Korthikanti et al. 2022 Tables 3 and 5 + Figure 1: name, heads, hidden, layers, TP, PP, global batch,
# micro-batch, interleave, iteration time full recompute / selective + SP, Figure 1 GiB: parameters +
# optimizer, activations without / with sequence parallelism + selective recompute.
KORTHIKANTI = [
    ("22B", 64, 6144, 48, 8, 1, 4, 4, 1, 1.42, 1.10, 45.5625, 59.25, 9.5625),
    ("175B", 96, 12288, 96, 8, 8, 64, 1, 3, 18.13, 13.75, 45.5625, 66.84375, 12.3515625),
    ("530B", 128, 20480, 105, 8, 35, 280, 1, 3, 49.05, 37.83, 31.640625, 114.0234375, 23.076171875),
    ("1T", 160, 25600, 128, 8, 64, 512, 1, 1, 94.42, 71.49, 32.958984375, 131.25, 26.5625),
]


def plan(cfg: ModelConfig, gpus: int, *, tp: int, pp: int, vpp: int, micro_batch: int, grad_accum: int,
         checkpointing: str, sequence_parallel: bool, dp_overlap: bool):
    layout = make_layout(gpus, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sequence_parallel, micro_batches=grad_accum,
                         dp_overlap=dp_overlap, attention_impl="unfused")
    return plan_run(Run(cfg, micro_batch=micro_batch, seq_len=2048, grad_accum=grad_accum,
                        recipe=get_recipe("megatron"), checkpointing=checkpointing, layout=layout, tokens=1e9,
                        machine=Machine(gpu="a100-80gb")))


def terms(p) -> str:
    return " ".join(f"{k[:-2]} {v:.2f}" for k, v in p.cluster.breakdown.items() if v >= 0.005)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    t0, rows, errors = time.time(), [], []
    print("Narayanan et al. 2021 Table 1 (A100 80GB, DGX A100 nodes; full recompute, unfused attention, fp16)")
    print(f"{'model':>8} {'tp':>3} {'pp':>3} {'dp':>3} {'vpp':>3} {'m':>4} {'published s':>11} {'predicted s':>11} "
          f"{'error':>7}  breakdown (s)")
    for (size, heads, hidden, layers, tp, pp, dp, gbs, mbs, lps, published, ddp) in NARAYANAN:
        vpp = layers // pp // lps if lps else 1
        m = gbs // (mbs * dp)
        p = plan(gpt(f"{size}B", heads, hidden, layers), tp * pp * dp, tp=tp, pp=pp, vpp=vpp, micro_batch=mbs,
                 grad_accum=m, checkpointing="full", sequence_parallel=False, dp_overlap=ddp == "torch")
        err = p.step_seconds / published - 1
        errors.append(abs(err))
        rows.append({"run": f"Narayanan {size}B", "published_s": published, "predicted_s": p.step_seconds,
                     "error": err, "breakdown": p.cluster.breakdown, "mfu": p.mfu})
        print(f"{size:>7}B {tp:>3} {pp:>3} {dp:>3} {vpp:>3} {m:>4} {published:>11.2f} {p.step_seconds:>11.2f} "
              f"{err:>+7.1%}  {terms(p)}", flush=True)
    print("\nKorthikanti et al. 2022 Table 5 (data parallel 1) and Figure 1 (per-GPU memory, GiB)")
    print(f"{'model':>6} {'setting':<24} {'published s':>11} {'predicted s':>11} {'error':>7}  breakdown (s)")
    speedups, memory = [], []
    for (name, heads, hidden, layers, tp, pp, gbs, mbs, vpp, full_s, sel_s, states, act_base, act_sp) in KORTHIKANTI:
        cfg = gpt(name, heads, hidden, layers)
        got = {}
        for setting, ckpt, sp, published in (("full recompute, TP", "full", False, full_s),
                                             ("selective + SP", "selective", True, sel_s)):
            p = plan(cfg, tp * pp, tp=tp, pp=pp, vpp=vpp, micro_batch=mbs, grad_accum=gbs // mbs, checkpointing=ckpt,
                     sequence_parallel=sp, dp_overlap=False)
            err = p.step_seconds / published - 1
            errors.append(abs(err))
            got[ckpt] = p.step_seconds
            rows.append({"run": f"Korthikanti {name} {setting}", "published_s": published,
                         "predicted_s": p.step_seconds, "error": err, "breakdown": p.cluster.breakdown, "mfu": p.mfu})
            print(f"{name:>6} {setting:<24} {published:>11.2f} {p.step_seconds:>11.2f} {err:>+7.1%}  {terms(p)}",
                  flush=True)
        speedup, published_speedup = got["full"] / got["selective"] - 1, full_s / sel_s - 1
        speedups.append((name, speedup, published_speedup))
        print(f"{'':>6} speed-up of selective + SP over full recompute: predicted {speedup:+.1%}, published "
              f"{published_speedup:+.1%} ({(speedup - published_speedup) * 100:+.1f} points)")
        for setting, ckpt, sp, published_act in (("TP, no recompute", "none", False, act_base),
                                                 ("SP + selective", "selective", True, act_sp)):
            p = plan(cfg, tp * pp, tp=tp, pp=pp, vpp=vpp, micro_batch=mbs, grad_accum=gbs // mbs, checkpointing=ckpt,
                     sequence_parallel=sp, dp_overlap=False)
            # Figure 1 counts 12 l h^2 parameters per stage, no embedding: a rank that holds layers only
            # (the second; the only one without pipelining, embedding and all)
            layers_only, first = rank_peak(p.run, min(1, pp - 1) * tp), rank_peak(p.run, 0)
            states_got = layers_only.params + layers_only.grads + layers_only.optimizer + layers_only.master
            acts = first.activations  # the first stage holds the most micro-batches in flight
            s_err = states_got / GiB / states - 1
            a_err = acts / GiB / published_act - 1
            memory.append({"model": name, "setting": setting, "states_gib": states_got / GiB,
                           "first_rank_states_gib": (first.params + first.grads + first.optimizer
                                                     + first.master) / GiB,
                           "published_states_gib": states, "activations_gib": acts / GiB,
                           "published_activations_gib": published_act, "states_error": s_err,
                           "activations_error": a_err})
            print(f"{'':>6} memory, {setting:<17} params + optimizer {states_got / GiB:6.2f} vs {states:6.2f} "
                  f"({s_err:+.1%}); activations {acts / GiB:7.2f} vs {published_act:7.2f} ({a_err:+.1%})")
    worst_mem = max(max(abs(m["states_error"]), abs(m["activations_error"])) for m in memory)
    print(f"\niteration time |error| over {len(errors)} runs: median {statistics.median(errors):.1%}, worst "
          f"{max(errors):.1%}; speed-up of selective + SP: worst {max(abs(a - b) for _, a, b in speedups) * 100:.1f} "
          f"points off; memory: worst {worst_mem:.1%}; {time.time() - t0:.0f} s")
    print("\n`plan --fit` for GPT-3 175B (Korthikanti et al.'s 175B as a GPT-2-style config.json) on 64 A100 80GB, "
          "global batch 64 x 2048; published layout: TP 8, PP 8", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gpt3-175b" / "config.json"
        config.parent.mkdir()
        config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 96, "n_embd": 12288, "n_head": 96,
                                      "vocab_size": 51200, "n_positions": 2048, "n_inner": 4 * 12288}))
        fit_rc = cli_main(["plan", "--model", str(config), "--gpu", "a100-80gb", "--gpus", "64", "--global-batch", "64",
                           "--seq-len", "2048", "--tokens", "3e11", "--precision", "megatron", "--attention-impl",
                           "unfused", "--fit"])
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "speedups": speedups, "memory": memory}, indent=1))
    return fit_rc


if __name__ == "__main__":
    raise SystemExit(main())
