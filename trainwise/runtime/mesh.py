"""One DeviceMesh for the whole job: pipeline parallel x data parallel x tensor parallel, dims named.

    world size = pp x dp x tp          (parallel.tp, parallel.pp; dp is what is left)
    rank = (pp_rank x dp + dp_rank) x tp + tp_rank

The planner's rank order (trainwise.cost.layout, Megatron-LM's and torchtitan's): tp innermost, so a
tensor-parallel group is tp neighbouring ranks (on one machine when tp <= GPUs per node, where its
per-layer collectives need NVLink bandwidth), data-parallel replicas next and pipeline stages outermost.
parallel.strategy says how the dp dimension shards (runtime.distributed.wrap). The layout is the
planner's cost.layout.Layout, and so is its check: the rules a plan and a run share are
cost.layout.check_layout's; check_layout here adds what only the trainer needs.
"""

from __future__ import annotations

import math
import re

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainwise.config import ZERO_STAGE, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from trainwise.config.checks import divisors
from trainwise.cost import layout as planned
from trainwise.cost.layout import Layout, make_layout
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
    started more than one data-parallel replica with parallel.strategy = 'none'. The strategy is the one that
    runs (Layout.strategy): none where there is one replica."""
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
    layout = make_layout(world_size, tp=p.tp, pp=p.pp, vpp=p.vpp if p.pp > 1 else 1, zero=ZERO_STAGE[p.strategy],
                         micro_batches=micro_batches)
    if p.strategy == "none" and layout.dp > 1:
        raise TrainwiseError(
            f"this process was launched by torchrun as one of {world_size} ranks, but parallel.strategy = "
            "'none'; add --set parallel.strategy=ddp (replicated), parallel.strategy=zero1 (optimizer states "
            "sharded), parallel.strategy=zero2 (gradients too) or parallel.strategy=fsdp (everything sharded)"
            + (f" for the {layout.dp} data-parallel replicas of tp {layout.tp} x pp {layout.pp}"
               if layout.model_parallel > 1 else "") + "."
        )
    return Layout(**{**vars(layout), "pp_schedule": p.pp_schedule})


def describe(layout: Layout) -> str:
    parts = [f"dp {layout.dp}"]
    if layout.pp > 1:
        parts.append(f"pp {layout.pp} ({layout.pp_schedule}"
                     + (f", {layout.vpp} stages per rank" if layout.vpp > 1 else "") + ")")
    if layout.tp > 1:
        parts.append(f"tp {layout.tp} (sequence parallel)")
    return " x ".join(parts)


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The job's DeviceMesh, shape (pp, dp, tp) with those dim names; every rank calls it."""
    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=DIMS)


def check_layout(cfg: RunConfig) -> None:
    """The model and batch against parallel.tp / pp / vpp, before anything starts; each error names the
    numbers and a layout that works. What only the trainer needs first (tensor parallelism divides KV heads,
    widths and the sequence evenly; no MoE across stages), then the rules a plan shares
    (cost.layout.check_layout: layers per stage, micro-batches per schedule), in the config's names."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.tp > 1:
        _check_tp(p.tp, m, t)
    if p.pp > 1 and m.is_moe:
        raise TrainwiseError(
            f"model.n_experts = {m.n_experts} with parallel.pp = {p.pp}: a mixture-of-experts model under pipeline "
            "parallelism does not train correctly yet (its losses drift 3e-3 from one process's); train it with "
            "parallel.tp and the data-parallel dimension, with parallel.pp=1.")
    layout = Layout(tp=p.tp, pp=p.pp, vpp=p.vpp if p.pp > 1 else 1, micro_batches=t.grad_accum_steps,
                    sequence_parallel=p.tp > 1, pp_schedule=p.pp_schedule)
    try:
        planned.check_layout(m, layout, t.seq_len)
    except TrainwiseError as err:
        message = re.sub(r"(--tp|--pp|--vpp|--grad-accum)( (\d+))?",
                         lambda f: _CONFIG_NAMES[f[1]] + (f"={f[3]}" if f[3] else ""), str(err))
        raise TrainwiseError(message + " (The micro-batches per step are train.grad_accum_steps.)") from None


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
