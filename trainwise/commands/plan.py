"""`trainwise plan`: parameters, FLOPs, memory and time of a run before it runs (trainwise.planner)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from trainwise.commands.args import byte_size, number, positive_number, whole_number
from trainwise.config import CHECKPOINTING, load_config
from trainwise.config.run import FSDP_GRAD_SYNCS, PP_SCHEDULES
from trainwise.cost.loss import STACK_LOSSES
from trainwise.cost.layout import (ATTENTION_IMPLS, CP_IMPLS, EP_DISPATCHES, FSDP_PREFETCHES, TP_OVERLAPS, Layout,
                                   make_layout)
from trainwise.cost.recipe import (FP8_SCALINGS, GRAD_DTYPES, OPTIMIZER_MOMENTS, RECIPE_ALIASES, RECIPES,
                                   get_recipe, with_fp8_params, with_grad_dtype)
from trainwise.cost.run import MOE_IMBALANCE, Machine, Run
from trainwise.cost.time import DEFAULT_MFU
from trainwise.errors import TrainwiseError
from trainwise.hardware.memory import cpu_available_bytes
from trainwise.hardware.table import get_accelerator
from trainwise.planner.derivation import does_not_fit, plan_table
from trainwise.planner.fit import fit_layout, fit_run, global_batch_sequences
from trainwise.planner.layouts import fit_run_layouts
from trainwise.planner.plan import check_micro_batches, check_numbers, plan_run
from trainwise.planner.spec import load_model
from trainwise.scale.fitting import plan_prediction
from trainwise.units import fmt_bytes
from trainwise.verify.simulate import simulate_report, simulate_step

PLAN_EXAMPLES = """examples:
  trainwise plan --model llama-3-8b --tokens 15e12 --gpu h100 --gpus 1024 --zero 3 --seq-len 8192
  trainwise plan --params 1e9 --tokens 1e10 --peak-flops 100e12 --precision fp32 --json
  trainwise plan --model config.json --tokens 1e11 --gpu a100-80gb --fit --global-batch 512
  trainwise plan --model config.json --tokens 1e11          (no hardware: everything but time)
  trainwise plan --model llama-3-8b --fit --memory-budget 80GiB --global-batch-tokens 4e6 --seq-len 8192
"""


def register(sub, help_text: str) -> None:
    p = sub.add_parser("plan", help=help_text, epilog=PLAN_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="preset name, trainwise TOML, or Hugging Face config.json")
    p.add_argument("--params", type=number, help="parameter count N alone (6ND rule; activations unknown)")
    p.add_argument("--tokens", type=number, default=None,
                   help="training tokens D (without it: everything per step, no total time or cost; a trainwise "
                        "TOML's run length by default)")
    p.add_argument("--seq-len", type=whole_number, help="sequence length T")
    p.add_argument("--micro-batch", type=whole_number, help="sequences per micro-batch B")
    p.add_argument("--grad-accum", type=whole_number, help="gradient accumulation steps K")
    p.add_argument("--precision", help=f"recipe: {', '.join(list(RECIPES) + list(RECIPE_ALIASES))}")
    p.add_argument("--fp8-recipe", choices=list(FP8_SCALINGS),
                   help="with --precision fp8: the FP8 scaling (default current: per-tensor, just in time)")
    p.add_argument("--grad-dtype", choices=list(GRAD_DTYPES), default=None,
                   help="the main gradients' dtype, in which micro-batches accumulate and data parallelism reduces "
                        "them (recipes with an fp32 master: megatron, bf16-mixed, fp8, mxfp8): bf16 is Megatron-Core's "
                        "--grad-reduce-in-bf16 (default: the recipe's, fp32 but for bf16-mixed)")
    p.add_argument("--fp8-params", action="store_true",
                   help="with an FP8 precision: the FP8 linear layers' weights kept as FP8 parameters, 1 byte each "
                        "with their transposes, gathered in FP8 (Megatron-Core's --fp8-param-gather, Transformer "
                        "Engine's fp8_model_init); the fp32 master stays in the optimizer")
    p.add_argument("--optimizer", choices=list(OPTIMIZER_MOMENTS), help="adamw, sgd, sgd-momentum")
    p.add_argument("--checkpointing", choices=list(CHECKPOINTING))
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage (FSDP = 3)")
    p.add_argument("--dp-shard", type=whole_number, default=None,
                   help="HSDP with --zero 3: the data-parallel ranks one shard group spans, replicated over the rest "
                        "(torchtitan's data_parallel_shard_degree; default: all of them, FSDP)")
    p.add_argument("--fsdp-grad-sync", choices=list(FSDP_GRAD_SYNCS), default=None,
                   help="with --zero 3 and accumulation, when gradients are reduce-scattered: once per step, after the "
                        "last micro-batch (their unsharded fp32 sum held until then), or each micro-batch's into the "
                        "rank's shard (default: step where trainwise would train the run, as its trainer does; "
                        "micro-batch for other stacks' recipes, as torchtitan's FSDP2 and Megatron-FSDP run them)")
    p.add_argument("--fsdp-prefetch", choices=list(FSDP_PREFETCHES), default="pre",
                   help="with --zero 3, when backward gathers the next block: pre, under this block's backward "
                        "(FSDP2, FSDP1's BACKWARD_PRE; the default), or post, once it is done (FSDP1's "
                        "BACKWARD_POST, Composer's default): each gather exposed, one block gathered at a time, "
                        "and FSDP1's flat parameters gathered in place (no FSDP2 copies)")
    p.add_argument("--tp", type=whole_number, default=1, help="tensor-parallel ranks (inside a node)")
    p.add_argument("--pp", type=whole_number, default=1, help="pipeline stages")
    p.add_argument("--vpp", type=whole_number, default=1, help="virtual stages per pipeline rank (interleaved 1F1B)")
    p.add_argument("--pp-schedule", choices=list(PP_SCHEDULES), default=None,
                   help="pipeline schedule (default 1f1b, interleaved with --vpp > 1); interleaved_zb, zbv and "
                        "dualpipev split each backward in two (zero bubble), zbv and dualpipev with --vpp 2 in a V")
    p.add_argument("--cp", type=whole_number, default=1, help="context-parallel ranks (the sequence split)")
    p.add_argument("--cp-impl", choices=list(CP_IMPLS), default=None,
                   help="how cp exchanges keys and values: ring (p2p under attention; the default), allgather, a2a "
                        "(Ulysses)")
    p.add_argument("--ep", type=whole_number, default=1, help="expert-parallel ranks (MoE; out of dp x cp)")
    p.add_argument("--ep-dispatch", choices=list(EP_DISPATCHES), default=None,
                   help="how ep moves tokens to their experts: alltoall (the default: each routed copy to its "
                        "expert's rank), allgather (every token gathered over tp x ep, outputs reduce-scattered: "
                        "Megatron-Core's allgather dispatcher)")
    p.add_argument("--etp", type=whole_number, default=None,
                   help="expert tensor parallelism: the routed experts' width over etp ranks (default: tp)")
    p.add_argument("--moe-imbalance", type=number, default=None,
                   help=f"MoE: the most loaded expert-parallel rank's tokens over the mean, in its step time and its "
                        f"experts' saved activations (default "
                        f"{MOE_IMBALANCE:g}: trained routing with the experts' loads balanced, the step-to-step spread "
                        f"a published trace measured; 1: force-balanced, as MoE benchmarks run)")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="shard norms/dropout over the sequence with tp (default: on when tp > 1)")
    p.add_argument("--fp8-attention", action="store_true",
                   help="with an FP8 precision: attention in FP8 too (cuDNN's FP8 kernel, Transformer Engine's FP8 "
                        "dot-product attention; default: attention in bf16)")
    p.add_argument("--attention-impl", choices=[i for i in ATTENTION_IMPLS if i != "cudnn-fp8"], default="flash",
                   help="flash (the GPU's default fused kernel: FlashAttention-2 on Ampere and Hopper, cuDNN's on "
                        "Blackwell), flash2, flash3 (Hopper), cudnn (Hopper, Blackwell), or unfused (scores in memory: "
                        "the published 2021-22 runs)")
    p.add_argument("--no-dp-overlap", action="store_true",
                   help="reduce gradients after backward instead of under it (Megatron-LM's 'local' DDP)")
    p.add_argument("--tp-overlap", nargs="?", const="async", choices=TP_OVERLAPS,
                   help="tensor-parallel collectives under the GEMMs: async (the bare flag: torchtitan's AsyncTP, the "
                        "forward's) or te (Transformer Engine's, as Megatron-Core's --tp-comm-overlap: every pass's)")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="the stack fuses element-wise work (Transformer Engine, Megatron's kernels; default: compiled "
                        "runs and the megatron and FP8 recipes)")
    p.add_argument("--loss-kernel", choices=STACK_LOSSES, default=None,
                   help="the stack's cross-entropy, by what it keeps: torch (F.cross_entropy: fp32 log-softmax rows "
                        "and two fp32 B*T*V buffers in backward), megatron (vocab_parallel_cross_entropy: the fp32 "
                        "softmax, its gradient made over it), flash-attn (its fused kernel, as llm-foundry runs it: "
                        "the logits and one gradient as wide), te (Transformer Engine's, Megatron-Core's "
                        "cross_entropy_fusion_impl te: the gradient written over the logits); default: trainwise's "
                        "own where it trains the run, megatron elsewhere")
    p.add_argument("--ep-overlap", action="store_true",
                   help="MoE: expert-parallel all-to-alls under another micro-batch's work (Megatron's combined 1F1B)")
    p.add_argument("--pp-overlap", action="store_true",
                   help="interleaved pipeline (--vpp > 1): sends and receives under the neighbouring chunks' work, "
                        "only the warm-up's and cool-down's exposed (Megatron-Core's overlap_p2p_comm)")
    p.add_argument("--gpus-per-node", type=whole_number, help="override the GPU's node (hardware table)")
    p.add_argument("--intra-node-bw", type=number, help="NVLink bandwidth, bytes/s per GPU per direction")
    p.add_argument("--inter-node-bw", type=number, help="network bandwidth, bytes/s per GPU per direction")
    p.add_argument("--gpus", type=whole_number, default=1)
    p.add_argument("--gpu", help="accelerator name (see `trainwise hardware`)")
    p.add_argument("--peak-flops", type=number, help="peak FLOP/s per device (overrides --gpu)")
    p.add_argument("--bandwidth", type=number, help="memory bandwidth, bytes/s")
    p.add_argument("--clock-share", type=number,
                   help="a table GPU held under its datasheet's power (a power limit below its TDP): the share of its "
                        "published kernel rates its tensor cores reach, e.g. 0.92 (default 1)")
    p.add_argument("--memory", type=byte_size, help="device memory capacity (bytes or 80GiB)")
    p.add_argument("--memory-budget", type=byte_size, help="per-device budget for `fits` (bytes, 80GiB or 80GB)")
    p.add_argument("--mfu", type=number, default=None,
                   help="what-if: time at this model FLOP utilisation instead of the step-time model (which "
                        f"prices each operator on --gpu cpu or a table GPU; else {DEFAULT_MFU} is assumed)")
    p.add_argument("--price", type=number, help="$ per device-hour")
    p.add_argument("--causal-halving", action="store_true", help="halve attention score/value FLOPs (causal)")
    p.add_argument("--fit", action="store_true", help="search micro-batch, grad-accum, checkpointing, ZeRO")
    p.add_argument("--global-batch", type=whole_number, help="--fit target, in sequences")
    p.add_argument("--global-batch-tokens", type=positive_number,
                   help="--fit target, in tokens (rounded to whole sequences, and said so)")
    p.add_argument("--json", action="store_true", help="print JSON only (SI units)")
    p.add_argument("--explain", action="store_true", help="print each formula with the numbers substituted")
    p.add_argument("--simulate", action="store_true",
                   help="also run one training step on fake tensors and print tracked vs analytic memory")
    p.set_defaults(func=cmd_plan)



def cmd_plan(args: argparse.Namespace) -> int:
    model, toml_run = (load_model(args.model) if args.model else (None, None))
    if args.tokens is None and toml_run and toml_run.tokens and not args.simulate:
        args.tokens = toml_run.tokens  # a trainwise TOML knows its run length
    if model is None and args.params is None:
        raise TrainwiseError("give --model PRESET|FILE or --params N.")
    unused = flags_not_used(args, model)
    if unused:
        one = len(unused) == 1
        raise TrainwiseError(f"{'; '.join(unused)}: drop {'it' if one else 'them'}, or plan a run "
                             f"{'it applies' if one else 'they apply'} to (a flag that changes nothing would leave "
                             "the plan looking like its answer).")
    if args.tokens is None and args.simulate:
        args.tokens = 1.0  # --simulate is about one step; time figures then cover one token
        if not args.gpu and not args.peak_flops:
            args.peak_flops = 1e12  # no time figures are shown; any peak will do
    if args.fit:
        return _cmd_fit(args, model, toml_run)
    run = run_from_args(args, model, toml_run)
    plan = plan_run(run, mfu=args.mfu, price=args.price, memory_budget=args.memory_budget,
                    causal_halving=args.causal_halving, params_count=args.params if model is None else None)
    if args.simulate:
        return _cmd_simulate(args, run, plan)
    scaling = _scaling_prediction(args.model, model, args.tokens) if args.tokens else None
    if args.json:
        print(json.dumps({**plan.to_json(), **({"predicted_loss": scaling} if scaling else {})}, indent=2))
    elif args.explain:
        print(plan.explain())
    else:
        print(plan_table(plan))
    if scaling and scaling["not_identified"] and not args.json:
        print(f"{'predicted val loss':<22} none: the `trainwise scale` fit of this corpus refuses: "
              f"{scaling['not_identified']}")
    elif scaling and not args.json:
        lo, hi = scaling["loss_p5_p95"]
        recipe = f"{scaling['recipe']['schedule']}-LR " if scaling["recipe"] else ""
        print(f"{'predicted val loss':<22} {scaling['loss']:.4f} nats/token (5-95%: {lo:.4f}-{hi:.4f}; "
              f"`trainwise scale` fit of this corpus, for a {recipe}run like the fitted ones"
              f"{'; extrapolated' if scaling['extrapolates'] else ''})")
        if scaling["repetition_note"]:
            print(f"{'':<22} warning: {scaling['repetition_note']}")
    return 0


def flags_not_used(args: argparse.Namespace, model) -> list[str]:
    """The flags given that the plan of `model` (None: --params alone) would ignore, each with why; --fit's
    candidates take the layout flags wherever they apply, so only the model decides there."""
    unused = []
    if model is not None and args.params is not None:
        unused.append(f"--params {args.params:g} counts a model known only by its size, and --model "
                      f"{args.model} gives the whole model")
    if model is None or not model.is_moe:
        what = "known only by --params" if model is None else f"{model.name}, a dense model"
        unused += [f"{flag} applies to Mixture-of-Experts layers, and the model is {what}"
                   for flag, given in (("--etp", args.etp is not None), ("--ep-dispatch", args.ep_dispatch is not None),
                                       ("--ep-overlap", args.ep_overlap),
                                       ("--moe-imbalance", args.moe_imbalance is not None)) if given]
    if args.fit:
        return unused
    if args.cp_impl is not None and args.cp == 1:
        unused.append(f"--cp-impl {args.cp_impl} is how context parallelism exchanges keys and values, and --cp is 1")
    if args.pp_overlap and args.vpp == 1:
        unused.append("--pp-overlap hides the interleaved schedule's sends, and --vpp is 1")
    if args.ep_overlap and args.ep == 1 and model is not None and model.is_moe:
        unused.append("--ep-overlap hides expert-parallel all-to-alls, and --ep is 1")
    if args.fsdp_prefetch != "pre" and args.zero != 3:
        unused.append(f"--fsdp-prefetch {args.fsdp_prefetch} is when FSDP gathers in backward, and --zero is "
                      f"{args.zero}, not 3")
    if args.fsdp_grad_sync is not None and args.zero != 3:
        unused.append(f"--fsdp-grad-sync {args.fsdp_grad_sync} is when FSDP reduce-scatters, and --zero is "
                      f"{args.zero}, not 3")
    if args.tp == 1:
        unused += [f"{flag} applies to tensor parallelism, and --tp is 1"
                   for flag, given in (("--sequence-parallel", args.sequence_parallel),
                                       (f"--tp-overlap {args.tp_overlap}", args.tp_overlap is not None)) if given]
    return unused


def attention_impl(args: argparse.Namespace) -> str:
    """The attention kernel the flags name: --fp8-attention is cuDNN's FP8 kernel."""
    if not args.fp8_attention:
        return args.attention_impl
    if args.attention_impl not in ("flash", "cudnn"):
        raise TrainwiseError(
            f"--fp8-attention runs cuDNN's FP8 attention (Transformer Engine's FP8 dot-product attention), and "
            f"--attention-impl {args.attention_impl} names another kernel: drop one of the two.")
    return "cudnn-fp8"


def run_from_args(args: argparse.Namespace, model, toml_run: Run | None, layout: Layout | None = None) -> Run:
    """The run the flags describe: a trainwise TOML's [train] run (load_model), or the defaults (seq_len
    2048 or the model's shorter context, one sequence per step, the bf16 recipe, AdamW, no checkpointing),
    under the flags given; the layout of --gpus split by --tp, --pp, --vpp, --cp, --ep with --zero (or
    `layout`, --fit's); --global-batch sets the accumulation steps (not under --fit, which searches them)."""
    base = toml_run or Run(model, seq_len=2048 if model is None else min(2048, model.max_seq_len),
                           recipe=get_recipe("bf16"))
    given = {key: getattr(args, key) for key in ("seq_len", "micro_batch", "grad_accum", "optimizer", "checkpointing",
                                                 "moe_imbalance", "fused", "loss_kernel")
             if getattr(args, key) is not None}
    run = replace(base, model=model, tokens=args.tokens, **given)
    check_numbers(("--tokens", run.tokens), ("--seq-len", run.seq_len), ("--micro-batch", run.micro_batch),
                  ("--grad-accum", run.grad_accum), ("--tp", args.tp), ("--pp", args.pp), ("--cp", args.cp),
                  ("--gpus", args.gpus))
    if args.global_batch and not args.fit:
        run = replace(run, grad_accum=accumulation_for(args.global_batch, run.micro_batch,
                                                       args.gpus // (args.tp * args.pp * args.cp), args.grad_accum))
    check_micro_batches(run.grad_accum)
    if layout is None:
        layout = make_layout(args.gpus, tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep,
                             sequence_parallel=args.sequence_parallel, zero=args.zero, micro_batches=run.grad_accum,
                             dp_overlap=not args.no_dp_overlap, attention_impl=attention_impl(args),
                             tp_overlap=args.tp_overlap, cp_impl=args.cp_impl or "ring", etp=args.etp,
                             ep_overlap=args.ep_overlap, pp_schedule=args.pp_schedule, pp_overlap=args.pp_overlap,
                             dp_shard=args.dp_shard, fsdp_grad_sync=args.fsdp_grad_sync,
                             ep_dispatch=args.ep_dispatch or "alltoall", fsdp_prefetch=args.fsdp_prefetch)
    machine = Machine(gpu=args.gpu, peak_flops=args.peak_flops, bandwidth=args.bandwidth, memory=args.memory,
                      gpus_per_node=args.gpus_per_node, intra_node_bw=args.intra_node_bw,
                      inter_node_bw=args.inter_node_bw, clock_share=args.clock_share)
    recipe = get_recipe(args.precision) if args.precision is not None else run.recipe
    if args.fp8_recipe is not None:
        if recipe.fp8 not in FP8_SCALINGS:
            raise TrainwiseError(
                f"--fp8-recipe {args.fp8_recipe} chooses how --precision fp8 scales its FP8 tensors, but the "
                f"precision is {recipe.name}: add --precision fp8, or drop --fp8-recipe.")
        recipe = get_recipe("fp8" if args.fp8_recipe == "current" else f"fp8-{args.fp8_recipe}")
    if args.grad_dtype is not None:
        recipe = with_grad_dtype(recipe, args.grad_dtype)
    if args.fp8_params:
        recipe = with_fp8_params(recipe)
    if args.fp8_attention and not recipe.fp8:
        raise TrainwiseError(
            f"--fp8-attention computes attention in FP8 beside FP8 linear layers, but the precision is {recipe.name}: "
            "add --precision fp8 (or mxfp8 on Blackwell), or drop --fp8-attention.")
    return replace(run, recipe=recipe, layout=layout, machine=None if machine == Machine() else machine)


def accumulation_for(global_batch: int, micro_batch: int, dp: int, grad_accum: int | None) -> int:
    """The accumulation steps K of a global batch (sequences) = micro-batch x K x dp, or a clear error."""
    dp = max(dp, 1)
    k, rest = divmod(global_batch, micro_batch * dp)
    if rest or k == 0:
        raise TrainwiseError(
            f"--global-batch {global_batch} sequences is not micro-batch x dp x accumulation = "
            f"{micro_batch} x {dp} x K for a whole K; use a multiple of {micro_batch * dp}, e.g. "
            f"{max(1, round(global_batch / (micro_batch * dp))) * micro_batch * dp}.")
    if grad_accum is not None and grad_accum != k:
        raise TrainwiseError(
            f"--global-batch {global_batch} = micro-batch {micro_batch} x dp {dp} x accumulation {k}, but --grad-accum "
            f"{grad_accum} was given; drop one of them.")
    return k


def _scaling_prediction(spec: str | None, model, tokens: float) -> dict | None:
    """The stored `trainwise scale` fit's loss for this model on its corpus (a TOML's [data], else the
    built-in corpus), or None where no fit exists."""
    if model is None:
        return None
    return plan_prediction(model, tokens, load_config(spec).data if spec.endswith(".toml") else None)


def _cmd_fit(args, model, toml_run) -> int:
    if model is None:
        raise TrainwiseError("--fit needs a model config (--model), not only --params.")
    budget = args.memory_budget
    if budget is None:
        if not args.gpu:
            raise TrainwiseError("--fit needs --memory-budget or a --gpu whose capacity is known.")
        budget = _gpu_capacity(args.gpu)
    if not args.global_batch and not args.global_batch_tokens:
        raise TrainwiseError("--fit needs a target: --global-batch SEQUENCES or --global-batch-tokens TOKENS.")
    if args.dp_shard is not None:
        raise TrainwiseError("--fit searches ZeRO stages over every data-parallel rank, not HSDP's shard groups: drop "
                             "--dp-shard, or plan the HSDP layout without --fit.")
    if args.gpu and args.gpu.lower() not in ("cpu", "cuda") and args.peak_flops is None and args.mfu is None:
        layout = make_layout(args.gpus, dp_overlap=not args.no_dp_overlap, attention_impl=attention_impl(args),
                             cp_impl=args.cp_impl or "ring", tp_overlap=args.tp_overlap,
                             ep_overlap=args.ep_overlap, pp_overlap=args.pp_overlap,
                             ep_dispatch=args.ep_dispatch or "alltoall", fsdp_prefetch=args.fsdp_prefetch)
        layout = replace(layout, fsdp_grad_sync=args.fsdp_grad_sync)  # for the candidates with ZeRO-3 and one stage
        return _cmd_fit_layouts(args, run_from_args(args, model, toml_run, layout), budget)
    run = run_from_args(args, model, toml_run, fit_layout(args.gpus, args.tp, args.pp))
    seq = run.seq_len
    gb, note = global_batch_sequences(seq, run.layout.dp, sequences=args.global_batch, tokens=args.global_batch_tokens)
    good, bad = fit_run(run, global_batch=gb, memory_budget=budget, mfu=args.mfu, causal_halving=args.causal_halving)
    if args.json:
        print(json.dumps({"global_batch": {"sequences": gb, "tokens": gb * seq, "seq_len": seq, "note": note},
                          "best": [c.__dict__ for c in good[:3]], "rejected": [c.__dict__ for c in bad]}, indent=2))
        return 0
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
        print(f"no candidate fits: {_short_of(bad, budget)}; raise --gpus, --tp/--pp or the budget.")
    print(f"rejected ({len(bad)}):")
    for c in bad[:20]:
        print(f"  B={c.micro_batch} K={c.grad_accum} {c.checkpointing} ZeRO-{c.zero}: {c.reason}")
    if len(bad) > 20:
        print(f"  ... and {len(bad) - 20} more (use --json for all)")
    return 0  # no candidate that fits is an answer too


def _short_of(bad: list, budget: int) -> str:
    """How far the smallest candidate is from the budget: what a user must find to make one fit."""
    sized = [c for c in bad if c.per_device_bytes]
    if not sized:
        return "none can be planned (see the reasons below)"
    least = min(c.per_device_bytes for c in sized)
    if least <= budget:
        return "the ones within the memory budget cannot run for the reasons below"
    return (f"{does_not_fit(least - budget)}: the smallest needs {least / 2**30:.2f} GiB per device of "
            f"{budget / 2**30:.2f} GiB")


def _cmd_fit_layouts(args, run: Run, budget: int) -> int:
    """--fit on a table GPU: every layout of --gpus priced by the cluster model; the five fastest that fit."""
    seq, model = run.seq_len, run.model
    gb, note = global_batch_sequences(seq, 1, sequences=args.global_batch, tokens=args.global_batch_tokens)
    good, bad = fit_run_layouts(replace(run, tokens=args.tokens or gb * seq), global_batch=gb, memory_budget=budget)
    if args.json:
        print(json.dumps({"global_batch": {"sequences": gb, "tokens": gb * seq, "seq_len": seq, "note": note},
                          "best": [c.to_json() for c in good[:5]], "fitting": len(good),
                          "rejected": [c.to_json() for c in bad]}, indent=2))
        return 0
    print(f"fit: {model.name} on {args.gpus} x {args.gpu}, {gb} sequences x {seq} tokens per step, "
          f"{fmt_bytes(budget)} per GPU; {len(good) + len(bad)} layouts, {len(good)} fit")
    head = f"{'dp':>4} {'tp':>3} {'pp':>3} {'vpp':>3} {'cp':>3} {'ep':>3} {'zero':>4} {'B':>3} {'K':>4} {'ckpt':>9}"
    print(f"{head} {'memory/GPU':>12} {'step s':>9} {'MFU':>6}  largest terms (s)")
    for c in good[:5]:
        lay, b = c.layout, c.breakdown or {}
        top = ", ".join(f"{k[:-2]} {v:.3g}" for k, v in sorted(b.items(), key=lambda kv: -kv[1])[:4])
        print(f"{lay['dp']:>4} {lay['tp']:>3} {lay['pp']:>3} {lay['vpp']:>3} {lay['cp']:>3} {lay['ep']:>3} "
              f"{lay['zero']:>4} {c.micro_batch:>3} {lay['micro_batches']:>4} {c.checkpointing:>9} "
              f"{c.per_device_bytes / 2**30:>8.1f} GiB {c.step_seconds:>9.4g} {c.mfu:>6.1%}  {top}")
    if good:
        best, shown = good[0], {(c.layout["tp"], c.layout["pp"]) for c in good[:5]}
        others = {}
        for c in good[5:]:  # the best of each tensor x pipeline split not shown above, and what makes it slower
            others.setdefault((c.layout["tp"], c.layout["pp"]), c)
        for (tp, pp), c in sorted(others.items(), key=lambda kv: kv[1].step_seconds)[:6]:
            if (tp, pp) in shown:
                continue
            grow = sorted(((v - best.breakdown[k], k) for k, v in c.breakdown.items()), reverse=True)[:2]
            print(f"slower: tp {tp} pp {pp} at best {c.step_seconds:.4g} s "
                  f"({c.step_seconds / best.step_seconds - 1:+.0%}): "
                  + ", ".join(f"{k[:-2]} {d:+.3g} s" for d, k in grow if d > 0))
    else:
        print(f"no layout fits: {_short_of(bad, budget)}; raise --gpus or the budget, or use checkpointing/ZeRO.")
    reasons: dict[str, list] = {}
    for c in bad:
        key = "do not fit in memory" if "GiB per GPU" in c.reason else c.reason[:110]
        reasons.setdefault(key, []).append(c)
    print(f"set aside ({len(bad)}):")
    for reason, cands in sorted(reasons.items(), key=lambda kv: -len(kv[1]))[:8]:
        c = min(cands, key=lambda c: c.per_device_bytes or float("inf"))
        example = (f" (the smallest: tp {c.layout['tp']} pp {c.layout['pp']} B {c.micro_batch} {c.checkpointing}: "
                   f"{c.reason})" if reason.startswith("do not fit") else "")
        print(f"  {len(cands):>5} {reason}{example}")
    return 0


def _gpu_capacity(name: str) -> int:
    if name.lower() == "cpu":  # this machine: the memory available now (cgroup limit or MemAvailable)
        return cpu_available_bytes()[0]
    acc = get_accelerator(name)
    if acc.memory_bytes is None:
        raise TrainwiseError(f"{acc.name} has no known capacity; pass --memory-budget.")
    return acc.memory_bytes


def _cmd_simulate(args, run: Run, plan) -> int:
    """Planner vs one fake-tensor training step of the trainer's recipe (fp32, or bf16 autocast = amp)."""
    model = run.model
    if model is None:
        raise TrainwiseError("--simulate needs a model config (--model), not only --params.")
    asked = args.precision or run.recipe.name  # as given: a TOML's is fp32 or amp
    precision = "fp32" if asked == "fp32" else "bf16"
    if asked not in ("fp32", "amp"):  # what trainwise's trainer runs for bf16: autocast over fp32, on one device
        run = replace(run, recipe=get_recipe("amp"), tokens=args.tokens or 1,
                      layout=make_layout(1, zero=args.zero, micro_batches=run.grad_accum),
                      machine=Machine(gpu=args.gpu, peak_flops=args.peak_flops or (None if args.gpu else 1e12)))
        plan = plan_run(run, mfu=args.mfu)
    mem = simulate_step(plan.run.model, run.micro_batch, run.seq_len, precision, run.checkpointing,
                        "adamw" if run.optimizer == "adamw" else "sgd", run.grad_accum)
    if args.json:
        print(json.dumps({"plan": plan.to_json(), "simulated": mem.to_json()}, indent=2, default=str))
        return 0
    print(f"{model.name}: B={run.micro_batch} T={run.seq_len} K={run.grad_accum}, recipe {plan.recipe.name}, "
          f"{run.checkpointing} checkpointing; one step simulated on fake tensors (nothing allocated)")
    print(simulate_report(plan, mem))
    for note in plan.notes:
        print(f"note: {note}")
    return 0
