"""One DeviceMesh for the whole job: pipeline parallel x data parallel x tensor parallel, dims named.

    world size = pp x dp x tp          (parallel.tp, parallel.pp; dp is what is left)
    rank = (pp_rank x dp + dp_rank) x tp + tp_rank

The planner's rank order (trainwise.cost.layout, Megatron-LM's and torchtitan's): tp innermost, so a
tensor-parallel group is tp neighbouring ranks (on one machine when tp <= GPUs per node, where its
per-layer collectives need NVLink bandwidth), data-parallel replicas next and pipeline stages outermost.
parallel.strategy says how the dp dimension shards (runtime.distributed.wrap). The layout is the
planner's cost.layout.Layout, and so is its check: the rules a plan and a run share are
cost.layout.check_layout's; check_layout here adds what only the trainer needs. Expert parallelism (parallel.ep)
is carved out of the data-parallel ranks, ep neighbours a group (dp = edp x ep): its mesh is
runtime.expert_parallel's. Context parallelism (parallel.cp) sits between tp and dp (rank = ((pp_rank x dp +
dp_rank) x cp + cp_rank) x tp + tp_rank): its groups are runtime.context_parallel's, and its ranks join the
data-parallel ones in the gradient reduction (with tp = pp = 1 the whole world, dp x cp ranks).
"""

from __future__ import annotations

import math
import re

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainwise.config import ZERO_STAGE, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from trainwise.config.checks import divisors
from trainwise.cost import layout as planned
from trainwise.cost.layout import ZERO_BUBBLE, Layout, make_layout
from trainwise.errors import TrainwiseError

DIMS = ("pp", "dp", "tp")

__all__ = ["DIMS", "Layout", "build_mesh", "check_layout", "describe", "layout_for"]

# the planner's flags, as a training config names them
_CONFIG_NAMES = {"--tp": "parallel.tp", "--pp": "parallel.pp", "--vpp": "parallel.vpp",
                 "--grad-accum": "train.grad_accum_steps"}


def layout_for(p: ParallelConfig, world_size: int, micro_batches: int = 1) -> Layout:
    """The layout of `world_size` ranks (torchrun's WORLD_SIZE, 1 for a process started alone) for [parallel]
    (cost.layout.Layout, sequence parallel with tp > 1): the one the trainer's run description holds
    (cost.run.Run) and runtime.distributed.init joins. A TrainwiseError naming the numbers and a layout that
    works when tp x pp > 1 in a single process, when world size is not a multiple of tp x pp, or when torchrun
    started more than one data-parallel replica with parallel.strategy = 'none', or when parallel.ep does not
    divide the data-parallel ranks. The strategy is the one that runs (Layout.strategy): none where there is one
    replica."""
    mp = p.tp * p.pp
    if world_size == 1 and mp > 1:
        raise TrainwiseError(
            f"parallel.tp = {p.tp} x parallel.pp = {p.pp} divides one model over {mp} ranks, but this is a single "
            f"process: launch it with torchrun, e.g. `torchrun --nproc-per-node {mp} -m trainwise train ...` "
            "(or set parallel.tp=1 and parallel.pp=1 to train in one process).")
    if world_size % mp:
        fits = [f"tp={tp} x pp={pp}" for tp in divisors(world_size) for pp in divisors(world_size // tp)
                if (tp, pp) != (1, 1)][:3]
        raise TrainwiseError(
            f"torchrun started {world_size} ranks, which is not a multiple of parallel.tp = {p.tp} x parallel.pp = "
            f"{p.pp} = {mp} (world size = dp x pp x tp). Start {mp * max(1, world_size // mp)} ranks "
            f"(torchrun --nproc-per-node), or pick tp and pp whose product divides {world_size}"
            + (f" (e.g. {', '.join(fits)})" if fits else "") + ".")
    if p.cp > 1:
        _check_cp_ranks(p, world_size)
    layout = make_layout(world_size, tp=p.tp, pp=p.pp, vpp=p.vpp if p.pp > 1 else 1, cp=p.cp, ep=p.ep,
                         zero=ZERO_STAGE[p.strategy], micro_batches=micro_batches, cp_impl=_cp_impl(p),
                         pp_schedule=p.pp_schedule, fsdp_grad_sync=p.fsdp_grad_sync)
    if world_size == 1 and p.ep > 1:
        raise TrainwiseError(
            f"parallel.ep = {p.ep} divides the experts over {p.ep} data-parallel ranks, but this is a single "
            f"process: launch it with torchrun, e.g. `torchrun --nproc-per-node {p.ep} -m trainwise train ...` "
            "(or set parallel.ep=1 to train in one process).")
    if layout.dp % p.ep:
        fits = [str(e) for e in divisors(layout.dp) if e > 1]
        raise TrainwiseError(
            f"parallel.ep = {p.ep} does not divide the {layout.dp} data-parallel ranks of this job (world size "
            f"{world_size} / (tp {p.tp} x pp {p.pp})): expert parallelism carves groups of ep ranks out of the "
            f"data-parallel ones (dp = edp x ep). Start {mp * p.ep * max(1, layout.dp // p.ep)} ranks (torchrun "
            f"--nproc-per-node), or set parallel.ep to a divisor of {layout.dp}"
            + (f" ({', '.join(fits)})" if fits else " (1: no expert parallelism)") + ".")
    if p.strategy == "none" and layout.dp > 1:
        raise TrainwiseError(
            f"this process was launched by torchrun as one of {world_size} ranks, but parallel.strategy = "
            "'none'; add --set parallel.strategy=ddp (replicated), parallel.strategy=zero1 (optimizer states "
            "sharded), parallel.strategy=zero2 (gradients too) or parallel.strategy=fsdp (everything sharded)"
            + (f" for the {layout.dp} data-parallel replicas of tp {layout.tp} x pp {layout.pp}"
               if layout.model_parallel > 1 else "") + "."
        )
    return layout


def _cp_impl(p: ParallelConfig) -> str:
    """How the trainer's context parallelism exchanges keys and values, in cost.layout's words (the layout's
    default where there is none)."""
    return "allgather" if p.cp > 1 else Layout.cp_impl


def _check_cp_ranks(p: ParallelConfig, world_size: int) -> None:
    """Context parallelism needs cp ranks per tensor-parallel rank of each replica, and a strategy that reduces
    the gradients over them (the cp ranks hold the same parameters: runtime.context_parallel)."""
    split = p.tp * p.pp * p.cp
    if world_size == 1:
        raise TrainwiseError(
            f"parallel.cp = {p.cp} divides each sequence over {p.cp} ranks, but this is a single process: launch it "
            f"with torchrun, e.g. `torchrun --nproc-per-node {split} -m trainwise train ...` (or set parallel.cp=1 "
            "to train in one process).")
    if world_size % split:
        fits = [str(c) for c in divisors(world_size // (p.tp * p.pp)) if c > 1]
        raise TrainwiseError(
            f"torchrun started {world_size} ranks, which is not a multiple of parallel.tp = {p.tp} x parallel.pp = "
            f"{p.pp} x parallel.cp = {p.cp} = {split} (world size = dp x cp x tp x pp). Start "
            f"{split * max(1, world_size // split)} ranks (torchrun --nproc-per-node), or set parallel.cp to a "
            f"divisor of {world_size // (p.tp * p.pp)}" + (f" ({', '.join(fits)})" if fits else "") + ".")
    if p.strategy == "none":
        raise TrainwiseError(
            f"parallel.cp = {p.cp} with parallel.strategy = 'none': the {p.cp} ranks that divide a sequence hold the "
            "same parameters and average their gradients with the data-parallel ranks; add --set "
            "parallel.strategy=ddp (replicated), zero1, zero2 or fsdp (sharded over the dp x cp ranks).")


def describe(layout: Layout) -> str:
    parts = [f"dp {layout.dp}"]
    if layout.pp > 1:
        parts.append(f"pp {layout.pp} ({layout.pp_schedule}"
                     + (f", {layout.vpp} stages per rank" if layout.vpp > 1 else "") + ")")
    if layout.cp > 1:
        parts.append(f"cp {layout.cp} (each sequence in {2 * layout.cp} chunks, head-tail; keys and values "
                     "all-gathered)")
    if layout.tp > 1:
        parts.append(f"tp {layout.tp} (sequence parallel)")
    if layout.ep > 1:
        parts.append(f"ep {layout.ep} (the experts over edp {layout.expert_dp} x ep {layout.ep} of the dp ranks)")
    return " x ".join(parts)


def build_mesh(layout: Layout, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The job's DeviceMesh, shape (pp, dp, tp) with those dim names, or (pp, dp, cp, tp) with cp > 1, and its
    replicas: the 1-D mesh of the ranks that hold the same parameters, which FSDP2 shards over and replicate
    reduces over (runtime.distributed.wrap): dp, or dp x cp flattened. Every rank calls it."""
    if layout.cp == 1:
        mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=DIMS)
        return mesh, mesh["dp"]
    mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.cp, layout.tp),
                            mesh_dim_names=("pp", "dp", "cp", "tp"))
    return mesh, mesh["dp", "cp"]._flatten("dp_cp")


def pipeline_micro_batches(cfg: RunConfig) -> str | None:
    """A pipeline needs at least pp micro-batches a step (dualpipev 2 pp): where train.grad_accum_steps gives
    fewer and the step's sequences divide, they are cut into that many micro-batches, the global batch
    unchanged (as torchtitan cuts its local batch into the pipeline's micro-batches). Changes cfg.train in
    place, before the run's config is stored; the sentence that says so, or None."""
    p, t = cfg.parallel, cfg.train
    needed = 2 * p.pp if p.pp_schedule == "dualpipev" else p.pp
    sequences = t.micro_batch * t.grad_accum_steps
    if p.pp == 1 or t.grad_accum_steps >= needed or sequences % needed:
        return None
    t.micro_batch, t.grad_accum_steps = sequences // needed, needed
    return (f"parallel.pp = {p.pp}: the step's {sequences} sequences run as {needed} micro-batches of "
            f"{t.micro_batch} (train.micro_batch={t.micro_batch}, train.grad_accum_steps={needed}; the same "
            "global batch): a pipeline keeps its stages busy with at least as many micro-batches as stages")


def check_layout(cfg: RunConfig) -> None:
    """The model and batch against parallel.tp / pp / vpp, before anything starts; each error names the
    numbers and a layout that works. What only the trainer needs first (tensor parallelism divides KV heads,
    widths and the sequence evenly), then the rules a plan shares
    (cost.layout.check_layout: layers per stage, micro-batches per schedule), in the config's names."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.tp > 1:
        _check_tp(p.tp, m, t)
    if p.ep > 1:
        _check_ep(p.ep, m, t)
    if p.cp > 1:
        _check_cp(p, m, t)
    if p.pp > 1 and p.pp_schedule in ZERO_BUBBLE:
        _check_zero_bubble(p, m, t)
    layout = Layout(tp=p.tp, pp=p.pp, vpp=p.vpp if p.pp > 1 else 1, cp=p.cp, micro_batches=t.grad_accum_steps,
                    sequence_parallel=p.tp > 1, pp_schedule=p.pp_schedule, cp_impl=_cp_impl(p))
    try:
        planned.check_layout(m, layout, t.seq_len)
    except TrainwiseError as err:
        message = re.sub(r"(--tp|--pp|--vpp|--grad-accum)( (\d+))?",
                         lambda f: _CONFIG_NAMES[f[1]] + (f"={f[3]}" if f[3] else ""), str(err))
        raise TrainwiseError(message + " (The micro-batches per step are train.grad_accum_steps.)") from None


def _check_cp(p: ParallelConfig, m: ModelConfig, t: TrainConfig) -> None:
    """Context parallelism cuts each sequence into 2 x cp equal chunks and gathers plain causal attention's keys
    and values (runtime.context_parallel); what it does not cover yet is refused."""
    cp = p.cp
    if t.seq_len % (2 * cp):
        smaller = [c for c in range(cp - 1, 1, -1) if t.seq_len % (2 * c) == 0][:1]
        raise TrainwiseError(
            f"parallel.cp = {cp} cuts each sequence into 2 x parallel.cp = {2 * cp} equal chunks (rank r holds "
            f"chunks r and {2 * cp - 1} - r, so that every rank does the same causal attention work), but "
            f"train.seq_len = {t.seq_len} is not a multiple of {2 * cp}. Use a train.seq_len that is (e.g. "
            f"{t.seq_len - t.seq_len % (2 * cp) or 2 * cp} or {t.seq_len + 2 * cp - t.seq_len % (2 * cp)})"
            + (f", or parallel.cp={smaller[0]}" if smaller else "") + ".")
    if m.is_moe or m.attention == "mla":
        what = f"model.n_experts = {m.n_experts}" if m.is_moe else "model.attention = 'mla'"
        raise TrainwiseError(
            f"parallel.cp = {cp} with {what}: trainwise trains context parallelism for dense models of multi-head "
            "or grouped-query attention so far (a MoE layer's load-balancing loss and expert loads would be each "
            "rank's share of the sequence); use parallel.tp or the data-parallel dimension, with parallel.cp=1.")
    if m.sliding_window or m.attention_sinks:
        raise TrainwiseError(
            f"parallel.cp = {cp} with model.sliding_window = {m.sliding_window}, model.attention_sinks = "
            f"{str(m.attention_sinks).lower()}: context parallelism gathers keys for plain causal attention; "
            "windows and sinks are not divided over cp ranks yet. Set parallel.cp=1.")
    if t.seq_len // cp % p.tp:
        raise TrainwiseError(
            f"parallel.cp = {cp} x parallel.tp = {p.tp}: each context-parallel rank holds train.seq_len / cp = "
            f"{t.seq_len // cp} positions, which sequence parallelism divides over tp, but {p.tp} does not divide "
            f"{t.seq_len // cp}; use a train.seq_len that is a multiple of {2 * cp * p.tp // math.gcd(2, p.tp)}.")
    if t.compile == "true":
        raise TrainwiseError(
            f"parallel.cp = {cp} with train.compile = true: context-parallel steps run eager (their hooks and "
            "collectives are outside what trainwise compiles); set train.compile=false or auto.")


def _check_ep(ep: int, m: ModelConfig, t: TrainConfig) -> None:
    """Expert parallelism gives each of ep ranks n_experts / ep whole experts of every MoE layer."""
    if not m.is_moe:
        raise TrainwiseError(f"parallel.ep = {ep} divides a mixture-of-experts model's experts over ranks, but this "
                             "model has none (model.n_experts = 0); set parallel.ep=1, or model.n_experts and "
                             "model.top_k for a MoE model.")
    if m.n_experts % ep:
        fits = [str(e) for e in divisors(m.n_experts) if e > 1]
        raise TrainwiseError(
            f"parallel.ep = {ep} does not divide model.n_experts = {m.n_experts}: each expert-parallel rank holds "
            f"n_experts / ep whole experts. Use parallel.ep=" + (" or ".join(fits) if fits else "1")
            + f", or a model whose n_experts is a multiple of {ep}.")
    if t.compile == "true":
        raise TrainwiseError(f"parallel.ep = {ep} with train.compile = true: the expert all-to-alls read their "
                             "split sizes on the host, which a compiled graph cannot; set train.compile=false "
                             "(auto leaves MoE models eager).")


def _check_tp(tp: int, m: ModelConfig, t: TrainConfig) -> None:
    """Tensor parallelism divides heads, KV heads and MLP widths by tp, and sequence parallelism the
    sequence (the planner replicates KV heads when tp exceeds them; trainwise's plan does not)."""
    if m.attention == "mla":
        raise TrainwiseError(f"parallel.tp = {tp} with model.attention = 'mla': trainwise splits multi-head latent "
                             "attention across pipeline stages and data-parallel ranks but not by tensor "
                             "parallelism yet; use parallel.pp or the data-parallel dimension, with parallel.tp=1.")
    for key in ("attention_sinks", "router_logit_bias"):
        if getattr(m, key):
            raise TrainwiseError(f"parallel.tp = {tp} with model.{key} = true: tensor parallelism does not divide "
                                 "gpt-oss's sink logits and router bias yet; use the data-parallel dimension (or "
                                 "parallel.pp), with parallel.tp=1.")
    if m.loss_chunk_tokens:
        raise TrainwiseError(f"parallel.tp = {tp} with model.loss_chunk_tokens = {m.loss_chunk_tokens}: under tensor "
                             "parallelism the LM head is sharded by vocabulary, which the chunked loss does not "
                             "take; set model.loss_chunk_tokens=0.")
    widths = [("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads), ("model.ffn_hidden", m.ffn_hidden),
              ("train.seq_len", t.seq_len)]
    if m.is_moe:
        widths.append(("model.expert_ffn_hidden", m.expert_ffn_hidden))
    for name, value in widths:
        if value % tp:
            good = max(d for d in divisors(math.gcd(*[v for _, v in widths])) if d <= tp)
            raise TrainwiseError(
                f"parallel.tp = {tp} does not divide {name} = {value}: tensor parallelism gives each rank "
                f"1/tp of the heads, KV heads and MLP width, and sequence parallelism 1/tp of the sequence. Use "
                f"parallel.tp={good}, or a model whose n_heads, n_kv_heads, ffn_hidden and seq_len tp divides.")


def _check_zero_bubble(p: ParallelConfig, m: ModelConfig, t: TrainConfig) -> None:
    """What the zero-bubble schedules (a backward split into the input's and the weights' halves) do not train
    with here: FSDP2's sharded parameters (a step left some without gradients), compiled stages (torch's
    schedules refuse them) and, in a V (zbv, dualpipev), an MoE model: torch's V runtime runs backward actions in
    its evaluation too, and a MoE model's evaluation loss through it was not one process's when tried."""
    other = "parallel.pp_schedule=1f1b or interleaved"
    why = (f"FSDP2 (parallel.strategy = {p.strategy}) takes no weight gradients from the split backward here: use "
           f"parallel.strategy=ddp (or keep {p.strategy} with {other})" if p.strategy in ("zero2", "fsdp") else
           "a MoE model's evaluation through torch's V schedule (its evaluation runs backward actions too) does not "
           "give one process's loss yet: use parallel.pp_schedule=interleaved_zb (or 1f1b, interleaved)"
           if m.is_moe and p.pp_schedule in ("zbv", "dualpipev") else
           "torch's zero-bubble schedules do not run compiled stages: set train.compile=false (or keep it with "
           f"{other})" if t.compile == "true" else None)
    if why:
        raise TrainwiseError(f"parallel.pp_schedule = {p.pp_schedule} splits each backward into its input and weight "
                             f"halves, and {why}.")
