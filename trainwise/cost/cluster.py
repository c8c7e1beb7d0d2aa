"""One optimizer step on a GPU cluster, per operator and per collective, for any layout (cost.layout):

    per pipeline rank and micro-batch   its layers' operators (one rank's share: the planner records
        them on a narrowed model, trainwise.planner.cluster_step) priced by cost.gpu (element-wise work at the
        bytes a fusing stack moves where the stack fuses), the tensor-core kernels x IN_STEP, + the embedding
        on the first rank and the LM head + loss on the last; + the collectives inside the step:
          tensor parallel   per layer 2 all-reduces forward, 2 backward (2 more when a full recompute
                            re-runs the forward) of B x T x H (Narayanan et al. 2021 section 3.3); with
                            sequence parallelism each is a reduce-scatter + an all-gather of the same
                            volume (Korthikanti et al. 2022 section 4.2.2), and backward all-gathers each
                            TP region's input again for its weight gradient (2 per layer; Megatron-LM
                            overlaps it with the input-gradient GEMM, yet Korthikanti et al.'s Table 4
                            has the backward no faster with sequence parallelism, 11.8 vs 11.9 ms, for
                            all its sharded element-wise work: counted exposed); all exposed (Megatron-LM
                            runs them between the GEMMs) unless tp_overlap: "te" hides every pass's under
                            the GEMMs, "async" (torchtitan's AsyncTP) the forward's (cost.layout.TP_OVERLAPS)
          context parallel  per layer the KV chunks around the ring, cp - 1 sends forward and twice that
                            backward, under the attention kernels (exposed only past them); or (cp_impl)
                            all-gathered before each pass and their gradients reduce-scattered, or Ulysses'
                            all-to-alls of q, k, v and the output, exposed
          expert parallel   per MoE layer an all-to-all to dispatch and one to combine, forward and backward,
                            of top_k copies of each token (node-limited routing across nodes: one per node
                            reached, dispatch_copies); or (ep_dispatch) every token all-gathered over the tp x ep
                            ranks and the outputs reduce-scattered in fp32, each pass, on the ep group's links
          pipeline          an activation forward and a gradient backward per micro-batch and run of stages
                            the rank holds in a row, B x T x H / tp (scatter-gather / sequence parallel), exposed
                            (pp_overlap: the interleaved schedule's warm-up's and cool-down's only,
                            cost.schedule.p2p_exposed_share)
    pipeline            m x (the slowest rank's micro-batch) + the bubble: (p - 1) / v x (the mean rank's) for
                        1F1B, GPipe and interleaved 1F1B (Narayanan et al. 2021 sections 2.2.1-2.2.2); for the
                        zero-bubble schedules the ranks' own orders run against each other
                        (cost.schedule.schedule_seconds, which gives the formula back for the other three)
    once per step       the tied embedding's gradient between the first and last stage, the gradient norm's
                        and the loss's scalars, all-reduced and exposed (_step_reductions)
    data parallel       the rank's gradients all-reduced (ZeRO 1-2: reduce-scattered, parameters
                        all-gathered), under the last micro-batch's backward when dp_overlap (DDP buckets);
                        ZeRO-3 as FSDP2 runs it, block by block under the neighbouring blocks' compute, with
                        its copies out of each gather and into each reduce-scatter on the compute stream (_fsdp)
    optimizer           the fused update of the rank's parameters (/dp under ZeRO), at the copy bandwidth
    overhead            per step, the host's (hardware.profile.DEFAULT_OVERHEAD)

Every collective is priced by cost.comm.collective_seconds over the tier its group crosses (cost.layout
.placement: Megatron-LM's rank order, TP inside a node).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from trainwise.config import ModelConfig
from trainwise.cost import comm as C
from trainwise.cost.gpu import copy_bandwidth, op_seconds
from trainwise.cost.layout import ZERO_BUBBLE, Layout, ParamCounts, placement
from trainwise.cost.ops import Op, for_cuda
from trainwise.cost.run import routed_imbalance
from trainwise.cost.schedule import (bubble_fraction, chunk_layers, p2p_exposed_share, rank_stages, schedule_seconds,
                                     v_shape)
from trainwise.hardware.profile import DEFAULT_OVERHEAD
from trainwise.hardware.table import Accelerator, Node

# A tensor-core kernel (matmul, attention) inside a training step takes IN_STEP x its published time alone
# (cost.gpu): SM clocks held down by the power cap over seconds of back-to-back work, SMs and caches shared with
# the communication kernels running beside it, the gaps between launches. A memory-bound kernel (element-wise
# work, casts, FSDP2's copies) runs at the copy bandwidth cost.gpu prices it at: what the power cap lowers is the
# SM clock, not HBM's (as Accelerator.clock_share scales the tensor-core rates alone). One value for every GPU,
# fitted across the whole development set (both sets, every dense row: `python benchmarks/cluster_model.py
# --in-step X` rescans it; benchmarks/RESULTS.md), neither per row nor per GPU.
IN_STEP = 1.27
TENSOR_CORE = ("matmul", "attention")  # the operator classes (cost.ops.CLASSES) IN_STEP lengthens

BREAKDOWN = ("compute_s", "experts_s", "recompute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "imbalance_s", "pp_p2p_s",
             "dp_comm_s", "bubble_s", "optimizer_s", "overhead_s")


@dataclass(frozen=True)
class RankWork:
    """One rank's operators per micro-batch (cost.ops records, its share under the layout) by part: one
    dense layer, one MoE layer (MoE models), the ends (embedding, final norm, LM head, loss); each with
    the optimizer update of its parameters as one "optimizer" op. `plain`: the same without activation
    checkpointing (what the recompute costs is the difference); None when there is none."""

    layer: list[Op]
    ends: list[Op]
    moe_layer: list[Op] | None = None
    plain: RankWork | None = None
    fused: bool = False  # the stack fuses element-wise work (cost.ops.Op.fused, planner.cluster_step.fuses)


@dataclass
class ClusterStep:
    seconds: float
    breakdown: dict[str, float]
    ops: list[dict]  # {"op", "calls", "seconds"} per operator and per collective, the slowest rank, per step
    comm: dict[str, dict]  # per rank per step: {kind: {"calls", "bytes"}} (bytes the rank sends)
    stage_seconds: list[float] = field(default_factory=list)  # each pipeline rank's micro-batch
    fused: bool = False  # element-wise work priced fused (RankWork.fused)


def cluster_step(cfg: ModelConfig, layout: Layout, work: RankWork, counts: ParamCounts, *, acc: Accelerator,
                 node: Node | None, micro_batch: int, seq_len: int, checkpointing: str, act_bytes: int,
                 grad_bytes: int, param_bytes: int, tp_overlap: str | None = None,
                 moe_imbalance: float = 1.0) -> ClusterStep:
    """The step (module docstring). act_bytes: bytes per element of the activations sent (2 in bf16/fp16);
    grad_bytes / param_bytes: per parameter, of what the data-parallel collectives move; moe_imbalance: the
    most loaded expert-parallel rank's tokens over the mean (cost.run.Run.moe_imbalance)."""
    tiers = ({d: _tier(layout, d, node) for d in ("tp", "cp", "ep", "dp", "pp", "dp_shard", "dp_replicate")}
             if node else {})  # one GPU: no links
    m, v, p = layout.micro_batches, layout.vpp, layout.pp
    layers = chunk_layers(cfg.n_layers, p * v)
    stage_idx = [[i for c in sorted(rank_stages(layout, r)) for i in range(sum(layers[:c]), sum(layers[:c + 1]))]
                 for r in range(p)]
    slowest = max(range(p), key=lambda r: _stage_key(cfg, layout, stage_idx[r], r))
    copies = dispatch_copies(cfg, placement(layout, "ep", node.gpus).nodes if node else 1)
    log = _Log()
    stages, parts, seen = [], [], {}
    for r in range(p):  # ranks alike (the same layers, neither end) are priced once
        n_moe = sum(cfg.is_moe_layer(i) for i in stage_idx[r])
        key = (len(stage_idx[r]) - n_moe, n_moe, *_ends(layout, r), r == slowest)
        if key not in seen:
            seen[key] = _micro_batch(cfg, layout, work, stage_idx[r], r, tiers, acc, micro_batch, seq_len,
                                     checkpointing, act_bytes, tp_overlap, routed_imbalance(cfg, moe_imbalance),
                                     copies, log if r == slowest else None)
        part = dict(seen[key])
        stages.append(part.pop("total"))
        parts.append(part)
    worst = parts[slowest]
    breakdown = dict.fromkeys(BREAKDOWN, 0.0)
    for key in ("compute_s", "experts_s", "recompute_s", "tp_comm_s", "ep_comm_s", "imbalance_s", "cp_comm_s",
                "pp_p2p_s"):
        breakdown[key] = m * worst[key]
    if layout.pp_schedule in ZERO_BUBBLE and p > 1:  # the schedule's own order, simulated
        share = [part["forward"] / max(part["forward"] + part["backward"], 1e-30) for part in parts]
        span = schedule_seconds(layout, [t * f for t, f in zip(stages, share)],
                                [t * (1 - f) for t, f in zip(stages, share)])
        breakdown["bubble_s"] = max(0.0, span - m * stages[slowest])  # never below the slowest rank's own work
    else:
        breakdown["bubble_s"] = bubble_fraction(p, v, m) * m * sum(stages) / p
    log.repeat(m)  # the micro-batch's operators and collectives, m times; what follows is once per step
    if layout.zero == 3 and layout.dp * layout.cp > 1:
        breakdown["dp_comm_s"] = _fsdp(cfg, layout, counts, stage_idx[slowest], slowest, worst, tiers, grad_bytes,
                                       param_bytes, acc, log)
    else:
        breakdown["dp_comm_s"] = _data_parallel(cfg, layout, counts, stage_idx[slowest], slowest, worst["backward"],
                                                tiers, grad_bytes, param_bytes, log)
    breakdown["dp_comm_s"] += _step_reductions(cfg, layout, tiers, grad_bytes, log)
    breakdown["optimizer_s"] = _optimizer(cfg, layout, work, stage_idx[slowest], slowest, acc, log)
    breakdown["overhead_s"] = DEFAULT_OVERHEAD[0]
    return ClusterStep(sum(breakdown.values()), breakdown, log.ops(), log.comm(), stages, work.fused)


class _Log:
    """Calls and seconds per operator and collective of the slowest rank, and its bytes sent per kind."""

    def __init__(self):
        self.t = defaultdict(lambda: [0, 0.0])
        self.sent = defaultdict(lambda: [0, 0.0])

    def op(self, name: str, calls: int, seconds: float) -> None:
        self.t[name][0] += calls
        self.t[name][1] += seconds

    def coll(self, kind: str, part: str, calls: int, seconds: float, sent: float) -> None:
        self.op(f"nccl {kind} ({part})", calls, seconds)
        self.sent[kind][0] += calls
        self.sent[kind][1] += sent

    def repeat(self, m: int) -> None:
        for rec in (*self.t.values(), *self.sent.values()):
            rec[0] *= m
            rec[1] *= m

    def ops(self) -> list[dict]:
        return sorted(({"op": k, "calls": int(c), "seconds": s} for k, (c, s) in self.t.items()),
                      key=lambda o: -o["seconds"])

    def comm(self) -> dict[str, dict]:
        return {k: {"calls": int(c), "bytes": int(b)} for k, (c, b) in self.sent.items()}


def _micro_batch(cfg, layout: Layout, work: RankWork, idx: list[int], r: int, tiers, acc, micro_batch, seq_len,
                 checkpointing, act_bytes, tp_overlap, imbalance: float, copies: float,
                 log: _Log | None) -> dict[str, float]:
    """One micro-batch (forward + backward) of pipeline rank r: its operators and in-step collectives. Under
    expert parallelism with imbalanced routing the rank waits for the most loaded one: its grouped expert
    GEMMs and its dispatch take `imbalance` x the mean's. The dispatch sends `copies` of each token
    (dispatch_copies)."""
    first, last = _ends(layout, r)
    t = _rank_compute(cfg, work, idx, first, last, acc, log)
    plain = _rank_compute(cfg, work.plain, idx, first, last, acc, None) if work.plain else t
    tokens = micro_batch * seq_len // layout.cp
    act = tokens * cfg.d_model * act_bytes
    passes = 3 if checkpointing == "full" else 2  # of each collective: forward, backward (+ recomputed forward)
    n_moe = sum(cfg.is_moe_layer(i) for i in idx)

    def coll(part: str, kind: str, nbytes: float, n: int, count: int) -> float:
        seconds = count * C.collective_seconds(kind, nbytes, n, tiers[part])
        if log is not None and count:
            log.coll(kind, part, count, seconds, count * C.bytes_sent(kind, nbytes, n))
        return seconds

    tp = ep = cp = pp = 0.0
    if layout.tp > 1:  # 2 per layer and pass; + the embedding's (first rank) and the LM head's (last)
        count = 2 * passes * len(idx) + first + last
        # op-level checkpointing keeps the reduce-scatters' outputs and runs the rest of the block again: the
        # two all-gathers of its inputs (sequence parallel), or the output projection's all-reduce
        redo = (2 if layout.sequence_parallel else 1) * len(idx) if checkpointing == "op" else 0
        if layout.sequence_parallel:  # + backward's all-gather of each TP region's input for its weight gradient
            tp = (coll("tp", "reduce_scatter", act, layout.tp, count)
                  + coll("tp", "all_gather", act, layout.tp, count + 2 * len(idx) + redo))
        else:
            tp = coll("tp", "all_reduce", act, layout.tp, count + redo)
        if tp_overlap == "async":  # the forward's collectives under the forward's work, the backward's exposed:
            n = 2 * len(idx)  # 2 per layer, + the embedding's output (first rank), + the LM head's input (last)
            forward = ((("reduce_scatter", n + first), ("all_gather", n + last)) if layout.sequence_parallel
                       else (("all_reduce", n + first),))
            tp -= min(t["forward"], sum(k * C.collective_seconds(kind, act, layout.tp, tiers["tp"])
                                        for kind, k in forward))
        elif tp_overlap == "te":
            tp = max(0.0, tp - t["matmul"])
    if layout.ep > 1 and n_moe and layout.ep_dispatch == "allgather":  # gathered over tp x ep, combined in fp32
        n = layout.expert_tp * layout.ep  # each pass one collective of the pass's dtype and one of fp32 per layer
        gathered = act * layout.ep * (1 if layout.sequence_parallel else layout.expert_tp)
        wide = gathered * 4 / act_bytes  # the combine's reduce-scatter in the routing weights' fp32
        ep = (coll("ep", "all_gather", gathered, n, (passes - 1) * n_moe) + coll("ep", "all_gather", wide, n, n_moe)
              + coll("ep", "reduce_scatter", wide, n, (passes - 1) * n_moe)
              + coll("ep", "reduce_scatter", gathered, n, n_moe))
    elif layout.ep > 1 and n_moe:  # dispatch and combine per MoE layer and pass
        routed = act * copies / (layout.tp if layout.sequence_parallel else 1)
        ep = coll("ep", "all_to_all", routed, layout.ep, 2 * passes * n_moe)
        if layout.ep_overlap:  # under the other micro-batch's work, as long as there is work to hide under
            ep = max(0.0, ep - t["all"])
    if layout.cp > 1:  # each layer's keys and values (MLA: the latent) on T / cp positions, `kv` bytes a rank
        width = (cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.attention == "mla"
                 else 2 * max(1, cfg.n_kv_heads // layout.tp) * cfg.head_dim)
        kv, n = tokens * width * act_bytes, len(idx)
        if layout.cp_impl == "ring":  # around the ring: cp - 1 sends forward, 2(cp - 1) backward, under attention
            sent = coll("cp", "send_recv", kv, 2, 3 * (layout.cp - 1) * n)
            cp = max(0.0, sent - t["attention"])
        elif layout.cp_impl == "allgather":  # gathered before each forward and backward, dK dV reduce-scattered
            cp = (coll("cp", "all_gather", kv * layout.cp, layout.cp, (passes - 1) * n + n)
                  + coll("cp", "reduce_scatter", kv * layout.cp, layout.cp, n))
        else:  # Ulysses: q, k, v and the output trade positions for heads, each pass, exposed
            queries = tokens * cfg.n_heads // layout.tp * cfg.head_dim * act_bytes
            cp = coll("cp", "all_to_all", 2 * queries + kv, layout.cp, passes * n)
    if layout.pp > 1:  # an activation forward and a gradient backward, B x T x H / tp, per run of stages the
        own = rank_stages(layout, r)  # rank holds in a row (a V's middle two pass theirs without a send)
        runs = sum(st - 1 not in own for st in own)
        pp = coll("pp", "send_recv", act / layout.tp, 2, 2 * runs) * p2p_exposed_share(layout, r)
    # the most loaded rank computes more and, exchanging all-to-all, receives more; gathered, every rank the same
    waits = t["experts"] + (ep if layout.ep_dispatch == "alltoall" else 0.0)
    skew = (imbalance - 1) * waits if layout.ep > 1 and n_moe else 0.0
    if log is not None and skew:
        log.op("expert imbalance (the most loaded rank's extra)", 0, skew)
    return {"total": t["all"] + tp + ep + skew + cp + pp, "compute_s": plain["all"] - plain["experts"],
            "experts_s": plain["experts"], "recompute_s": t["all"] - plain["all"], "tp_comm_s": tp,
            "ep_comm_s": ep, "imbalance_s": skew, "cp_comm_s": cp, "pp_p2p_s": pp, "backward": t["backward"],
            "forward": t["forward"]}


def dispatch_copies(cfg: ModelConfig, ep_nodes: int) -> float:
    """Copies of each token the expert-parallel dispatch (and the combine) moves over the links the ep group
    crosses: one per routed expert (top_k); or, where the model routes node-limited (DeepSeek-V3's group-limited
    routing, router_groups groups of experts, a token choosing among router_group_top_k of them, the groups laid
    over the nodes the ep group spans) and that group spans nodes, one per node the token reaches, forwarded to
    its experts inside the node over NVLink (the report's dispatch kernels, DeepEP's): at most
    router_group_top_k nodes, their groups' nodes where a group spans several, and never more than top_k."""
    if cfg.router_groups <= 1 or ep_nodes <= 1:
        return cfg.top_k
    reach = cfg.router_group_top_k * max(1, ep_nodes // cfg.router_groups)  # the nodes a token's groups cover
    return min(cfg.top_k, reach, ep_nodes)


def _tier(layout: Layout, dim: str, node: Node) -> C.Tier:
    g = placement(layout, dim, node.gpus)
    return C.group_tier(g.per_node, g.nodes, node, bridged_pair=g.size == 2 and g.stride == 1)


def _ends(layout: Layout, r: int) -> tuple[bool, bool]:
    """Whether pipeline rank r holds the first stage (the embedding) and the last (final norm, LM head, loss):
    ranks 0 and pp - 1, or rank 0 both under a V schedule (cost.schedule.rank_stages)."""
    own = rank_stages(layout, r)
    return 0 in own, layout.stages - 1 in own


def _stage_key(cfg: ModelConfig, layout: Layout, idx: list[int], r: int) -> tuple:
    """Order of pipeline ranks by work, to find the slowest: MoE layers, layers, then the LM head's rank."""
    first, last = _ends(layout, r)
    return sum(cfg.is_moe_layer(i) for i in idx), len(idx), last, first


def _rank_compute(cfg: ModelConfig, work: RankWork, idx: list[int], first: bool, last: bool, acc: Accelerator,
                  log: _Log | None) -> dict[str, float]:
    """Seconds of one rank's operators per micro-batch (the optimizer is once per step), by phase and class."""
    out = defaultdict(float)
    for ops, count in _parts(cfg, work, idx, first, last):
        for op in for_cuda(ops):
            if op.phase == "optimizer" or not count:
                continue
            seconds = op_seconds(op, acc, work.fused)[0] * (IN_STEP if op.cls in TENSOR_CORE else 1.0)
            out["all"] += count * seconds
            out[op.phase] += count * seconds
            out[op.cls] += count * seconds
            out["experts"] += count * seconds if "grouped_mm" in op.name else 0.0
            if log is not None:
                log.op(op.name, count * op.calls, count * seconds)
    return out


def _parts(cfg: ModelConfig, work: RankWork, idx: list[int], first: bool, last: bool) -> list[tuple[list[Op], int]]:
    """(operators, times) of one rank: its dense and MoE layers, the embedding on the first rank, the final
    norm, LM head and loss on the last."""
    n_moe = sum(cfg.is_moe_layer(i) for i in idx)
    ends = [op for op in work.ends if (first and "embedding" in op.name) or (last and "embedding" not in op.name)
            or (op.phase == "optimizer" and (first or last))]
    return [(work.layer, len(idx) - n_moe), (work.moe_layer or [], n_moe), (ends, 1)]


def _data_parallel(cfg, layout: Layout, rp: ParamCounts, idx, r, backward_s, tiers, grad_bytes, param_bytes,
                   log: _Log) -> float:
    """Exposed seconds of the data-parallel collectives of rank r per step: gradients all-reduced (ZeRO 1-2:
    reduce-scattered + parameters all-gathered once), the experts' over their own data-parallel group
    (Layout.expert_dp: dp x cp / ep with etp = tp). Under the last micro-batch's backward (DDP's and Megatron's
    buckets), or, for FSDP2's ZeRO-2 under torch's pipeline schedules (trainwise's trainer, torchtitan), the
    reductions after a stage's last backward, exposed, and the gathers under the next step's first forward."""
    n_moe = sum(cfg.is_moe_layer(i) for i in idx)
    dense = (len(idx) - n_moe) * rp.layer + n_moe * (rp.moe_layer - rp.moe_experts)
    first, last = _ends(layout, r)
    dense += (rp.embedding if first else 0) + (rp.head if last else 0)
    groups = [(dense, layout.dp * layout.cp), (n_moe * rp.moe_experts, layout.expert_dp)]
    total = reduce = 0.0
    for n_params, ranks in groups:
        if ranks <= 1 or not n_params:
            continue
        if layout.zero == 0:
            kinds = [("all_reduce", grad_bytes, 1)]
        else:
            kinds = [("reduce_scatter", grad_bytes, 1),
                     ("all_gather", param_bytes, 1)]
        for kind, per, calls in kinds:
            seconds = calls * C.collective_seconds(kind, n_params * per, ranks, tiers["dp"])
            total += seconds
            reduce += seconds if kind != "all_gather" else 0.0
            log.coll(kind, "dp", calls, seconds, calls * C.bytes_sent(kind, n_params * per, ranks))
    if not layout.dp_overlap:
        return total
    if layout.reduces_after_pipeline:
        return reduce
    return max(0.0, total - backward_s)


def _fsdp(cfg, layout: Layout, rp: ParamCounts, idx, r, mb: dict, tiers, grad_bytes, param_bytes,
          acc: Accelerator, log: _Log) -> float:
    """Exposed seconds per step of ZeRO-3 as FSDP2 runs it (torchtitan; llm-foundry's FSDP1 and Megatron-FSDP
    without its copies): per micro-batch, each block's parameters all-gathered before its forward and again
    before its backward, its gradients reduce-scattered after its backward, one block prefetched: a block's
    gather hides under the previous block's compute, its reduce-scatter under the next one's backward, and
    what a block's collectives take beyond its compute is exposed; the first gather of each pass and the last
    reduce-scatter are not hidden. With Layout.fsdp_prefetch "post" (FSDP1's BACKWARD_POST) a block's backward
    gather is issued only when the backward after it is done: every backward gather is exposed, and the
    reduce-scatter queued behind it hides under the block's backward. The gradients are reduce-scattered on the
    last micro-batch, or on each (Layout.fsdp_grad_sync); the copy-in stands for the other micro-batches' sum
    into the fp32 gradients.
    The roots (embedding, final norm and head) are gathered once per micro-batch and kept until backward.
    Blocks priced alike (the rank's layers' mean; experts over their own group, Layout.expert_dp). HSDP
    (Layout.dp_shard): the gathers and reduce-scatters over the shard group, and each reduce-scattered shard
    all-reduced over the replicas after it, under the same backward. FSDP2 copies on the compute stream
    (Layout.fsdp_copies): each gather's output into the parameters (split_with_sizes_copy: read and written in
    the gathered dtype) before the block runs, each block's unsharded gradients into the reduce-scatter's input
    (chunk_cat: read in the compute dtype, written in the reduce dtype) after its backward; memory-bound,
    at the copy bandwidth, and they lengthen the compute the collectives hide under."""
    n_moe = sum(cfg.is_moe_layer(i) for i in idx)
    blocks = max(1, len(idx))
    first, last = _ends(layout, r)
    root = (rp.embedding if first else 0) + (rp.head if last else 0)
    dense = (len(idx) - n_moe) * rp.layer + n_moe * (rp.moe_layer - rp.moe_experts)
    ranks, expert_ranks, replicas = layout.shard, layout.expert_dp, layout.replicas
    shard_tier = "dp_shard" if replicas > 1 else "dp"
    m = layout.micro_batches

    def coll(kind: str, n_params: float, per: int, group: int, calls: int, tier: str = shard_tier) -> float:
        if group <= 1 or n_params <= 0:
            return 0.0
        seconds = C.collective_seconds(kind, n_params * per, group, tiers[tier])
        log.coll(kind, "dp", calls, calls * seconds, calls * C.bytes_sent(kind, n_params * per, group))
        return seconds

    experts = n_moe * rp.moe_experts / blocks
    gather = coll("all_gather", dense / blocks, param_bytes, ranks, 2 * blocks * m) + coll(
        "all_gather", experts, param_bytes, expert_ranks, 2 * blocks * m)
    reduces = m if layout.reduces_each_micro_batch else 1  # micro-batches whose gradients are reduce-scattered
    scatter = coll("reduce_scatter", dense / blocks, grad_bytes, ranks, blocks * reduces) + coll(
        "reduce_scatter", experts, grad_bytes, expert_ranks, blocks * reduces) + coll(
        "all_reduce", dense / blocks / ranks, grad_bytes, replicas, blocks * reduces, "dp_replicate")
    root_gather = coll("all_gather", root, param_bytes, ranks, m)
    root_scatter = coll("reduce_scatter", root, grad_bytes, ranks, reduces) + coll(
        "all_reduce", root / ranks, grad_bytes, replicas, reduces, "dp_replicate")
    sharded = dense / blocks * (ranks > 1) + experts * (expert_ranks > 1)  # what each block gathers
    copy_out, copy_in, root_copies = _fsdp_copies(layout, sharded, root * (ranks > 1), param_bytes, grad_bytes,
                                                  acc, log, m, blocks)
    forward, backward = mb["forward"] / blocks + copy_out, mb["backward"] / blocks + copy_out + copy_in
    exposed_forward = root_gather + gather + (blocks - 1) * max(0.0, gather - forward)
    post = layout.fsdp_prefetch == "post"  # each block's gather waits for the backward after it, then its own runs
    block = gather + max(0.0, scatter - backward) if post else max(0.0, gather + scatter - backward)
    reducing = blocks * block + scatter + root_scatter
    exposed_backward = reduces * reducing + (m - reduces) * blocks * (gather if post else max(0.0, gather - backward))
    return m * (exposed_forward + blocks * (2 * copy_out + copy_in) + root_copies) + exposed_backward


def _fsdp_copies(layout: Layout, block: float, root: float, param_bytes: int, grad_bytes: int,
                 acc: Accelerator, log: _Log, m: int, blocks: int) -> tuple[float, float, float]:
    """Seconds per micro-batch of FSDP2's copy-out of a block's gather (its parameters read and written in the
    gathered dtype), of the copy-in of its reduce-scatter (its gradients read in the compute dtype, written in
    the reduce dtype), and of the roots' (gathered once per micro-batch and reduced once), each logged per
    step. Zeros without Layout.fsdp_copies."""
    if not layout.fsdp_copies or not (block or root):
        return 0.0, 0.0, 0.0
    rate = copy_bandwidth(acc)
    out, into = 2 * param_bytes / rate, (param_bytes + grad_bytes) / rate
    ends = 1 if root else 0
    log.op("FSDP2 all-gather copy-out", m * (2 * blocks + ends), m * (2 * blocks * block + root) * out)
    log.op("FSDP2 reduce-scatter copy-in", m * (blocks + ends), m * (blocks * block + root) * into)
    return block * out, block * into, root * (out + into)


def _step_reductions(cfg: ModelConfig, layout: Layout, tiers, grad_bytes: int, log: _Log) -> float:
    """The reductions once per step between backward and the optimizer, exposed (Megatron-LM's
    finalize_model_grads): with tied embeddings and pipeline stages, the table's gradient all-reduced between
    the first and the last stage (V/tp x H, its embedding group, across the pipeline's link); the gradient
    norm's scalar over the model-parallel ranks and the loss's over the data-parallel ones (latency only)."""
    total = 0.0

    def reduce(part: str, nbytes: float, n: int, what: str) -> None:
        nonlocal total
        if n > 1 and part in tiers:
            seconds = C.collective_seconds("all_reduce", nbytes, n, tiers[part])
            total += seconds
            log.coll("all_reduce", what, 1, seconds, C.bytes_sent("all_reduce", nbytes, n))

    if cfg.tie_embeddings and layout.pp > 1 and not v_shape(layout):  # a V holds both ends on rank 0
        reduce("pp", -(-cfg.vocab_size // layout.tp) * cfg.d_model * grad_bytes, 2, "tied embedding")
    reduce("pp" if layout.pp > 1 else "tp", 4, layout.tp * layout.pp, "gradient norm")
    reduce("dp", 4, layout.dp * layout.cp, "loss")
    return total


def _optimizer(cfg, layout: Layout, work: RankWork, idx, r, acc: Accelerator, log: _Log) -> float:
    """The fused update of rank r's parameters (its share of them under ZeRO >= 1), memory-bound."""
    nbytes = sum(count * op.bytes for ops, count in _parts(cfg, work, idx, *_ends(layout, r))
                 for op in ops if op.phase == "optimizer")
    seconds = nbytes / (layout.shard // layout.cp if layout.zero >= 1 else 1) / copy_bandwidth(acc)
    log.op("optimizer (fused AdamW)", 1, seconds)
    return seconds
