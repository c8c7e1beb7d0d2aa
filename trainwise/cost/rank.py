"""Per rank of a torchrun job: what trainwise's own tensor-, pipeline-, expert- and data-parallel runs hold and send.

The planner's multi-GPU model (cost.memory, cost.comm) describes layouts in general; this module
describes, parameter by parameter and collective by collective, the layouts trainwise trains
(trainwise.runtime.mesh, fused, tensor_parallel, pipeline, expert_parallel, distributed), so that verify can
hold each rank of a run to its prediction:

    parameters      the model in split form (runtime.fused: q, k, v and gate, up as separate matrices),
                    each with the dimension tensor parallelism shards (Megatron-LM's column/row split) or
                    none (replicated: norms, the MoE router); a pipeline rank holds its stages' layers,
                    the embedding on stage 0, the final norm and LM head on the last; expert parallelism
                    E / ep of each MoE layer's routed experts; FSDP2 then shards dim 0 of each rank's
                    tensor over dp x cp (torch.chunk's split; context-parallel ranks hold the same parameters)
    communication   per step: tensor parallelism's all-gathers and reduce-scatters of the sequence,
                    pipeline sends and receives of activations and gradients, context parallelism's
                    all-gathers of keys and values, expert parallelism's all-to-alls, FSDP2's all-gathers
                    and reduce-scatters (or replicate's and DDP's all-reduces; the divided experts' over
                    edp), and the few small all-reduces of the
                    step (partial gradients of replicated weights, the gradient norm, the loss; a tied
                    embedding's gradient between the first and last pipeline stage)
    memory          parameters, gradients and optimizer states from the above (the step's peak, with the
                    activations of the micro-batches in flight: cost.rank_memory)

Pure functions of the config and the layout; the run's per-rank check is trainwise.verify.per_rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from trainwise.config import ModelConfig
from trainwise.cost.comm import bytes_sent, ddp_buckets
from trainwise.cost.layout import Layout
from trainwise.cost.schedule import rank_stages, schedule_ops, stage_layers, v_shape

TIED_COPY = "lm_head.weight (tied copy)"  # the last pipeline stage's own copy of a tied embedding table


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the model in split form, as tensor parallelism places it."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dimension tp shards; None: whole on every tp rank
    partial: bool  # replicated, but each tp rank's gradient is a partial sum (all-reduced once per step)
    where: str | int  # "first" (stage 0), "last" (last stage), or the layer index
    unit: str | int  # the FSDP2 / replicate unit: "root" or the layer index


def _linear(prefix: str, out: int, inp: int, bias: bool, tp_dim: int | None, where, split_out: bool = True) -> list:
    """A Linear's weight (out, inp) and bias (out,): column-parallel (tp_dim 0: bias sharded too) or
    row-parallel (tp_dim 1: bias whole, added once, its gradient whole)."""
    specs = [ParamSpec(f"{prefix}.weight", (out, inp), tp_dim, False, where, where)]
    if bias:
        specs.append(ParamSpec(f"{prefix}.bias", (out,), 0 if tp_dim == 0 else None, False, where, where))
    return specs


def _norm(prefix: str, cfg: ModelConfig, width: int, where, unit) -> list:
    specs = [ParamSpec(f"{prefix}.weight", (width,), None, True, where, unit)]
    if cfg.norm == "layernorm" and cfg.bias:
        specs.append(ParamSpec(f"{prefix}.bias", (width,), None, True, where, unit))
    return specs


def _mlp(prefix: str, cfg: ModelConfig, width: int, i: int) -> list:
    H = cfg.d_model
    fc = ["gate", "up"] if cfg.gated else [None]
    specs = []
    for part in fc:
        specs += _linear(f"{prefix}.fc" + (f".{part}" if part else ""), width, H, cfg.bias, 0, i)
    return specs + _linear(f"{prefix}.proj", H, width, cfg.bias, 1, i)


def _attention(cfg: ModelConfig, i: int) -> list:
    p, H, hd = f"blocks.{i}.attn", cfg.d_model, cfg.head_dim
    if cfg.attention == "mla":  # not tensor parallel (config.run.check_layout): shapes for pp and FSDP
        qk, nh = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.n_heads
        specs = []
        if cfg.q_lora_rank:
            specs += _linear(f"{p}.q_down", cfg.q_lora_rank, H, cfg.bias, None, i)
            specs.append(ParamSpec(f"{p}.q_norm.weight", (cfg.q_lora_rank,), None, False, i, i))
            specs += _linear(f"{p}.q_up", nh * qk, cfg.q_lora_rank, False, None, i)
        else:
            specs += _linear(f"{p}.q_proj", nh * qk, H, False, None, i)
        specs += _linear(f"{p}.kv_down", cfg.kv_lora_rank + cfg.qk_rope_head_dim, H, cfg.bias, None, i)
        specs.append(ParamSpec(f"{p}.kv_norm.weight", (cfg.kv_lora_rank,), None, False, i, i))
        specs += _linear(f"{p}.kv_up", nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, False, None, i)
        return specs + _linear(f"{p}.out", H, nh * cfg.v_head_dim, cfg.bias, None, i)
    qkv_bias = cfg.bias or cfg.qkv_bias
    specs = []
    for part, heads in (("q", cfg.n_heads), ("k", cfg.n_kv_heads), ("v", cfg.n_kv_heads)):
        specs += _linear(f"{p}.qkv.{part}", heads * hd, H, qkv_bias, 0, i)
    if cfg.qk_norm:
        specs += [ParamSpec(f"{p}.{n}.weight", (hd,), None, True, i, i) for n in ("q_norm", "k_norm")]
    if cfg.attention_sinks:  # one logit per query head, with its head's tensor-parallel rank
        specs.append(ParamSpec(f"{p}.sinks", (cfg.n_heads,), 0, False, i, i))
    return specs + _linear(f"{p}.out", H, cfg.n_heads * hd, cfg.bias, 1, i)


def _moe(cfg: ModelConfig, i: int) -> list:
    p, H, E, F = f"blocks.{i}.mlp", cfg.d_model, cfg.n_experts, cfg.expert_ffn_hidden
    specs = [ParamSpec(f"{p}.router.weight", (E, H), None, True, i, i)]
    if cfg.router_logit_bias:
        specs.append(ParamSpec(f"{p}.router.bias", (E,), None, True, i, i))
    for part in (["experts_fc.gate", "experts_fc.up"] if cfg.gated else ["experts_fc"]):
        specs.append(ParamSpec(f"{p}.{part}.weight", (E, H, F), 2, False, i, i))
        if cfg.bias:
            specs.append(ParamSpec(f"{p}.{part}.bias", (E, F), 1, False, i, i))
    specs.append(ParamSpec(f"{p}.experts_proj.weight", (E, F, H), 1, False, i, i))
    if cfg.bias:
        specs.append(ParamSpec(f"{p}.experts_proj.bias", (E, H), None, True, i, i))
    if cfg.n_shared_experts:
        shared = _mlp(f"{p}.shared", cfg, cfg.n_shared_experts * F, i)
        specs += [replace(s, partial=True) if s.name.endswith("proj.bias") else s for s in shared]
    return specs


def model_params(cfg: ModelConfig) -> list[ParamSpec]:
    """Every trainable parameter of the model trainwise builds, in split form (tied weights once), in
    the order the model registers them."""
    H = cfg.d_model
    specs = [ParamSpec("embed.weight", (cfg.vocab_size, H), 0, False, "first", "root")]
    if cfg.position == "learned":
        specs.append(ParamSpec("pos_embed.weight", (cfg.max_seq_len, H), 0, False, "first", "root"))
    for i in range(cfg.n_layers):
        specs += (_norm(f"blocks.{i}.norm1", cfg, H, i, i) + _attention(cfg, i)
                  + _norm(f"blocks.{i}.norm2", cfg, H, i, i))
        specs += _moe(cfg, i) if cfg.is_moe_layer(i) else _mlp(f"blocks.{i}.mlp", cfg, cfg.ffn_hidden, i)
    specs += _norm("norm", cfg, H, "last", "root")
    if not cfg.tie_embeddings:
        specs.append(ParamSpec("lm_head.weight", (cfg.vocab_size, H), 0, False, "last", "root"))
    return specs


def chunk(n: int, parts: int, index: int) -> int:
    """Size of piece `index` when n is cut into `parts` as torch.chunk cuts it: pieces of ceil(n / parts),
    the last ones smaller or empty (DTensor's and FSDP2's sharding)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def on_rank(spec: ParamSpec, cfg: ModelConfig, layout: Layout, pp_rank: int) -> bool:
    """Whether the pipeline rank holds the parameter (every parameter when pp = 1)."""
    if layout.pp == 1:
        return True
    stages = rank_stages(layout, pp_rank)
    if spec.where == "first":
        return 0 in stages
    if spec.where == "last":
        return layout.stages - 1 in stages
    return any(spec.where in stage_layers(cfg.n_layers, layout.stages, s) for s in stages)


def tp_shape(spec: ParamSpec, tp: int, tp_rank: int) -> tuple[int, ...]:
    shape = list(spec.shape)
    if spec.tp_dim is not None and tp > 1:
        shape[spec.tp_dim] = chunk(shape[spec.tp_dim], tp, tp_rank)
    return tuple(shape)


def _fsdp(layout: Layout) -> bool:
    return layout.shard > 1 and layout.strategy in ("zero2", "fsdp")


@dataclass(frozen=True)
class RankParam:
    spec: ParamSpec
    numel: int  # elements this rank holds (its tp shard, then its dp shard under FSDP2)
    tp_numel: int  # elements of its tp shard (what FSDP2 gathers, what replicate all-reduces)
    padded_numel: int  # its FSDP2 shard padded to the dp split (what one all-gather sends per rank)


def is_expert(spec: ParamSpec) -> bool:
    """A routed expert's stacked weights or biases (dim 0: the experts, which expert parallelism splits)."""
    return ".experts_" in spec.name


def divided(spec: ParamSpec, layout: Layout) -> bool:
    """A routed expert's tensor divided over ep ranks: trainwise leaves it out of DDP, replicate and FSDP2, whole
    on each of its edp ranks, its gradient all-reduced over them (runtime.expert_parallel)."""
    return layout.ep > 1 and is_expert(spec)


def _local_shape(spec: ParamSpec, cfg: ModelConfig, layout: Layout, rank: int, megatron: bool) -> tuple[int, ...]:
    """The parameter's shape on one rank: its tp shard (`megatron`: learned positions whole, as Megatron-LM
    keeps them); key-value heads fewer than tp replicated, one per rank (Megatron-LM's placement;
    trainwise's trainer needs tp to divide them); routed experts / ep, and their width / etp (Layout.etp)."""
    if megatron and spec.name == "pos_embed.weight":
        return spec.shape
    tp_rank = layout.coords(rank)[2]
    if is_expert(spec):  # folded: etp innermost over the tp x cp x dp ranks
        shape = list(tp_shape(spec, layout.expert_tp, rank % (layout.tp * layout.cp * layout.dp) % layout.expert_tp))
    else:
        shape = list(tp_shape(spec, layout.tp, tp_rank))
    kv = spec.name.rsplit(".", 2)[-2] in ("k", "v") and ".qkv." in spec.name
    if kv and cfg.n_kv_heads < layout.tp:
        shape[0] = cfg.head_dim
    if is_expert(spec) and layout.ep > 1:
        shape[0] = -(-shape[0] // layout.ep)
    return tuple(shape)


def rank_params(cfg: ModelConfig, layout: Layout, rank: int, megatron: bool = False) -> list[RankParam]:
    """The parameters `rank` holds, with their local sizes, as trainwise places them or (`megatron`) as
    Megatron-LM does (cost.rank_memory says which layouts are priced so). FSDP2 shards each over the dp x cp
    ranks (a routed expert's over its edp ranks, Layout.expert_dp, as Megatron-LM does; trainwise keeps its
    divided experts whole: `divided`). With tied embeddings and pipeline stages
    the last stage holds its own copy of the table as the LM head (their gradients all-reduced between the
    two stages)."""
    pp_rank = layout.coords(rank)[1]
    specs = model_params(cfg)
    if cfg.tie_embeddings and layout.pp > 1:
        specs.append(ParamSpec(TIED_COPY, (cfg.vocab_size, cfg.d_model), 0, False, "last", "root"))
    out = []
    for spec in specs:
        if not on_rank(spec, cfg, layout, pp_rank):
            continue
        shape = _local_shape(spec, cfg, layout, rank, megatron)
        tp_numel = math.prod(shape)
        numel = padded = tp_numel
        if _fsdp(layout) and (megatron or not divided(spec, layout)):
            shards = layout.expert_dp if is_expert(spec) else layout.shard
            index = (rank % (layout.tp * layout.cp * layout.dp) // (layout.ep * layout.expert_tp) if is_expert(spec)
                     else rank // layout.tp % layout.shard)  # dp_rank x cp + cp_rank (in its HSDP shard group)
            rest = tp_numel // shape[0] if shape[0] else 0
            numel = chunk(shape[0], shards, index % shards) * rest
            padded = -(-shape[0] // shards) * rest
        out.append(RankParam(spec, numel, tp_numel, padded))
    return out


@dataclass(frozen=True)
class StepShape:
    """What one optimizer step of the run processes, and in which dtypes (bytes per element)."""

    micro_batch: int
    seq_len: int
    grad_accum: int  # K micro-batches per step
    compute_bytes: int  # matmul outputs (2 under bf16/fp16 autocast)
    residual_bytes: int  # the residual stream and norm outputs (4; FSDP2's bf16 policy: 2)
    param_bytes: int = 4  # parameters as FSDP2 gathers them (its mixed-precision param_dtype)
    recompute: bool = False  # full activation checkpointing: each block's forward runs again in backward
    attention_recompute: bool = False  # any activation checkpointing: the attention core runs again in backward
    loss_scaled: bool = False  # fp16's loss scaler: whether a gradient is inf or NaN, all-reduced over the world
    # ep: per global rank, its assignments to each expert in the step (all micro-batches and MoE layers, after any
    # capacity drop: runtime.expert_parallel.routed_tokens); None: uniform, micro_batch x seq_len x top_k / E each
    expert_tokens: tuple[tuple[int, ...], ...] | None = None


def _add(out: dict, kind: str, calls: int, nbytes: int, world: int) -> None:
    """Record `calls` collectives of `kind` over world ranks, each of an nbytes buffer S as cost.comm
    counts it (the gathered output of an all-gather, the input of a reduce-scatter, the reduced buffer of
    an all-reduce), and the whole bytes the rank sends: cost.comm.bytes_sent, rounded (a broadcast: its calls only)."""
    if calls <= 0 or world <= 1:
        return
    entry = out.setdefault(kind, {"calls": 0, "bytes": 0})
    entry["calls"] += calls
    entry["bytes"] += 0 if kind == "broadcast" else calls * round(bytes_sent(kind, nbytes, world))


def _p2p(out: dict, sends: int, receives: int, nbytes: int) -> None:
    entry = out.setdefault("send_recv", {"calls": 0, "bytes": 0})
    entry["calls"] += sends + receives
    entry["bytes"] += sends * round(bytes_sent("send_recv", nbytes, 2))


def _tp_micro_batch(out: dict, cfg: ModelConfig, layout: Layout, stages: list[int], shape: StepShape) -> None:
    """Tensor parallelism's collectives of one micro-batch on a rank holding `stages` (runtime.tensor_parallel):
    each block all-gathers its attention and MLP inputs (residual dtype) and reduce-scatters their outputs
    (compute dtype), backward the same swapped (and, under full checkpointing, the forward's again); the
    embedding reduce-scatters its output (backward: an all-gather); the head all-gathers its input and the
    logits (backward: a reduce-scatter of its input's gradient; the logits' gradient is cut locally)."""
    tp = layout.tp
    tokens = shape.micro_batch * shape.seq_len // layout.cp  # the cp rank's positions, T / (cp tp) on each tp rank
    s, c, H = shape.residual_bytes, shape.compute_bytes, cfg.d_model
    blocks = sum(len(stage_layers(cfg.n_layers, layout.stages, st)) for st in stages)
    forwards = 2 if shape.recompute else 1  # full checkpointing recomputes each block, collectives included
    _add(out, "all_gather", 2 * blocks * forwards, tokens * H * s, tp)
    _add(out, "reduce_scatter", 2 * blocks * forwards, tokens * H * c, tp)
    _add(out, "reduce_scatter", 2 * blocks, tokens * H * s, tp)
    _add(out, "all_gather", 2 * blocks, tokens * H * c, tp)
    if 0 in stages:
        _add(out, "reduce_scatter", 1, tokens * H * s, tp)
        _add(out, "all_gather", 1, tokens * H * s, tp)
        if cfg.position == "learned":
            _add(out, "reduce_scatter", 1, shape.seq_len // layout.cp * H * s, tp)
            _add(out, "all_gather", 1, shape.seq_len // layout.cp * H * s, tp)
    if layout.stages - 1 in stages:
        _add(out, "all_gather", 1, tokens * H * s, tp)
        _add(out, "all_gather", 1, tokens * -(-cfg.vocab_size // tp) * tp * c, tp)  # vocabulary padded to tp
        _add(out, "reduce_scatter", 1, tokens * H * s, tp)


def _cp_micro_batch(out: dict, cfg: ModelConfig, layout: Layout, stages: list[int], shape: StepShape) -> None:
    """Context parallelism's collectives of one micro-batch (runtime.context_parallel, the all-gather form:
    cost.layout's cp_impl "allgather"): per layer the keys and values of the rank's T/cp positions all-gathered
    over cp together, a (B, 2 nkv/tp, T, hd) buffer in the compute dtype (again in backward where activation
    checkpointing recomputes attention), their gradients reduce-scattered in backward; and the loss, one fp32
    scalar all-reduced over cp (each rank's mean -> the sequence's)."""
    blocks = sum(len(stage_layers(cfg.n_layers, layout.stages, st)) for st in stages)
    kv = shape.micro_batch * shape.seq_len * 2 * (cfg.n_kv_heads // layout.tp) * cfg.head_dim * shape.compute_bytes
    _add(out, "all_gather", blocks * (2 if shape.attention_recompute or shape.recompute else 1), kv, layout.cp)
    _add(out, "reduce_scatter", blocks, kv, layout.cp)
    if layout.stages - 1 in stages:
        _add(out, "all_reduce", 1, 4, layout.cp)


def _pp_micro_batch(out: dict, cfg: ModelConfig, layout: Layout, stages: list[int], shape: StepShape) -> None:
    """A micro-batch's pipeline transfers (runtime.pipeline): each stage but the last sends its output
    (the rank's T/tp positions, residual dtype) and receives its gradient; each but the first receives
    its input and sends the input's gradient. send_recv counts both directions' calls, the sends' bytes."""
    act = shape.micro_batch * shape.seq_len // layout.tp * cfg.d_model * shape.residual_bytes
    for st in stages:
        # each link to a stage on another rank: one send and one receive (a V's middle stages share a rank)
        links = sum(0 <= n < layout.stages and n not in stages for n in (st - 1, st + 1))
        _p2p(out, links, links, act)


def expert_group(layout: Layout, rank: int) -> tuple[list[int], int]:
    """The ep group of `rank` (global ranks, in ep order) and its index in it: ep ranks etp apart among the
    tp x cp x dp ranks of its pipeline stage (cost.layout.placement's folding, etp innermost)."""
    inner = layout.tp * layout.cp * layout.dp
    stage, i = rank - rank % inner, rank % inner
    ep_rank = i // layout.expert_tp % layout.ep
    base = stage + i - ep_rank * layout.expert_tp
    return [base + j * layout.expert_tp for j in range(layout.ep)], ep_rank


def _ep_exchanges(out: dict, cfg: ModelConfig, layout: Layout, rank: int, stages: list[int],
                  shape: StepShape) -> None:
    """Expert parallelism's all-to-alls in a step (runtime.expert_parallel). Per MoE layer and micro-batch the
    forward exchanges the (E,) int64 counts (E/ep to each other rank), dispatches the assignments routed to
    other ranks' experts (d_model wide, compute dtype) and combines the outputs of those it received; backward
    sends their two gradients the other way; full checkpointing runs the forward's three again. Bytes are what
    leaves the rank: the rows it sends (its assignments to experts it does not hold) and the rows it received
    (the group's assignments to its experts), each once in the forward and once in the backward."""
    layers = [i for st in stages for i in stage_layers(cfg.n_layers, layout.stages, st) if cfg.is_moe_layer(i)]
    if layout.ep <= 1 or not layers:
        return
    (group, ep_rank), local = expert_group(layout, rank), cfg.n_experts // layout.ep
    mine, tokens = range(ep_rank * local, (ep_rank + 1) * local), shape.expert_tokens
    if tokens is None:  # uniform: each rank routes the same share to every expert
        each = len(layers) * shape.grad_accum * shape.micro_batch * shape.seq_len * cfg.top_k / cfg.n_experts
        tokens = {r: [each] * cfg.n_experts for r in group}
    sent = sum(c for e, c in enumerate(tokens[rank]) if e not in mine)
    received = sum(tokens[r][e] for r in group if r != rank for e in mine)
    forwards = 2 if shape.recompute else 1
    exchanges = len(layers) * shape.grad_accum
    entry = out.setdefault("all_to_all", {"calls": 0, "bytes": 0})
    entry["calls"] += exchanges * (3 * forwards + 2)
    entry["bytes"] += round((forwards + 1) * (sent + received) * cfg.d_model * shape.compute_bytes
                            + exchanges * forwards * (layout.ep - 1) * local * 8)


def units(cfg: ModelConfig, layout: Layout, rank: int, megatron: bool = False, params: list | None = None) -> dict:
    """The FSDP2 / replicate units `rank` holds ({unit: [RankParam]}): each block, and each stage module's
    own parameters (embedding; final norm and head); trainwise's divided experts are in none (`divided`).
    `params`: the rank's rank_params, where the caller has them."""
    units: dict = {}
    for p in params if params is not None else rank_params(cfg, layout, rank, megatron):
        if not megatron and divided(p.spec, layout):
            continue
        key = p.spec.unit if p.spec.unit != "root" else f"root-{p.spec.where}" if layout.pp > 1 else "root"
        units.setdefault(key, []).append(p)
    return units


def _unit_chunk(unit, cfg: ModelConfig, layout: Layout) -> int:
    """The local stage (index into rank_stages) that runs a unit: a block's stage, or the first or last."""
    if unit == "root" or layout.pp == 1:
        return 0
    if unit in ("root-first", "root-last"):
        stage = 0 if unit == "root-first" else layout.stages - 1
    else:
        stage = next(s for s in range(layout.stages) if unit in stage_layers(cfg.n_layers, layout.stages, s))
    return stage // layout.pp


def _fsdp_gathers(ops: list[tuple[str, int]], chunk: int, reshard_after_forward: bool, pipelined: bool) -> int:
    """All-gathers of one FSDP2 unit in a step: before each forward or backward that finds it sharded. It is
    sharded again after a forward when reshard_after_forward (fsdp), and after a backward unless the pipeline
    keeps it gathered until the step's last one (PipelineStage sets reshard_after_backward False until then);
    without a pipeline every backward reshards."""
    gathered, calls = False, 0
    for kind, c in ops:
        if c != chunk:
            continue
        if not gathered:
            calls += 1
            gathered = True
        if kind == "F" and reshard_after_forward or kind == "B" and not pipelined:
            gathered = False
    return calls


def _data_parallel(out: dict, cfg: ModelConfig, layout: Layout, rank: int, shape: StepShape) -> None:
    """The dp dimension's collectives of one step (runtime.distributed.wrap): FSDP2 all-gathers each
    unit's shards (fsdp: before forward and again before backward, per micro-batch; zero2: once per
    micro-batch) and reduce-scatters its fp32 gradients on the last micro-batch (on every one with
    Layout.fsdp_grad_sync "micro-batch"); replicate all-reduces each unit's gradients once; DDP all-reduces its
    buckets once, then the map of the parameters each rank used, and zero1 broadcasts each updated tensor. Divided
    experts (ep > 1) are neither DDP's nor replicate's or FSDP2's: their gradients, flattened, are all-reduced once
    over the edp ranks that hold the same experts."""
    dp, K = layout.dp * layout.cp, shape.grad_accum  # the cp ranks hold the same parameters: they reduce too
    if dp <= 1 or layout.strategy == "none":
        return
    shard = layout.shard  # HSDP (Layout.dp_shard): gathered and reduce-scattered in it, then all-reduced over replicas
    by_unit = units(cfg, layout, rank)
    if layout.strategy in ("zero2", "fsdp"):
        ops = schedule_ops(layout, layout.coords(rank)[1], K)
        reduces = K if layout.reduces_each_micro_batch else 1
        for unit, params in by_unit.items():
            padded = sum(p.padded_numel for p in params)
            gathers = _fsdp_gathers(ops, _unit_chunk(unit, cfg, layout), layout.strategy == "fsdp", layout.pp > 1)
            _add(out, "all_gather", gathers, shard * padded * shape.param_bytes, shard)
            _add(out, "reduce_scatter", reduces, shard * padded * 4, shard)
            if layout.replicas > 1:
                _add(out, "all_reduce", reduces, padded * 4, layout.replicas)
    params = rank_params(cfg, layout, rank)
    if layout.ep > 1:  # runtime.expert_parallel: the experts outside DDP, replicate or FSDP2, reduced over edp
        _add(out, "all_reduce", 1, 4 * sum(p.tp_numel for p in params if is_expert(p.spec)), layout.expert_dp)
    if layout.strategy in ("zero2", "fsdp"):
        return
    if layout.model_parallel > 1:  # ddp on a mesh: FSDP2's replicate
        for unit in by_unit.values():
            _add(out, "all_reduce", 1, sum(p.tp_numel for p in unit) * 4, dp)
    else:  # DDP (ddp, zero1)
        held = _ddp_tensors(params, layout)
        for bucket in ddp_buckets(held):
            _add(out, "all_reduce", 1, bucket, dp)
        # find_unused_parameters (runtime.distributed.wrap): which of its tensors each rank used, an int32 each
        _add(out, "all_reduce", 1, 4 * len(held), dp)
        _add(out, "broadcast", len(held) if layout.strategy == "zero1" else 0, 0, dp)


def _ddp_tensors(params: list, layout: Layout) -> list[int]:
    """The fp32 gradient bytes of each tensor DDP holds, in the model's order. runtime.distributed.wrap splits the
    fused projections under ep > 1 (runtime.fused) and leaves them whole otherwise: attention's q, k and v one
    tensor, a gated MLP's gate and up one."""
    sizes: dict[str, int] = {}
    for p in params:
        if not divided(p.spec, layout):
            parts = p.spec.name.split(".")
            fused = len(parts) >= 3 and (parts[-3] == "qkv" and parts[-2] in ("q", "k", "v")
                                         or parts[-3] in ("fc", "experts_fc") and parts[-2] in ("gate", "up"))
            name = ".".join(parts[:-2] + parts[-1:] if fused and layout.ep == 1 else parts)
            sizes[name] = sizes.get(name, 0) + 4 * p.tp_numel
    return list(sizes.values())


def rank_comm(cfg: ModelConfig, layout: Layout, rank: int, shape: StepShape) -> dict[str, dict[str, int]]:
    """What `rank` sends in one training step, per collective type: {"all_gather": {"calls", "bytes"}, ...}
    (bytes as bytes_sent counts them; an all-to-all's: what leaves the rank). The sum of the tensor-parallel,
    pipeline, expert-parallel and data-parallel collectives above and the step's small all-reduces:
      partial gradients   one all-reduce per replicated weight with a partial gradient (norms, q/k norms,
                          the MoE router and row-parallel MoE biases) when tp > 1, over tp, in fp32 (the
                          weight's, or under FSDP2's mixed precision its reduce dtype: measured, bf16 too);
      gradient norm       one fp32 scalar over the world when the model is divided (DTensor, stages or experts);
      loss                one fp32 scalar over pp (the pipeline's losses, summed to every stage); with cp > 1
                          one per micro-batch over cp (_cp_micro_batch);
      tied embedding      with tied embeddings and pp > 1, on the first and the last stage: one all-reduce of
                          the rank's share of the table's fp32 gradient with its copy on the other end
                          (runtime.pipeline.TiedEmbedding: 2 ranks, after the step's backward; none under
                          a V schedule, whose rank 0 holds both and sums them);
      MoE load            one all-reduce of the choice-biased layers' expert loads (fp32, E each) over dp;
      loss scaler         under fp16, one fp32 flag over the world: any rank's inf or NaN gradient (the
                          scaler's unscale_, runtime.step.loss_scaler)."""
    out: dict = {}
    dp_rank, pp_rank, tp_rank = layout.coords(rank)
    stages = rank_stages(layout, pp_rank) if layout.pp > 1 else [0]
    for _ in range(shape.grad_accum):
        if layout.tp > 1:
            _tp_micro_batch(out, cfg, layout, stages, shape)
        if layout.pp > 1:
            _pp_micro_batch(out, cfg, layout, stages, shape)
        if layout.cp > 1:
            _cp_micro_batch(out, cfg, layout, stages, shape)
    _ep_exchanges(out, cfg, layout, rank, stages, shape)
    _data_parallel(out, cfg, layout, rank, shape)
    params = rank_params(cfg, layout, rank)
    if layout.tp > 1:
        for p in params:
            if p.spec.partial:  # fp32: autocast's weight, or FSDP2's and replicate's reduce dtype
                _add(out, "all_reduce", 1, 4 * p.tp_numel, layout.tp)
    if layout.model_parallel > 1 or layout.ep > 1 or _fsdp(layout):  # DTensors or stages: runtime.distributed
        _add(out, "all_reduce", 1, 4, layout.gpus)  # .clip_grad_norm's one scalar
    if layout.pp > 1:
        _add(out, "all_reduce", 1, 4, layout.pp)
        for p in params:  # a V holds both ends on one rank: their gradients are summed there
            if cfg.tie_embeddings and p.spec.name in ("embed.weight", TIED_COPY) and not v_shape(layout):
                _add(out, "all_reduce", 1, 4 * p.numel, 2)
    biased = [p for p in params if p.spec.name.endswith("router.weight")] if cfg.router_bias else []
    if biased:
        _add(out, "all_reduce", 1, 4 * cfg.n_experts * len(biased), layout.dp)
    if shape.loss_scaled:
        _add(out, "all_reduce", 1, 4, layout.gpus)
    return {kind: out[kind] for kind in sorted(out)}
