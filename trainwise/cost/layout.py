"""A multi-GPU layout: how one step's work is split over data (dp), tensor (tp, with sequence parallelism),
pipeline (pp, with vpp virtual stages per rank), context (cp) and expert (ep) parallel ranks; whether it
can work for a model; where each group's ranks sit (the pipeline's stages and schedules: cost.schedule).

Rank order (Megatron-LM's default, tp-cp-ep-dp-pp): tensor-parallel ranks are neighbours (inside a node),
then context, expert and data parallel, pipeline stages outermost. The expert-parallel group is carved out
of the dp x cp ranks (Megatron-Core's expert parallelism), so world = tp x cp x dp x pp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from trainwise.config import STRATEGY_OF_STAGE, ModelConfig
from trainwise.config.run import FSDP_GRAD_SYNCS, MULTI_STAGE_SCHEDULES, PP_SCHEDULES
from trainwise.cost.params import embedding_params, layer_params, mlp_params, norm_params
from trainwise.errors import TrainwiseError

# flash: the GPU's default fused kernel (FlashAttention-2 on Ampere and Hopper, cuDNN's on Blackwell), flash2
# FlashAttention-2 named; flash3 and cudnn: FlashAttention-3 (Hopper) and cuDNN's fused attention (Hopper, Blackwell);
# unfused: scores in memory; cudnn-fp8: cuDNN's attention in FP8 (plan --fp8-attention, with an FP8 precision)
ATTENTION_IMPLS = ("flash", "flash2", "flash3", "cudnn", "unfused", "cudnn-fp8")
# how context parallelism exchanges keys and values: ring (p2p around the cp ranks under the attention blocks:
# Megatron-Core's p2p, ring attention), allgather (all of them gathered before attention, their gradients
# reduce-scattered after: PyTorch's context_parallel default, Megatron-Core's all_gather) or a2a (Ulysses:
# all-to-alls trade the sequence split for a head split around attention: DeepSpeed, Megatron-Core's a2a)
CP_IMPLS = ("ring", "allgather", "a2a")
# how expert parallelism moves tokens to their experts and back: alltoall (each routed copy to its expert's rank
# and back: Megatron-Core's alltoall and flex dispatchers, torchtitan's, trainwise's trainer) or allgather (every
# token gathered over the tp x ep ranks, each rank keeping its experts' rows, the outputs reduce-scattered in
# fp32: Megatron-Core's allgather dispatcher, its default)
EP_DISPATCHES = ("alltoall", "allgather")
V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank placed in a V: rank r holds r and 2 pp - 1 - r
ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")  # schedules that split a backward into its I and W halves

# How tensor-parallel collectives overlap the GEMMs (cost.cluster): "async", torchtitan's AsyncTP (inductor's
# micro-pipelined all-gather + matmul and matmul + reduce-scatter), the forward's collectives hidden and the
# backward's exposed, as its authors measured it (a forward pass about 20% faster and a step about 8% faster on
# Llama 3 70B, the forward's share of the step); "te", Transformer Engine's userbuffers (Megatron-Core's
# --tp-comm-overlap), every pass's collectives under the GEMMs.
TP_OVERLAPS = ("async", "te")
# When ZeRO-3 gathers the next block in backward: "pre", before this block's gradients are computed, so the gather
# runs under them (FSDP2's one-block prefetch, FSDP1's BackwardPrefetch.BACKWARD_PRE, Megatron-FSDP); "post", only
# after them, once this block is resharded (FSDP1's BACKWARD_POST, Composer's default): each block's backward waits
# for its own gather, the reduce-scatter before it runs under that backward, and one block is gathered at a time
FSDP_PREFETCHES = ("pre", "post")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual stages (model chunks) per pipeline rank: the interleaved 1F1B schedule when > 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    sequence_parallel: bool = False  # with tp > 1: norms, dropout and the residual sharded over the sequence
    zero: int = 0  # ZeRO stage over the data-parallel ranks (3 = FSDP)
    micro_batches: int = 1  # m: micro-batches per pipeline (per data-parallel rank) per optimizer step
    dp_overlap: bool = True  # gradient reduction under backward (DDP buckets); False: after backward
    tp_overlap: str | None = None  # TP_OVERLAPS: tensor-parallel collectives under the GEMMs, and which of them
    # the expert-parallel all-to-alls under another micro-batch's computation (Megatron-Core's combined 1F1B:
    # one micro-batch's forward and another's backward interleaved, each one's dispatch under the other's work)
    ep_overlap: bool = False
    # the pipeline's sends and receives under the neighbouring chunks' work in the interleaved schedule's steady
    # state (Megatron-Core's overlap_p2p_comm, which NeMo and Megatron-Bridge set with virtual stages); those of
    # the warm-up and the cool-down stay exposed (p2p_exposed_share); other schedules: no effect
    pp_overlap: bool = False
    attention_impl: str = "flash"  # ATTENTION_IMPLS; "unfused": scores in memory, softmax between two matmuls
    # the trainer's pipeline schedule: 1f1b | gpipe | interleaved (vpp > 1) | interleaved_zb (zero bubble, vpp > 1)
    # | zbv | dualpipev (vpp = 2 in a V: rank_stages)
    pp_schedule: str = "1f1b"
    cp_impl: str = "ring"  # CP_IMPLS: how context parallelism exchanges keys and values
    ep_dispatch: str = "alltoall"  # EP_DISPATCHES: how expert parallelism moves tokens to their experts
    # expert tensor parallelism: the routed experts' width split over etp ranks (None: over tp, Megatron-Core's
    # default). The experts fold onto the same tp x cp x dp ranks as etp x ep x edp (Megatron-Core's MoE
    # parallel folding): ep x etp must divide tp x cp x dp, and each expert's gradients reduce over edp.
    etp: int | None = None
    # HSDP (FSDP2's replicate x shard, torchtitan's data_parallel_shard_degree): the data-parallel ranks one
    # ZeRO-3 shard group spans, the rest replicas of it (ranks ordered tp-cp-dp_shard-dp_replicate, innermost
    # first); None: all of them (FSDP)
    dp_shard: int | None = None
    # ZeRO-3 as FSDP2 runs it: each gather copied out into the parameters and each block's gradients copied into
    # the reduce-scatter's input, on the compute stream (cost.cluster._fsdp); False: FSDP1's flat parameters and
    # Megatron-FSDP's buffers, gathered into and reduced from in place
    fsdp_copies: bool = True
    # when ZeRO-3 reduce-scatters a step's gradients (config.run.FSDP_GRAD_SYNCS): "step", once, after the last
    # micro-batch (their unsharded fp32 gradients summed on each rank until then: trainwise's trainer, FSDP2 with
    # gradient sync off before the last); "micro-batch", each one's as its backward runs, into the rank's shard
    # (FSDP2 left syncing, as torchtitan runs it; Composer's FSDP; Megatron-FSDP). With pp: "step" (torch's
    # pipeline schedules reduce at each stage's last backward). None: the stack's (cost.run.fsdp_grad_sync)
    fsdp_grad_sync: str | None = None
    fsdp_prefetch: str = "pre"  # FSDP_PREFETCHES

    @property
    def reduces_each_micro_batch(self) -> bool:
        """ZeRO-3 reduce-scatters every micro-batch's gradients (Layout.fsdp_grad_sync "micro-batch", one stage)."""
        return self.fsdp_grad_sync == "micro-batch" and self.zero == 3 and self.pp == 1

    @property
    def reduces_after_pipeline(self) -> bool:
        """ZeRO-2 under torch's pipeline schedules (FSDP2: trainwise's trainer, torchtitan): each stage's gradients
        reduce-scattered after its last backward, not under it."""
        return self.zero == 2 and self.pp > 1

    @property
    def shard(self) -> int:
        """Ranks one parameter's ZeRO / FSDP shards spread over: dp x cp, or dp_shard x cp under HSDP."""
        return (self.dp_shard or self.dp) * self.cp

    @property
    def replicas(self) -> int:
        """Copies of each shard group (HSDP's replicate dimension; 1 otherwise)."""
        return self.dp // (self.dp_shard or self.dp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def folds_experts(self, megatron: bool) -> bool:
        """Megatron-Core's folded experts (another stack's run, sequence parallel or tp 1, etp 1): each tp rank routes
        and dispatches its own T / tp positions, so all a MoE layer keeps is 1/tp on each."""
        return megatron and (self.sequence_parallel or self.tp == 1) and self.expert_tp == 1

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (what their gradients are reduced, and FSDP shards them, over)."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def stages(self) -> int:
        """Pipeline chunks (stages) of the model: pp x vpp."""
        return self.pp * self.vpp

    @property
    def strategy(self) -> str:
        """The trainer's parallel.strategy for the data-parallel dimension: none with one replica (ZeRO shards
        over the dp x cp ranks, which hold the same parameters)."""
        return "none" if self.dp * self.cp <= 1 else STRATEGY_OF_STAGE[self.zero]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank in the module's order (tp innermost, pp outermost)."""
        return rank // (self.tp * self.cp) % self.dp, rank // (self.tp * self.cp * self.dp), rank % self.tp

    @property
    def model_parallel(self) -> int:
        """Ranks one model replica is split over (its parameters: 1 / (tp x pp) each, experts also / ep)."""
        return self.tp * self.pp

    @property
    def replicate(self) -> bool:
        """ddp on a model-parallel mesh, which trainwise runs as FSDP2's replicate (runtime.distributed.wrap: DDP
        does not take DTensor parameters): FSDP2's mixed precision and gradient accumulation, every unit kept
        gathered (zero2's holding, over a shard of one)."""
        return self.strategy == "ddp" and self.model_parallel > 1

    def to_json(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "cp": self.cp, "ep": self.ep,
                "sequence_parallel": self.sequence_parallel, "zero": self.zero,
                "micro_batches": self.micro_batches, "dp_overlap": self.dp_overlap,
                "attention_impl": self.attention_impl, "cp_impl": self.cp_impl, "ep_dispatch": self.ep_dispatch,
                "etp": self.expert_tp,
                "ep_overlap": self.ep_overlap, "pp_schedule": self.pp_schedule, "tp_overlap": self.tp_overlap,
                "pp_overlap": self.pp_overlap, "dp_shard": self.dp_shard or self.dp, "fsdp_copies": self.fsdp_copies,
                "fsdp_grad_sync": self.fsdp_grad_sync, "fsdp_prefetch": self.fsdp_prefetch}


def make_layout(gpus: int, *, tp: int = 1, pp: int = 1, vpp: int = 1, cp: int = 1, ep: int = 1,
                sequence_parallel: bool | None = None, zero: int = 0, micro_batches: int = 1,
                dp_overlap: bool = True, attention_impl: str = "flash", tp_overlap: str | bool | None = None,
                cp_impl: str = "ring", etp: int | None = None, ep_overlap: bool = False,
                pp_schedule: str | None = None, pp_overlap: bool = False, dp_shard: int | None = None,
                fsdp_copies: bool = True, fsdp_grad_sync: str | None = None, ep_dispatch: str = "alltoall",
                fsdp_prefetch: str = "pre") -> Layout:
    """The layout of `gpus` GPUs: dp = gpus / (tp x pp x cp); sequence parallelism on by default with tp > 1;
    the pipeline schedule 1F1B, or interleaved 1F1B with vpp > 1, unless `pp_schedule` names one; tp_overlap
    one of TP_OVERLAPS (True: "async", as the bare --tp-overlap). ep_overlap and pp_overlap say what the stack
    does where it applies (expert parallelism; the interleaved schedule): kept as given, so that --fit's
    candidates inherit them."""
    for name, value in (("--tp", tp), ("--pp", pp), ("--vpp", vpp), ("--cp", cp), ("--ep", ep), ("--gpus", gpus),
                        ("micro-batches per step", micro_batches), ("--etp", 1 if etp is None else etp)):
        if value < 1:
            raise TrainwiseError(f"{name} = {value} must be a positive whole number.")
    if attention_impl not in ATTENTION_IMPLS:
        raise TrainwiseError(f"--attention-impl '{attention_impl}' must be one of {', '.join(ATTENTION_IMPLS)}.")
    if cp_impl not in CP_IMPLS:
        raise TrainwiseError(f"--cp-impl '{cp_impl}' must be one of {', '.join(CP_IMPLS)}.")
    if ep_dispatch not in EP_DISPATCHES:
        raise TrainwiseError(f"--ep-dispatch '{ep_dispatch}' must be one of {', '.join(EP_DISPATCHES)}.")
    if ep_overlap and ep_dispatch != "alltoall":
        raise TrainwiseError("--ep-overlap hides the expert-parallel all-to-alls under another micro-batch's work "
                             "(Megatron-Core's combined 1F1B), which its allgather dispatcher does not run: drop "
                             "--ep-overlap, or plan --ep-dispatch alltoall.")
    tp_overlap = "async" if tp_overlap is True else tp_overlap or None  # the bare --tp-overlap: AsyncTP
    if tp_overlap is not None and tp_overlap not in TP_OVERLAPS:
        raise TrainwiseError(f"--tp-overlap '{tp_overlap}' must be one of {', '.join(TP_OVERLAPS)}: async "
                             "(torchtitan's AsyncTP) or te (Transformer Engine's, as Megatron-Core's --tp-comm-overlap "
                             "runs it).")
    pp_schedule = pp_schedule or ("interleaved" if vpp > 1 else "1f1b")
    _check_schedule(pp_schedule, pp, vpp)
    split = tp * pp * cp
    if gpus % split:
        raise TrainwiseError(
            f"--gpus {gpus} is not a multiple of tp x pp x cp = {tp} x {pp} x {cp} = {split}: data parallel = "
            f"gpus / (tp x pp x cp) must be whole. Use --gpus {max(split, gpus - gpus % split)} or "
            f"{gpus + split - gpus % split}, or a layout whose product divides {gpus}"
            f"{_divisor_hint(gpus, tp, pp, cp)}.")
    sp = tp > 1 if sequence_parallel is None else sequence_parallel and tp > 1
    dp_shard = _check_hsdp(gpus // split, dp_shard, zero, ep)
    _check_grad_sync(fsdp_grad_sync, zero, pp)
    if fsdp_prefetch not in FSDP_PREFETCHES:
        raise TrainwiseError(f"--fsdp-prefetch '{fsdp_prefetch}' must be one of {', '.join(FSDP_PREFETCHES)}.")
    fsdp_copies = fsdp_copies and fsdp_prefetch != "post"  # BACKWARD_POST is FSDP1's: flat parameters, no copies
    return Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, dp=gpus // split, sequence_parallel=sp, zero=zero,
                  micro_batches=micro_batches, dp_overlap=dp_overlap, attention_impl=attention_impl,
                  tp_overlap=tp_overlap, pp_schedule=pp_schedule, cp_impl=cp_impl,
                  etp=None if etp is None or etp == tp else etp, ep_overlap=ep_overlap, pp_overlap=pp_overlap,
                  dp_shard=dp_shard, fsdp_copies=fsdp_copies, fsdp_grad_sync=fsdp_grad_sync, ep_dispatch=ep_dispatch,
                  fsdp_prefetch=fsdp_prefetch)


def _check_grad_sync(sync: str | None, zero: int, pp: int) -> None:
    """fsdp_grad_sync is None or one of FSDP_GRAD_SYNCS, and "micro-batch" a ZeRO-3 layout's without stages."""
    if sync is not None and sync not in FSDP_GRAD_SYNCS:
        raise TrainwiseError(f"--fsdp-grad-sync (parallel.fsdp_grad_sync) '{sync}' must be one of "
                             f"{', '.join(FSDP_GRAD_SYNCS)}.")
    if sync == "micro-batch" and zero != 3:
        raise TrainwiseError(f"--fsdp-grad-sync micro-batch (parallel.fsdp_grad_sync) says when FSDP (ZeRO-3) "
                             f"reduce-scatters gradients, but this layout is ZeRO-{zero}: add --zero 3 "
                             "(parallel.strategy = 'fsdp'), or leave the setting at 'step'.")
    if sync == "micro-batch" and pp > 1:
        raise TrainwiseError(f"--fsdp-grad-sync micro-batch (parallel.fsdp_grad_sync) with {pp} pipeline stages: "
                             "torch's pipeline schedules reduce each stage's gradients at its last backward "
                             "whatever FSDP is told; leave the setting at 'step' with pp > 1.")


def _check_hsdp(dp: int, dp_shard: int | None, zero: int, ep: int) -> int | None:
    """dp_shard as Layout keeps it (None: FSDP over every data-parallel rank), or a clear error."""
    if dp_shard is None or dp_shard == dp:
        return None
    if dp_shard < 1 or dp % dp_shard:
        raise TrainwiseError(f"--dp-shard {dp_shard} must divide the {dp} data-parallel ranks (GPUs / (tp x pp x cp)): "
                             f"HSDP replicates each shard group dp / dp_shard times; use one of "
                             f"{', '.join(str(d) for d in _divisors(dp))}.")
    if zero != 3:
        raise TrainwiseError(f"--dp-shard {dp_shard} is HSDP, FSDP's (ZeRO-3's) shard groups replicated; add --zero 3 "
                             f"(here --zero {zero}), or drop --dp-shard.")
    if ep > 1:
        raise TrainwiseError(f"--dp-shard {dp_shard} (HSDP) with expert parallelism (--ep {ep}) is not modelled; "
                             "plan it with --dp-shard left out (FSDP over every data-parallel rank).")
    return dp_shard


def _check_schedule(schedule: str, pp: int, vpp: int) -> None:
    """The stages per rank `schedule` runs (the trainer's rules, config.run.ParallelConfig.validate)."""
    if schedule not in PP_SCHEDULES:
        raise TrainwiseError(f"--pp-schedule '{schedule}' must be one of {', '.join(PP_SCHEDULES)}.")
    if pp == 1:
        return
    if vpp > 1 and schedule not in MULTI_STAGE_SCHEDULES:
        raise TrainwiseError(
            f"--vpp {vpp} gives each pipeline rank {vpp} stages, which the {schedule} schedule does not run; use "
            f"--pp-schedule {' or '.join(MULTI_STAGE_SCHEDULES)}, or --vpp 1.")
    if schedule in ("interleaved", "interleaved_zb") and vpp < 2:
        raise TrainwiseError(f"--pp-schedule {schedule} needs --vpp 2 or more stages per pipeline rank (with one "
                             "it is 1F1B); add --vpp 2, or use --pp-schedule 1f1b.")
    if schedule in V_SCHEDULES and vpp != 2:
        raise TrainwiseError(f"--pp-schedule {schedule} runs exactly two stages per pipeline rank, placed in a V; "
                             f"use --vpp 2 (here {vpp}).")


def _divisor_hint(gpus: int, tp: int, pp: int, cp: int) -> str:
    for t in range(tp, 0, -1):
        if gpus % (t * pp * cp) == 0:
            return f" (e.g. --tp {t} --pp {pp}{f' --cp {cp}' if cp > 1 else ''})"
    return ""


def check_layout(cfg: ModelConfig, layout: Layout, seq_len: int) -> None:
    """TrainwiseError naming the numbers, and a layout that works, if `layout` cannot run `cfg`."""
    t, p, v, m = layout.tp, layout.pp, layout.vpp, layout.micro_batches
    if cfg.n_heads % t or (cfg.attention == "mha" and cfg.n_kv_heads % t and t % cfg.n_kv_heads):
        works = [d for d in _divisors(cfg.n_heads) if cfg.attention != "mha" or cfg.n_kv_heads % d == 0
                 or d % cfg.n_kv_heads == 0]
        raise TrainwiseError(
            f"tp = {t} does not divide the model's {cfg.n_heads} attention heads"
            + (f" / {cfg.n_kv_heads} key-value heads" if cfg.attention == "mha" else "")
            + f": each tensor-parallel rank computes whole heads. tp values that work: {', '.join(map(str, works))}.")
    chunks = p * v
    if cfg.n_layers < chunks:
        raise TrainwiseError(
            f"pp x vpp = {p} x {v} = {chunks} pipeline chunks but the model has only {cfg.n_layers} layers: each "
            f"chunk needs at least one. Use pp x vpp <= {cfg.n_layers}, e.g. --pp {min(p, cfg.n_layers)} --vpp "
            f"{max(1, cfg.n_layers // min(p, cfg.n_layers))}.")
    if v > 1 and p == 1:
        raise TrainwiseError(
            f"--vpp {v} needs pipeline parallelism (--pp > 1): virtual stages interleave pipeline ranks.")
    if layout.pp_schedule == "dualpipev" and m < 2 * p:
        raise TrainwiseError(
            f"the dualpipev schedule needs at least as many micro-batches per step as stages, 2 pp = {2 * p} (here "
            f"{m}); raise the micro-batches (--grad-accum) to {2 * p} or more.")
    if layout.pp_schedule == "zbv" and m < p:
        raise TrainwiseError(
            f"the zbv schedule needs at least as many micro-batches per step as pipeline ranks, pp = {p} (here {m}); "
            f"raise the micro-batches (--grad-accum) to {p} or more.")
    if v > 1 and layout.pp_schedule not in V_SCHEDULES and m % p:  # torch's V schedules take any count
        raise TrainwiseError(
            f"the interleaved schedule (vpp = {v}) needs the micro-batches per step ({m}) to be a multiple of "
            f"pp = {p} (Megatron-LM's rule); use {p * max(1, round(m / p))} micro-batches or --vpp 1.")
    if layout.cp > 1 and seq_len % (2 * layout.cp):
        raise TrainwiseError(
            f"cp = {layout.cp} splits each sequence into 2 x cp = {2 * layout.cp} chunks (load-balanced causal "
            f"attention) but seq_len {seq_len} does not divide by that; use a seq_len that is a multiple of "
            f"{2 * layout.cp}.")
    if layout.cp > 1 and layout.cp_impl == "a2a":
        heads = cfg.n_heads // layout.tp, max(1, cfg.n_kv_heads // layout.tp)
        if heads[0] % layout.cp or heads[1] % layout.cp:
            raise TrainwiseError(
                f"--cp-impl a2a (Ulysses) gives each of cp = {layout.cp} ranks whole heads, but a tensor-parallel "
                f"rank holds {heads[0]} query and {heads[1]} key-value heads: cp must divide both. Use --cp-impl "
                "ring or allgather, or a cp that divides them.")
    if layout.ep > 1:
        if not cfg.is_moe:
            raise TrainwiseError(f"--ep {layout.ep} is expert parallelism, but {cfg.name} has no experts; use --ep 1.")
    if cfg.is_moe:
        ranks, etp = layout.tp * layout.cp * layout.dp, layout.expert_tp
        if cfg.n_experts % layout.ep:
            raise TrainwiseError(
                f"ep = {layout.ep} does not divide the {cfg.n_experts} experts; ep values that work: "
                f"{', '.join(str(d) for d in _divisors(cfg.n_experts) if ranks % (d * etp) == 0)}.")
        if ranks % (layout.ep * etp):
            raise TrainwiseError(
                f"ep x etp = {layout.ep} x {etp} must divide tp x cp x dp = {layout.tp} x {layout.cp} x {layout.dp} = "
                f"{ranks}: the experts fold onto the same ranks as the attention (Megatron-Core's MoE parallel "
                f"folding), etp x ep x edp of them{' (etp defaults to tp)' if layout.etp is None else ''}. "
                "Lower --ep, set --etp (e.g. --etp 1), or raise --gpus.")
    if p > 1 and m < p:
        raise TrainwiseError(
            f"pp = {p} pipeline stages need at least {p} micro-batches per step to keep every stage busy (here "
            f"{m}); raise the global batch or --grad-accum, or lower --pp.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------------------------------------------
# where a group's ranks sit


@dataclass(frozen=True)
class GroupPlacement:
    size: int  # ranks in the group
    per_node: int  # of them on one node
    nodes: int  # nodes the group spans
    stride: int = 1  # global ranks between two neighbours of the group

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def placement(layout: Layout, dim: str, gpus_per_node: int) -> GroupPlacement:
    """Where the ranks of one `dim` group ("tp", "cp", "ep", "dp", "pp"; HSDP's "dp_shard" and "dp_replicate")
    sit, ranks numbered tp-cp-ep-dp-pp (innermost first; dp as dp_shard inside dp_replicate): a group's ranks
    are `stride` apart, stride = the product of the inner dimensions."""
    order = ("tp", "cp", "dp", "pp")  # ep folds onto tp x cp x dp (Layout.etp)
    sizes = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp}
    if dim == "ep":  # folded: etp x ep x edp over the tp x cp x dp ranks, etp innermost
        size, stride = layout.ep, layout.expert_tp
    elif dim == "dp_shard":
        size, stride = layout.shard // layout.cp, layout.tp * layout.cp
    elif dim == "dp_replicate":
        size, stride = layout.replicas, layout.tp * layout.shard
    else:
        size, stride = sizes[dim], math.prod(sizes[d] for d in order[:order.index(dim)])
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return GroupPlacement(size, per_node, math.ceil(size / per_node), stride)


# ---------------------------------------------------------------------------------------------------
# one rank's share of the model


def tp_share(cfg: ModelConfig, tp: int, etp: int | None = None) -> ModelConfig:
    """The model one tensor-parallel rank computes (Megatron-LM's column/row-parallel split, Shoeybi et al.
    2019): 1/tp of the heads (key-value heads too, at least one: fewer than tp are replicated), of the MLP
    width and of the vocabulary (padded up), 1/etp (default tp) of the routed experts' width; d_model, head dim
    and the MLA latent ranks whole."""
    etp = tp if etp is None else etp
    if tp == 1 and etp == 1:
        return cfg
    return replace(cfg, n_heads=cfg.n_heads // tp, n_kv_heads=max(1, cfg.n_kv_heads // tp), head_dim=cfg.head_dim,
                   ffn_hidden=math.ceil(cfg.ffn_hidden / tp), vocab_size=math.ceil(cfg.vocab_size / tp),
                   expert_ffn_hidden=math.ceil(cfg.expert_ffn_hidden / etp) if cfg.n_experts else 0,
                   name=f"{cfg.name} (1/{tp} per tensor-parallel rank)")


@dataclass(frozen=True)
class ParamCounts:
    """Parameters one rank holds by kind, as Megatron-LM places them for the cluster planner (tp_share:
    key-value heads replicated when fewer than tp, the vocabulary padded; experts also / ep): per dense
    layer, per MoE layer and of those its routed experts, the embedding (first pipeline rank), the final
    norm and LM head (last pipeline rank). trainwise's own runs are counted parameter by parameter in
    cost.rank.rank_params (tests/test_rank.py holds the two equal where the placements agree)."""

    layer: int
    moe_layer: int
    moe_experts: int
    embedding: int
    head: int


def param_counts(cfg: ModelConfig, layout: Layout) -> ParamCounts:
    share = tp_share(cfg, layout.tp, layout.expert_tp)
    dense = next((i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)), None)
    moe = next((i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)), None)
    experts = cfg.n_experts // layout.ep * mlp_params(cfg.d_model, share.expert_ffn_hidden, cfg.gated, cfg.bias) \
        if moe is not None else 0
    moe_layer = layer_params(share, moe) - (cfg.n_experts - cfg.n_experts // layout.ep) * mlp_params(
        cfg.d_model, share.expert_ffn_hidden, cfg.gated, cfg.bias) if moe is not None else 0
    return ParamCounts(layer=layer_params(share, dense) if dense is not None else 0, moe_layer=moe_layer,
                      moe_experts=experts, embedding=embedding_params(share),
                      # a tied LM head is the embedding's table, but a pipeline's last rank holds its own copy
                      head=norm_params(cfg) + (0 if cfg.tie_embeddings and layout.pp == 1
                                               else share.vocab_size * cfg.d_model))
