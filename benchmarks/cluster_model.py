"""The cluster step-time and memory model against published multi-GPU runs it was not fitted on.

The development set (docs/ARCHITECTURE.md, "The cluster model's development set"): Narayanan et al. 2021
(Megatron-LM, SC21) Table 1, ten GPT models on 32-3,072 A100 80GB; Korthikanti et al. 2022 Table 5, four
models with full recompute + tensor parallelism and with selective recompute + sequence parallelism; their
Figure 1 per-GPU memory. Each run is planned with `trainwise plan`'s own function (planner.plan.plan_run)
from the inputs the file gives: model shape, layout, batch, recompute, fp16 with Megatron-LM's mixed
precision (16-bit weights and activations, fp32 main gradients, master and Adam: 18 bytes per parameter),
unfused attention (2021-22: no FlashAttention), gradient all-reduce overlapped (torch DDP) up to 18.4B and
after backward (Megatron's local DDP) from 39.1B. Nothing below is fitted to a run: every kernel and
collective figure is a published microbenchmark (trainwise.hardware.table, trainwise.cost.comm), and one
value, the in-step factor of tensor-core kernels (trainwise.cost.cluster.IN_STEP), is fitted across all the
rows of both sets at once (`--in-step X` plans them at another value).

The second development set (H100, bf16 and FP8; FSDP; context parallelism; expert parallelism),
transcribed with its sources in benchmarks/cluster_dev_set_2.py, is planned the same way: every dense row (FP8
with the planner's FP8 recipes, context parallelism as ring attention), the MoE rows as their own family.

    python benchmarks/cluster_model.py                 # the table and the --fit (about two minutes)
    python benchmarks/cluster_model.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

import cluster_dev_set_2 as S2

from trainwise.cli import main as cli_main
from trainwise.config import ModelConfig
from trainwise.cost import cluster
from trainwise.cost.layout import make_layout
from trainwise.cost.rank_memory import rank_peak
from trainwise.cost.recipe import get_recipe, with_fp8_params, with_grad_dtype
from trainwise.cost.run import MOE_IMBALANCE, Machine, Run
from trainwise.errors import TrainwiseError
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


# The families the summary reports (a row counts in every family whose feature it uses)
FIRST, H100, FSDP, CP, FP8, MOE = ("A100 Megatron fp16 (first set)", "H100 (bf16 and FP8)", "FSDP", "CP", "FP8",
                                   "MoE (Megatron-Bridge, H100)")
FAMILIES = (FIRST, H100, FSDP, CP, FP8, MOE)


def plan2(cfg: ModelConfig, gpus: int, *, seq: int, micro_batch: int, grad_accum: int, recipe: str,
          checkpointing: str, machine: Machine, compiled: bool = False, fused: bool | None = None,
          loss_kernel: str | None = None, grad_dtype: str | None = None, moe_imbalance: float = MOE_IMBALANCE,
          fp8_params: bool = False, **layout):
    """A second-set row planned with `trainwise plan`'s function (no per-row setting: the table's assumption)."""
    lay = make_layout(gpus, micro_batches=grad_accum, **layout)
    states = get_recipe(recipe) if grad_dtype is None else with_grad_dtype(get_recipe(recipe), grad_dtype)
    states = with_fp8_params(states) if fp8_params else states
    return plan_run(Run(cfg, micro_batch=micro_batch, seq_len=seq, grad_accum=grad_accum, recipe=states,
                        checkpointing=checkpointing, compiled=compiled, layout=lay, tokens=1e9, machine=machine,
                        fused=fused, loss_kernel=loss_kernel, moe_imbalance=moe_imbalance))


def header(table: S2.Table, note: str = "") -> None:
    print(f"\n{table.key}. {table.title} ({table.source})")
    for text in (f"assumed (not published; for every row): {table.assumption}", note):
        print(textwrap.fill(text, 116, initial_indent="  ", subsequent_indent="    "))
    print(COLUMNS)


def compare(out: list, table: S2.Table, label: str, families: list[str], published_s: float, tokens_per_step: int,
            gpus: int, make, published_gib: float | None = None, published_tflops: float | None = None,
            note: str = "") -> None:
    """Plan one row (make() -> Plan), print published vs predicted step seconds, tokens/s/GPU and per-GPU peak
    memory (vs the published where there is one; TFLOP/s/GPU by the source's formula where that is what it
    published), and keep the row; a row that does not plan is printed with the planner's message."""
    row = {"run": f"{table.key} {label}", "table": table.key, "source": table.source, "families": families,
           "published_s": published_s, "published_tokens_per_s_gpu": tokens_per_step / gpus / published_s,
           "published_memory_gib": published_gib, "note": note}
    try:
        p = make()
    except TrainwiseError as e:
        out.append({**row, "predicted_s": None, "error": None, "failed": str(e)})
        print(f"{label:<38} {published_s:>9.3f}  does not plan: {e}", flush=True)
        return
    err, peak, reserved = p.step_seconds / published_s - 1, p.peak_bytes / GiB, p.reserved_bytes / GiB
    over = "*" if p.budget and p.peak_bytes > p.budget else " "
    mem = "" if published_gib is None else (f" reserved {reserved:5.1f} vs {published_gib:5.1f} "
                                            f"({reserved / published_gib - 1:+6.1%})")
    flops = "" if published_tflops is None else (f"  TFLOP/s/GPU {published_tflops:.0f} vs "
                                                 f"{published_tflops * published_s / p.step_seconds:.0f}")
    out.append({**row, "predicted_s": p.step_seconds, "error": err, "breakdown": p.cluster.breakdown, "mfu": p.mfu,
                "mfu_bf16_peak": p.mfu_bf16_peak,
                "predicted_tokens_per_s_gpu": tokens_per_step / gpus / p.step_seconds, "predicted_memory_gib": peak,
                "predicted_reserved_gib": reserved,
                "memory_error": None if published_gib is None else reserved / published_gib - 1})
    print(f"{label:<38} {published_s:>9.3f} {p.step_seconds:>9.3f} {err:>+7.1%} "
          f"{row['published_tokens_per_s_gpu']:>8.0f} {out[-1]['predicted_tokens_per_s_gpu']:>8.0f}  "
          f"{peak:5.1f}{over}{mem}  {terms(p)}{flops}" + (f"  [{note}]" if note else ""), flush=True)


COLUMNS = (f"{'row':<38} {'publ. s':>9} {'pred. s':>9} {'error':>7} {'publ t/s':>8} {'pred t/s':>8}  peak GiB "
           "(reserved vs publ)  breakdown (s)")
PEAK_NOTE = ("publ./pred. s: seconds per optimizer step; t/s: tokens/s per GPU; peak GiB: the plan's highest rank's "
             "peak (Plan.peak_bytes), * above the GPU's memory (the published run ran)")
DGX_H100 = Machine(gpu="h100-sxm")  # DGX H100 (tables A, B, B2, C, E)


def table_a(rows: list) -> None:
    header(S2.MEGATRON_R08, PEAK_NOTE + "; published s = global batch x Megatron-LM's FLOPs per sample / (GPUs x "
           "published TFLOP/s/GPU), S2.megatron_flops_per_sample")
    for r in S2.TABLE_A:
        m = r.global_batch // r.dp  # micro-batch 1
        compare(rows, S2.MEGATRON_R08, f"{r.name} tp{r.tp} pp{r.pp} dp{r.dp} m{m}", [H100], S2.published_step_a(r),
                r.global_batch * S2.A_SEQ, r.gpus,
                lambda r=r, m=m: plan2(S2.megatron_gpt(r), r.gpus, seq=S2.A_SEQ, micro_batch=1, grad_accum=m,
                                       recipe="megatron", checkpointing="none", machine=DGX_H100, tp=r.tp, pp=r.pp,
                                       sequence_parallel=True, zero=1, dp_overlap=True, tp_overlap="te"))


def table_b(rows: list) -> None:
    """NeMo 24.07 FP8 (delayed scaling), and its long-sequence table with context parallelism."""
    check = [S2.nemo_flops_per_token(S2.nemo_model(r.model, r.seq), r.seq, S2.NEMO_FORMULA_VOCAB.get(r.model[:4]))
             * r.tokens_per_s_gpu / 1e12 / r.tflops_per_gpu - 1 for r in S2.TABLE_B]
    header(S2.NEMO_2407, f"{PEAK_NOTE}; the shapes reproduce the published model TFLOP/s/GPU from the published "
           f"tokens/s under NeMo's formula (S2.nemo_flops_per_token) within {max(map(abs, check)):.1%} on every row")
    for r in S2.TABLE_B:
        compare(rows, S2.NEMO_2407, f"{r.model} {r.gpus}g tp{r.tp} pp{r.pp} cp{r.cp} vp{r.vp} m{r.grad_accum}",
                [H100, FP8] + [CP] * (r.cp > 1), S2.published_step_from_tokens(r), r.global_batch * r.seq, r.gpus,
                lambda r=r: plan2(S2.nemo_model(r.model, r.seq), r.gpus, seq=r.seq, micro_batch=r.micro_batch,
                                  grad_accum=r.grad_accum, recipe="fp8-delayed", checkpointing="none", machine=DGX_H100,
                                  tp=r.tp, pp=r.pp, cp=r.cp, vpp=r.vp, zero=1, dp_overlap=True,
                                  tp_overlap="te" if r.tp > 1 else None, pp_overlap=True))
    header(S2.NEMO_LONG, f"{PEAK_NOTE}; TFLOP/s/GPU: published (with CP) vs predicted, both by NeMo's llama2 formula")
    for r in S2.TABLE_B_LONG:
        compare(rows, S2.NEMO_LONG, f"Llama2-7B {r.seq // 1024}K {r.gpus}g tp{r.tp} pp{r.pp} dp{r.dp} cp{r.cp}",
                [H100, FP8] + [CP] * (r.cp > 1), S2.published_step_b2(r), r.global_batch * r.seq, r.gpus,
                lambda r=r: plan2(S2.nemo_model("LLAMA2-7B", r.seq), r.gpus, seq=r.seq, micro_batch=1,
                                  grad_accum=r.global_batch // r.dp,
                                  recipe="fp8-delayed", checkpointing="none", machine=DGX_H100, tp=r.tp, pp=r.pp,
                                  cp=r.cp, zero=1, dp_overlap=True, tp_overlap="te" if r.tp > 1 else None),
                published_tflops=r.tflops_with_cp)


def table_c(rows: list) -> None:
    """Megatron-Bridge 25.11: the dense FP8-CS rows, and the MoE rows as their own family."""
    header(S2.BRIDGE_2511, PEAK_NOTE)
    for r in S2.TABLE_C:
        fp8 = r.precision.startswith("fp8")
        fams = [MOE] if r.moe else [H100] + [FP8] * fp8 + [CP] * (r.cp > 1) + [FSDP] * (r.fsdp > 0)
        label = f"{r.model} {r.gpus}g {r.precision} tp{r.tp} pp{r.pp} cp{r.cp} vp{r.vp or 1} ep{r.ep}"
        compare(rows, S2.BRIDGE_2511, label, fams, S2.published_step_from_tokens(r), r.global_batch * r.seq, r.gpus,
                lambda r=r, fp8=fp8: plan2(S2.bridge_model(r), r.gpus, seq=r.seq, micro_batch=r.micro_batch,
                                  grad_accum=S2.bridge_accumulation(r), recipe="fp8" if fp8 else "bf16-mixed",
                                  checkpointing="none", grad_dtype="bf16", moe_imbalance=1.0,  # force-balanced
                                  fp8_params=fp8,
                                  machine=DGX_H100, ep=r.ep, etp=1 if r.moe else None,
                                  tp=r.tp, pp=r.pp, cp=r.cp, vpp=r.vp or 1, zero=3 if r.fsdp else 1, dp_overlap=True,
                                  fsdp_copies=False,
                                  tp_overlap="te" if r.tp > 1 and r.tp_comm_overlap else None,
                                  ep_overlap=r.a2a_overlap, fused=True, loss_kernel="te",
                                  pp_overlap=True,
                                  attention_impl="cudnn"))


def table_d(rows: list) -> None:
    """torchtitan on Grand Teton: FSDP, + torch.compile, + Float8, 2D / 3D with AsyncTP, and context parallel."""
    header(S2.TORCHTITAN_2412, PEAK_NOTE + "; the GPU's 96 GB: the budget; its 2.4 TB/s: the bandwidth the cluster "
           "step prices memory-bound kernels at; published memory: torchtitan's max_reserved_gib (the caching "
           "allocator's), against the plan's reserved (Plan.reserved_bytes: the peak, or the compute stream's high "
           "point plus FSDP's gradient shards, which its reduce-scatter allocates on its own stream; at least that, "
           "fragmentation not counted)")
    teton = Machine(gpu="h100-sxm", memory=int(S2.D_MEMORY), bandwidth=S2.D_BANDWIDTH, clock_share=S2.D_CLOCK_SHARE)
    for r in S2.TABLE_D:
        m = S2.titan_micro_batches(r)
        compare(rows, S2.TORCHTITAN_2412, f"{r.model} {r.layout}, {r.technique}", [H100, FSDP] + [FP8] * r.float8,
                S2.published_step_d(r), r.global_batch * S2.D_SEQ, r.gpus,
                lambda r=r, m=m: plan2(S2.titan_model(r.model), r.gpus, seq=S2.D_SEQ, micro_batch=r.local_batch // m,
                                       grad_accum=m, recipe="fp8" if r.float8 else "amp",
                                       checkpointing="op" if r.checkpointing == "selective" else r.checkpointing,
                                       machine=teton, compiled=r.compiled, tp=r.tp,
                                       pp=r.pp, vpp=r.vpp, zero=2 if r.pp > 1 else 3,
                                       tp_overlap="async" if r.async_tp else None, loss_kernel="torch"),
                r.memory_gib)
    for r in S2.TABLE_D_CP:
        compare(rows, S2.TORCHTITAN_2412, f"8B seq {r.seq // 1024}K FSDP {r.dp} CP {r.cp}, compile + Float8",
                [H100, FSDP, FP8] + [CP] * (r.cp > 1), S2.published_step_d_cp(r), r.dp * r.seq, r.gpus,
                lambda r=r: plan2(S2.titan_model("8B", r.seq), r.gpus, seq=r.seq, micro_batch=1, grad_accum=1,
                                  recipe="fp8", checkpointing="full", machine=teton, compiled=True, cp=r.cp, zero=3,
                                  cp_impl="allgather", loss_kernel="torch"),
                r.memory_gib)


def table_e(rows: list) -> None:
    header(S2.FOUNDRY, PEAK_NOTE + "; published s = global batch x seq / (GPUs x tokens/s/GPU). No memory "
           "published")
    for r in S2.TABLE_E:
        ckpt = "full" if r.checkpointing else "none"
        compare(rows, S2.FOUNDRY, f"MPT-{r.model} seq {r.seq} {r.gpus} GPUs {r.micro_batch}x{r.grad_accum} {ckpt}",
                [H100, FSDP], S2.published_step_e(r), r.global_batch * r.seq, r.gpus,
                lambda r=r, ckpt=ckpt: plan2(S2.mpt(r.model, r.seq), r.gpus, seq=r.seq, micro_batch=r.micro_batch,
                                             grad_accum=r.grad_accum, recipe="amp", checkpointing=ckpt,
                                             machine=DGX_H100, zero=3, fsdp_copies=False,
                                             fsdp_grad_sync="micro-batch", fsdp_prefetch="post",
                                             loss_kernel="flash-attn"))


def dev_set_2() -> list[dict]:
    """Every row of the second development set planned (benchmarks/cluster_dev_set_2.py): dense bf16 and FP8,
    context parallelism included, and the MoE rows (their own family)."""
    print("\n\nSecond development set (benchmarks/cluster_dev_set_2.py): H100, bf16 and FP8, dense and MoE; nothing "
          "fitted per row")
    rows = []
    table_a(rows)
    table_b(rows)
    table_c(rows)
    table_d(rows)
    table_e(rows)
    return rows


def families(rows: list[dict]) -> dict:
    """Per family: rows planned, the signed median and the median |error| of the step time (a row counts in every
    family whose feature it uses); the totals over both sets' dense rows; and the second set's per-GPU memory
    against the published."""
    print("\nper family: step time, predicted / published - 1")
    out = {}
    for fam in FAMILIES:
        errs = [r["error"] for r in rows if fam in r.get("families", ()) and r.get("error") is not None]
        failed = sum(fam in r.get("families", ()) and r.get("error") is None for r in rows)
        out[fam] = {"rows": len(errs), "failed": failed,
                    "signed_median": statistics.median(errs) if errs else None,
                    "median_abs": statistics.median(map(abs, errs)) if errs else None}
        got = (f"signed median {out[fam]['signed_median']:+7.1%}, median |error| {out[fam]['median_abs']:6.1%}"
               if errs else "no plannable row yet")
        print(f"  {fam:<32} {len(errs):>3} rows  {got}" + (f"; {failed} did not plan" if failed else ""))
    dense = [r for r in rows if MOE not in r.get("families", ())]
    planned = [r for r in dense if r.get("error") is not None]
    worst = max(planned, key=lambda r: abs(r["error"]))
    out["total"] = {"rows": len(planned), "median_abs": statistics.median(abs(r["error"]) for r in planned),
                    "worst_abs": abs(worst["error"]), "worst_run": worst["run"],
                    "failed": sum(r.get("error") is None for r in dense)}
    print(f"  {'total, dense rows of both sets':<32} {len(planned):>3} rows  median |error| "
          f"{out['total']['median_abs']:6.1%}, worst |error| {out['total']['worst_abs']:.1%} ({worst['run']})"
          + (f"; {out['total']['failed']} did not plan" if out["total"]["failed"] else ""))
    mem = [r["memory_error"] for r in rows if r.get("memory_error") is not None]
    if mem:
        out["memory"] = {"rows": len(mem), "signed_median": statistics.median(mem),
                         "median_abs": statistics.median(map(abs, mem)),
                         "within_10pct": sum(abs(e) <= 0.1 for e in mem)}
        print(f"  per-GPU reserved memory vs published (torchtitan's max reserved GiB): {len(mem)} rows, signed median "
              f"{out['memory']['signed_median']:+.1%}, median |error| {out['memory']['median_abs']:.1%}, "
              f"{out['memory']['within_10pct']} within the 10% target")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--in-step", type=float, default=cluster.IN_STEP,
                    help="the in-step factor of tensor-core kernels (trainwise.cost.cluster.IN_STEP, "
                         f"{cluster.IN_STEP}), to rescan its fit")
    args = ap.parse_args()
    cluster.IN_STEP = args.in_step
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
                     "error": err, "breakdown": p.cluster.breakdown, "mfu": p.mfu, "families": [FIRST]})
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
                         "predicted_s": p.step_seconds, "error": err, "breakdown": p.cluster.breakdown, "mfu": p.mfu,
                         "families": [FIRST]})
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
    set2 = dev_set_2()
    summary = families(rows + set2)
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
        Path(args.json).write_text(json.dumps({"runs": rows, "speedups": speedups, "memory": memory,
                                               "dev_set_2": {"runs": set2, "families": summary}},
                                              indent=1))
    return fit_rc


if __name__ == "__main__":
    raise SystemExit(main())
