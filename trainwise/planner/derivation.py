"""`trainwise plan --explain`: the plan's worked derivation, each formula with the numbers substituted
and the result, like a worked example in a textbook; section 4, when the step-time model priced the
step, has the per-operator table, the phases, the largest contributors and the communication terms."""

from __future__ import annotations

from trainwise.cost import cluster
from trainwise.cost import loss as L
from trainwise.cost import memory as M
from trainwise.cost.gpu import attention_rate
from trainwise.cost.layout import ZERO_BUBBLE, placement
from trainwise.cost.recipe import optimizer_moments
from trainwise.cost.run import MOE_IMBALANCE, routed_imbalance
from trainwise.cost.steptime import COMPILED_ELEMENTWISE
from trainwise.units import fmt_bytes

NO_HARDWARE = ("no hardware given, so no time: add --gpu NAME (see `trainwise hardware`), --gpu cpu (this "
               "machine, measured) or --peak-flops P (FLOP/s per device)")


NO_TOKENS = ("no --tokens D given, so everything is per step: the run's total FLOPs, time and cost need the number of "
             "training tokens D (--tokens 1e10)")


SOURCES = {"calibrated": "calibrated on this machine (`trainwise hardware --calibrate`)"}


def explain_step(p) -> str:
    st, out = p.step, []
    add = out.append
    in_step = p.hardware.profile.in_step_for(p.recipe.compute_dtype) if p.hardware.profile else 1.0
    add(f"4. Time per step = sum over the step's operators + eager overhead + exposed communication "
        f"({SOURCES.get(st.source, st.source)})")
    add("   matmul and attention: timed at their shape and layout on this device (else F/P, F/R), + Q/BW: their "
        "operands from memory (timed hot, a step's kernel finds them evicted); other ops: Q/BW(q) of their class "
        "at their bytes per call q, at most at its rate from memory" + (f"; x{in_step:.3g}, what kernels lose "
        f"inside a real {p.recipe.compute_dtype} step" if in_step != 1 else "")
        + (f"; compiled: fused element-wise work at {COMPILED_ELEMENTWISE.get(p.recipe.compute_dtype, 1.0)} x its "
           "eager time" if st.compiled else ""))
    add("   (a matmul's shape: M x K x N, or batch x M x K x N, and its operands' layout, N row-major or T "
        "transposed; attention: batch x heads x kv heads x T x head dim)")
    add(f"   {'operator':<56} {'phase':<9} {'dtype':<5} {'calls':>6} {'FLOPs':>10} {'bytes':>10} {'time s':>10}  rule")
    rows = sorted(st.ops, key=lambda t: -t.seconds)
    for t in rows[:25]:
        o = t.op
        shape = (f" {'x'.join(map(str, o.shape[1:] if o.cls == 'matmul' and o.shape[0] == 1 else o.shape))} {o.layout}"
                 if o.shape else "")
        add(f"   {(o.name.removeprefix('aten.') + shape)[:56]:<56} {o.phase:<9} {o.dtype:<5} {o.calls:>6} "
            f"{o.flops:>10.3g} {o.bytes:>10.3g} {t.seconds:>10.4g}  {t.how}")
    if len(rows) > 25:
        add(f"   ... {len(rows) - 25} more operators, {sum(t.seconds for t in rows[25:]):.4g} s together")
    phases = st.by_phase()
    add("   per phase: " + ", ".join(f"{k} {v:.4g} s" for k, v in phases.items())
        + (" (backward includes the recompute of checkpointing)" if p.checkpointing != "none" else ""))
    top = st.top(3)
    share = ", ".join(f"{t.op.name.removeprefix('aten.')} ({t.op.phase}) {t.seconds / st.seconds:.0%}" for t in top)
    add(f"   largest contributors: {share}")
    add(f"   operators {st.compute_s:.4g} s + eager overhead {st.overhead_s:.4g} s + communication "
        f"{st.comm_s:.4g} s exposed" + (f" (of {sum(st.comm.values()):.4g} s: "
                                        + ", ".join(f"{k} {v:.4g} s" for k, v in st.comm.items()) + ")"
                                        if st.comm else "")
        + f" = {st.seconds:.4g} s per step")
    if st.comm_how:
        add(f"   communication: {st.comm_how}")
    _throughput(add, p, st.seconds)
    return "\n".join(out)


def _attention_rule(p) -> str:
    """Where the plan's attention rate comes from (cost.gpu.attention_rate's rule), for a fused kernel."""
    acc, cfg = p.hardware.accelerator, p.model
    if acc is None or cfg is None or p.layout.attention_impl == "unfused":
        return ""
    return f" ({attention_rate(acc, p.seq_len, cfg.head_dim, p.layout.attention_impl)[1]})"


def explain_cluster(p) -> str:
    """Section 4 for a GPU cluster (cost.cluster): the layout, each term of the step with its numbers, the
    largest operators and collectives of the slowest pipeline rank."""
    st, lay, out = p.cluster, p.layout, []
    add = out.append
    b = st.breakdown
    m, v, pp = lay.micro_batches, lay.vpp, lay.pp
    add(f"4. Time per step on {p.gpus} x {p.hardware.name} (cluster model, trainwise.cost.cluster; "
        f"{p.hardware.kernel_source})")
    add(f"   layout: dp={lay.dp} tp={lay.tp} pp={pp} vpp={v} cp={lay.cp} ep={lay.ep}, sequence parallel "
        f"{'on' if lay.sequence_parallel else 'off'}, ZeRO-{lay.zero}, {m} micro-batch(es) of {p.micro_batch} per "
        f"pipeline per step, {lay.attention_impl} attention{_attention_rule(p)}, element-wise work "
        f"{'fused' if st.fused else 'eager'}"
        + (f", HSDP: sharded over {lay.shard // lay.cp} x cp data-parallel ranks, {lay.replicas} replicas"
           if lay.replicas > 1 else "") + "; ranks ordered tp-cp-ep-dp-pp (tp inside a node)")
    add("   each pipeline rank's micro-batch (forward + backward, its layers; exposed in-step communication): "
        + ", ".join(f"{s:.4g} s" for s in st.stage_seconds[:8]) + (" ..." if len(st.stage_seconds) > 8 else ""))
    add(f"   compute    = m x operators of the slowest rank{' but the expert GEMMs' if b['experts_s'] else ''} = "
        f"{m} x {b['compute_s'] / m:.4g} = {b['compute_s']:.4g} s")
    pad = " " * 16
    lengthened = " and ".join(cluster.TENSOR_CORE)
    add(f"{pad}each operator at its published rate (cost.gpu), {lengthened} x {cluster.IN_STEP}: the in-step")
    add(f"{pad}factor fitted across the development sets (SM clocks under the power cap, SMs shared with the")
    add(f"{pad}collectives, launch gaps); memory-bound kernels at the copy bandwidth")
    if b["experts_s"]:
        model = p.model
        per_expert = p.micro_batch * p.seq_len // lay.cp * model.top_k * lay.ep // model.n_experts
        add(f"   experts    = m x grouped GEMMs of the rank's {model.n_experts // lay.ep} experts (B x T x top_k x ep "
            f"/ E = {per_expert:,} tokens each, at the efficiency of that shape) = {b['experts_s']:.4g} s")
    add(f"   recompute  = m x its {p.checkpointing} checkpointing's re-run forward = {b['recompute_s']:.4g} s")
    hidden = {"async": ", the forward's under its work (--tp-overlap async)",
              "te": ", under the GEMMs (--tp-overlap te)"}.get(p.run.layout.tp_overlap, "")
    add(f"   tp comm    = m x (2 collectives of B x T x H per layer and pass, exposed{hidden}) = "
        f"{b['tp_comm_s']:.4g} s")
    add(f"   cp comm    = m x (KV ring sends past the attention kernels) = {b['cp_comm_s']:.4g} s")
    moves, gathered = "all-to-all dispatch + combine", lay.ep_dispatch == "allgather"
    if lay.ep > 1 and b["experts_s"] and gathered:
        moves = "all-gather of every token over tp x ep + fp32 reduce-scatter of the outputs (--ep-dispatch allgather)"
    elif lay.ep > 1 and b["experts_s"]:
        node = p.hardware.node
        n = cluster.dispatch_copies(p.model, placement(lay, "ep", node.gpus).nodes if node else 1)
        moves += (f", B x T x H x {n:g} copies a token" + ("" if n == p.model.top_k else
                                                          ": one per node reached, node-limited routing"))
    add(f"   ep comm    = m x ({moves} per MoE layer and pass"
        + (", past the other micro-batch's work: --ep-overlap" if lay.ep_overlap and lay.ep > 1 else "")
        + f") = {b['ep_comm_s']:.4g} s")
    if lay.ep > 1 and b["experts_s"]:
        routed = routed_imbalance(p.model, p.run.moe_imbalance)
        add(f"   imbalance  = m x ({routed:g} - 1) x (experts{'' if gathered else ' + ep comm'}): the most loaded "
            f"rank's extra "
            f"(--moe-imbalance, default {MOE_IMBALANCE:g}: trained routing, the experts' loads balanced; 1: "
            f"force-balanced" + ("" if p.model.dropless else f"; held to the model's capacity factor "
                                 f"{p.model.capacity_factor:g}") + f") = {b['imbalance_s']:.4g} s")
    add(f"   pp p2p     = m x 2 sends of B x T x H / tp per run of stages a rank holds in a row (vpp of them; 2 "
        f"in a V)" + (", the warm-up's and cool-down's only (--pp-overlap)" if lay.pp_overlap
                      and lay.pp_schedule == "interleaved" else "") + f" = {b['pp_p2p_s']:.4g} s")
    if lay.pp_schedule in ZERO_BUBBLE and pp > 1:
        add(f"   bubble     = the {lay.pp_schedule} schedule's orders run against each other (each rank's forwards, "
            f"input- and weight-gradient halves as torch orders them, each half a backward) - m x the slowest "
            f"rank's micro-batch {max(st.stage_seconds):.4g} = {b['bubble_s']:.4g} s")
    else:
        add(f"   bubble     = (p - 1) / (v m) x m x mean rank micro-batch = ({pp} - 1) / ({v} x {m}) x {m} x "
            f"{sum(st.stage_seconds) / pp:.4g} = {b['bubble_s']:.4g} s")
    copies = sum(o["seconds"] for o in st.ops if o["op"].startswith("FSDP2 "))
    add("   dp comm    = gradient reduction over dp x cp"
        + (" (HSDP: ZeRO-3's per block in the shard group, then all-reduced over the replicas)" if lay.replicas > 1
           else "") + ", exposed "
        f"{'past the last backward' if lay.dp_overlap else 'in full'}"
        + (" (ZeRO-2 under torch's pipeline schedules: each stage's reduce-scatter after its last backward, in "
           "full)" if lay.reduces_after_pipeline else "")
        + (f", with FSDP2's copies out of each gather and into each reduce-scatter on the compute stream "
           f"({copies:.4g} s)" if copies else "")
        + (f", the gradients reduce-scattered {'each micro-batch' if lay.reduces_each_micro_batch else 'once'} "
           f"(--fsdp-grad-sync {lay.fsdp_grad_sync})" if lay.zero == 3 and m > 1 and pp == 1 else "")
        + (", each block's backward waiting for its own gather (--fsdp-prefetch post)"
           if lay.zero == 3 and lay.fsdp_prefetch == "post" else "")
        + f" = {b['dp_comm_s']:.4g} s")
    add(f"   optimizer  = the rank's fused update at the copy bandwidth = {b['optimizer_s']:.4g} s")
    add(f"   overhead   = {b['overhead_s']:.4g} s per step (host)")
    add(f"   step = {' + '.join(f'{b[k]:.4g}' for k in b)} = {st.seconds:.4g} s")
    add(f"   {'operator / collective (slowest rank, per step)':<56} {'calls':>8} {'seconds':>10}")
    for o in st.ops[:20]:
        add(f"   {o['op'].removeprefix('aten.')[:56]:<56} {o['calls']:>8,} {o['seconds']:>10.4g}")
    _throughput(add, p, st.seconds)
    return "\n".join(out)


def explain_plan(p) -> str:
    """The derivation of a plan (trainwise.planner.plan.Plan), section by section."""
    c, r, out = p.counts, p.recipe, []
    add = out.append
    add(f"Plan for {p.name}: {_tokens(p)}, seq_len T={p.seq_len}, micro-batch B={p.micro_batch}, "
        f"grad-accum K={p.grad_accum}, {p.gpus} device(s) (tp={p.tp}, pp={p.pp}, dp={p.dp})")
    add("")
    add("1. Parameters")
    if p.model is not None:
        m = p.model
        add(f"   embedding = V*H{' + max_seq_len*H' if m.position == 'learned' else ''} = {c.embedding:,}")
        add(f"   total = embedding + L blocks + final norm + LM head{' (tied: 0)' if m.tie_embeddings else ''}"
            f" = {c.total:,}")
        if c.active != c.total:
            add(f"   active (top_k={m.top_k} of n_experts={m.n_experts} routed experts) = {c.active:,}")
    else:
        add(f"   N = {c.total:,} (given with --params)")
    add("")
    add("2. FLOPs (matmul (M,K)x(K,N) = 2MNK; backward = 2 x forward)")
    N, D = c.active, p.tokens
    if p.forward is not None:
        f = p.forward
        add(f"   forward per token: attention projections {f.attention_proj:.4g} + attention core "
            f"4*T*nh*hd*L = {f.attention_core:.4g}{' (halved, causal)' if p.causal_halving else ''}")
        add(f"                      + MLP {f.mlp:.4g} + router/experts {f.router_and_experts:.4g} "
            f"+ LM head 2HV = {f.lm_head:.4g} + embedding 0 = {f.total:.4g}")
        add(f"   train per token = 3 x forward = 3 x {f.total:.4g} = {p.model_flops_per_token:.4g}")
        if p.flops_per_token != p.model_flops_per_token:
            what = p.checkpointing if p.checkpointing != "none" else "chunked loss, LM head 2HV"
            add(f"   + recompute ({what}) = {p.flops_per_token - p.model_flops_per_token:.4g}"
                f" -> {p.flops_per_token:.4g}")
        add(f"   (6N rule for comparison: 6 x {N:,} = {6 * N:.4g})")
    else:
        add(f"   per token = 6N = 6 x {N:,} = {p.model_flops_per_token:.4g}"
            + (" (+2N recompute, full checkpointing)" if p.checkpointing == "full" else ""))
    add(f"   total C = per token x D = {p.flops_per_token:.4g} x {D:.4g} = {p.total_flops:.4g} FLOPs" if D else
        f"   total C = per token x D: {NO_TOKENS}")
    add("")
    s = p.states
    mp = p.tp * p.pp
    add(f"3. Memory per device ({r.name}: {r.description}; optimizer {p.optimizer}; ZeRO-{p.zero} over dp={p.dp}"
        f"{'' if mp == 1 else f'; model split over tp*pp={mp}'})")
    fp8 = " - the FP8 linear weights x 1 B (FP8 parameters: --fp8-params)" if r.fp8_params else ""
    add(f"   params     = N x {r.param_bytes} B{fp8}{' / dp' if p.zero >= 3 else ''} = {fmt_bytes(s.params)}")
    add(f"   grads      = N x {r.grad_bytes} B{' / dp' if p.zero >= 2 else ''} = {fmt_bytes(s.grads)}")
    add(f"   optimizer  = N x {optimizer_moments(p.optimizer)} x {r.moment_bytes} B{' / dp' if p.zero >= 1 else ''}"
        f" = {fmt_bytes(s.optimizer)}")
    add(f"   master     = N x {r.master_bytes} B{' / dp' if p.zero >= 1 else ''} = {fmt_bytes(s.master)}")
    add(f"   states     = {fmt_bytes(s.total)}")
    hot = routed_imbalance(p.model, p.run.moe_imbalance) if p.model and p.model.n_experts and p.layout.ep > 1 else 1
    add(f"   activations ({p.checkpointing} checkpointing, B x T = {p.micro_batch * p.seq_len:,} tokens, "
        f"incl. {L.LOSS_KERNELS.get(p.loss_kernel, 'the loss')}"
        + (f"; the most loaded expert-parallel rank's experts keep {hot:g} x the mean's routed copies "
           f"(--moe-imbalance)" if hot != 1 and p.checkpointing not in ("full", "op") else "")
        + f") = {fmt_bytes(p.activations_bytes)}")
    if p.held_grad_sums:
        add(f"   held sums  = N x 4 B{f' / (tp*pp)' if mp > 1 else ''}, the micro-batches' unsharded fp32 gradients "
            f"summed until the last one's reduce-scatter (--fsdp-grad-sync step) = {fmt_bytes(p.held_grad_sums)}")
    add(f"   per device = {fmt_bytes(p.per_device_bytes)}; budget {fmt_bytes(p.budget)} -> fits: {fits_text(p)}")
    add("")
    if p.hardware is None:
        add("4. Time")
        add(f"   {NO_HARDWARE}")
        out += [f"note: {n}" for n in p.notes]
        return "\n".join(out)
    if p.cluster is not None:
        add(explain_cluster(p))
    elif p.step is not None:
        add(explain_step(p))
    elif p.time is None:
        add("4. Time per step = step FLOPs / (G x peak x MFU)   (assumed MFU: a what-if, not a prediction)")
        add(f"   = {p.flops_per_token:.4g} x {p.tokens_per_step:,} / ({p.gpus} x {p.hardware.peak_flops:.4g} x {p.mfu})"
            f" = {p.step_seconds:.4g} s; {NO_TOKENS}")
    else:
        add("4. Time = C / (G x peak x MFU)   (assumed MFU: a what-if, not a prediction)")
        add(f"   = {p.total_flops:.4g} / ({p.gpus} x {p.hardware.peak_flops:.4g} x {p.mfu}) = {p.time.seconds:.4g} s"
            f" = {p.time.days:.2f} days = {p.time.device_hours:,.1f} device-hours")
    if p.price is not None and p.time is not None:
        add(f"   cost = {p.time.device_hours:,.1f} device-hours x ${p.price}/h = ${p.cost:,.0f}")
    for n in p.notes:
        add(f"note: {n}")
    return "\n".join(out)


def plan_table(plan) -> str:
    """The plan as a two-column table, as `trainwise plan` prints it."""
    j, rows = plan.to_json(), []
    mdl, fl, mem, t = j["model"], j["flops"], j["memory"], j["time"]
    rows += [("model", mdl["name"]), ("params total", f"{mdl['params_total']:,}"),
             ("params active", f"{mdl['params_active']:,}"), ("params embedding", f"{mdl['params_embedding']:,}"),
             ("params non-embedding", f"{mdl['params_non_embedding']:,}"), ("tokens", _tokens(plan)),
             ("FLOPs / token (train)", f"{fl['per_token_train']:.4g} FLOPs ({fl['convention']})"),
             ("FLOPs / step", f"{fl['per_token_train'] * plan.tokens_per_step:.4g} FLOPs (all devices, "
                              f"{plan.tokens_per_step:,} tokens)")]
    if fl["total"] is not None:
        rows.append(("FLOPs total", f"{fl['total']:.4g} FLOPs"))
    for key in ("params", "grads", "optimizer", "master", "states", "activations"):
        rows.append((f"{key} / device", fmt_bytes(mem[f"{key}_bytes"])))
    if mem["held_grad_sums_bytes"]:  # beside the states through the accumulation (--fsdp-grad-sync step)
        rows.append(("held grad sums / device", fmt_bytes(mem["held_grad_sums_bytes"])))
    rows.append(("total / device", fmt_bytes(mem["per_device_bytes"])))
    if plan.peak_rank is not None:  # the step's high point on the highest rank, as verify checks a run
        rank, _ = plan.peak_rank
        rows.append(("step peak / device", f"{fmt_bytes(mem['peak_bytes'])} (rank {rank}, the highest)"))
        if mem["reserved_bytes"] > mem["peak_bytes"]:  # FSDP's gradient shards on their stream's own blocks
            rows.append(("reserved / device", f"at least {fmt_bytes(mem['reserved_bytes'])} (the caching allocator: "
                                              "the gradient shards on the reduce-scatter stream's blocks)"))
    rows += [("budget / device", fmt_bytes(mem["budget_bytes"])), ("fits", fits_text(plan))]
    if plan.hardware is None:
        rows.append(("time", t["note"]))
    else:
        hw = plan.hardware
        rows += [("hardware", f"{plan.gpus} x {hw.name} @ {hw.peak_flops:.4g} FLOP/s"),
                 ("step time", f"{t['step_seconds']:.4g} s per step of {plan.tokens_per_step:,} tokens, "
                               f"{t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%}"
                               + (f" of the FP8 peak, {t['mfu_bf16_peak']:.1%} of the bf16 peak"
                                  if "mfu_bf16_peak" in t else "") + f" ({time_source(t['source'])})"),
                 ("time", f"{t['seconds']:.4g} s = {t['days']:.2f} days = {t['device_hours']:,.1f} device-hours"
                          if t["seconds"] is not None else t["note"])]
        if hw.calibration:
            rows += calibration_rows(j["hardware"])
    if t.get("cost_usd") is not None:
        rows.append(("cost", f"${t['cost_usd']:,.0f}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows + [("note", n) for n in plan.notes])


def fits_text(plan) -> str:
    """Whether the plan fits its budget, and by how much it does not."""
    if plan.fits is None:
        return "unknown" + ("" if plan.budget else " (no budget: give --gpu NAME or --memory-budget)")
    if plan.fits:
        over = plan.peak_over_budget_bytes
        return "yes" if over is None else (
            f"yes by states + activations, but the step peak (the highest rank's, with the step's transient "
            f"buffers) {does_not_fit(over)}")
    peak = plan.peak_over_budget_bytes
    return f"NO: {does_not_fit(plan.over_budget_bytes)} per device" + (
        f" by states + activations; the step peak (the highest rank's, with the step's transient buffers) "
        f"{does_not_fit(peak)}" if peak is not None and peak > plan.over_budget_bytes else "")


def does_not_fit(over_bytes: int) -> str:
    """How far over its budget a plan is, as every 'does not fit' line says it."""
    return f"does not fit by {over_bytes / 2**30:.2f} GiB ({over_bytes / 1e9:.2f} GB)"


def _tokens(plan) -> str:
    return "not given (--tokens D): per step only" if plan.tokens is None else f"{plan.tokens:.4g} tokens"


def time_source(source: str) -> str:
    """How a plan's time was obtained, as a person reads it (plan.json keeps the word: docs/ARCHITECTURE.md,
    "The plan's JSON")."""
    return {"calibrated": "step-time model, calibrated on this machine",
            "published microbenchmarks": "cluster model: operators and collectives at published kernel and NCCL "
                                         "rates"}.get(source, "assumed MFU: a what-if, not a prediction")


def calibration_rows(hardware: dict) -> list[tuple[str, str]]:
    """When this machine's calibration was taken, what may be wrong with it, and the last speed probe."""
    rows = [("calibrated", hardware["calibrated_at"] + (f"; {hardware['calibration_note']}"
                                                        if hardware["calibration_note"] else ""))]
    probe = hardware.get("last_probe")
    rows.append(("last speed probe", "none yet (each training run probes at its start)" if not probe else
                 f"{probe['at']}: the calibration's reference steps ran {probe['ratio'] - 1:+.1%} against the "
                 f"calibration (eager overhead {probe['overhead_ratio'] - 1:+.1%}, "
                 f"kernels {probe['kernel_ratio'] - 1:+.1%})"))
    return rows


def _throughput(add, p, step_s: float) -> None:
    """The lines every time model ends with: tokens/s and MFU of one step, and the run's time."""
    tps = p.tokens_per_step / step_s
    add(f"   tokens/s = {p.tokens_per_step:,} tokens per step / {step_s:.4g} s = {tps:,.0f}; "
        f"MFU = {p.model_flops_per_token:.4g} x {tps:,.0f} / ({p.gpus} x {p.hardware.peak_flops:.4g}) = {p.mfu:.2%}")
    if p.time is None:
        add(f"   time: {NO_TOKENS}")
        return
    add(f"   time = D / tokens/s = {p.tokens:.4g} / {tps:,.0f} = {p.time.seconds:.4g} s = {p.time.days:.2f} days "
        f"= {p.time.device_hours:,.1f} device-hours")
