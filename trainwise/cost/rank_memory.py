"""Per rank of a tensor- and/or pipeline-parallel run: activations of the micro-batches in flight and the
step's peak, on top of trainwise.cost.rank's parameters, gradients and optimizer states.

cost.memory's bytes per token (read off the tensors autograd saves) are divided by tp where sequence
parallelism splits the positions or tensor parallelism the heads and widths, and kept whole where every
rank holds all positions (the gathered inputs of column-parallel projections, the gathered logits, a MoE
layer's routing); pipeline schedules decide how many micro-batches a stage holds at once.
"""

from __future__ import annotations

import math
from dataclasses import replace

from trainwise.config import ModelConfig
from trainwise.cost import memory as M
from trainwise.cost.layout import Layout
from trainwise.cost.rank import rank_stages, rank_state_bytes, schedule_ops, stage_layers, units


def tp_bytes_per_token(cfg: ModelConfig, recipe: M.Recipe, layer: int, tp: int, checkpointing: str = "none") -> float:
    """Bytes one of tp ranks saves for backward per token of the sequence in one block (Korthikanti et al.
    2022 with sequence parallelism, as trainwise runs it): what cost.memory.activation_bytes_per_token_layer
    counts, divided by tp (the norms and dropout masks on the rank's T/tp positions; q, k, v, attention and
    the MLP width on its heads and its F/tp), except what every rank holds for all T positions: the
    all-gathered inputs of the column-parallel projections (attention's and the MLP's, cH each), and in a
    MoE layer the router, the routing and the dispatch buffers (every rank routes every token), and the
    shared experts' input cast. Full checkpointing keeps each block's input: sH / tp."""
    c, s, H = recipe.compute_bytes, recipe.residual_bytes, cfg.d_model
    if checkpointing == "full":
        return s * H / tp
    whole = M.activation_bytes_per_token_layer(cfg, recipe, layer, checkpointing)
    if tp == 1:
        return whole
    if cfg.is_moe_layer(layer):
        replicated = c * H + M.moe_saved_bytes(cfg, recipe, 0)
        if cfg.n_shared_experts and not (c == 4 and s == 4):
            replicated += c * H
    else:
        replicated = 2 * c * H
    return (whole - replicated) / tp + replicated


def stage_activation_bytes(cfg: ModelConfig, recipe: M.Recipe, micro_batch: int, seq_len: int, layers: range,
                           first: bool, last: bool, tp: int = 1, checkpointing: str = "none",
                           holds_output: bool = False) -> int:
    """Bytes one micro-batch leaves saved on one rank for a pipeline stage of `layers` (the whole model when
    first and last): the blocks (tp_bytes_per_token); token ids (first) and targets (last), int64; on the
    last stage the final norm (on T/tp positions), the LM head's gathered input cH and the loss's fp32
    log-softmax 4V (all T, full vocabulary: the logits are gathered); under tensor parallelism the
    embedding's masked ids and mask (int64 + bool, all T); a pipeline stage keeps its output until the
    gradient comes back (`holds_output`: sH on T/tp positions, or the last stage's logits, cV, gathered);
    under autocast the bf16 copies of the stage's matmul weights (their 1/tp)."""
    tokens, H, c, s = micro_batch * seq_len, cfg.d_model, recipe.compute_bytes, recipe.residual_bytes
    per_token = sum(tp_bytes_per_token(cfg, recipe, i, tp, checkpointing) for i in layers)
    if first:
        per_token += 8 + (9 if tp > 1 else 0)
    if last:
        per_token += 8 + M.norm_saved_bytes(cfg, s) / tp + c * H + M.loss_saved_bytes_per_token(cfg)
    if holds_output:
        per_token += c * cfg.vocab_size if last else s * H / tp
    weights = 0
    if c != s:
        blocks = 0 if checkpointing == "full" else sum(M.matmul_weight_params(cfg, i) for i in layers)
        weights = c * (blocks + (cfg.vocab_size * cfg.d_model if last else 0)) / tp
    return math.ceil(tokens * per_token + weights)


def in_flight(layout: Layout, pp_rank: int, micro_batches: int) -> list[list[int]]:
    """The micro-batches whose activations a pipeline rank holds at once at its high point, as lists of
    local stage indices (one entry per micro-batch in flight), replaying cost.rank.schedule_ops: GPipe
    holds all K, 1F1B min(K, pp - rank), interleaved 1F1B its warm-up forwards and one more."""
    if layout.pp == 1:
        return [[0]]
    live, best = [], []
    for kind, chunk in schedule_ops(layout, pp_rank, micro_batches):
        if kind == "F":
            live.append(chunk)
            if len(live) > len(best):
                best = list(live)
        else:
            live.remove(chunk)
    return [[chunk] for chunk in best]


def rank_peak_bytes(cfg: ModelConfig, layout: Layout, rank: int, recipe: M.Recipe, optimizer: str,
                    micro_batch: int, seq_len: int, grad_accum: int, checkpointing: str = "none") -> int:
    """Peak bytes of one training step on a rank of a tensor- and/or pipeline-parallel run (tp or pp > 1),
    as cost.memory.peak_bytes composes it: the larger of
      backward: parameters + optimizer states + the activations of the micro-batches in flight (in_flight x
        stage_activation_bytes) + the cross-entropy's backward scratch on the last stage (two fp32 B T V
        buffers: the logits are whole on every tp rank) or one recomputed block's activations + the
        gradients (which exist from the first backward on when micro-batches accumulate) + under FSDP2
        the gathered parameters (zero2 all of the rank's, fsdp its stage roots and two blocks) and, with
        K > 1, the unsharded fp32 gradients of the micro-batches before the last;
      optimizer step: parameters + gradients + states + one moment of scratch;
    both beside the pipeline's receive buffers (activations and gradients, one per micro-batch and link)."""
    dp_rank, pp_rank, tp_rank = layout.coords(rank)
    moments = M.optimizer_moments(optimizer)
    states = rank_state_bytes(cfg, layout, rank, moments)
    fsdp = layout.dp > 1 and layout.strategy in ("zero2", "fsdp")
    acts_recipe = replace(recipe, residual_bytes=recipe.compute_bytes) if fsdp else recipe
    stages = rank_stages(layout, pp_rank) if layout.pp > 1 else [0]
    tokens = micro_batch * seq_len
    per_stage = [stage_activation_bytes(cfg, acts_recipe, micro_batch, seq_len,
                                        stage_layers(cfg.n_layers, layout.stages, st), st == 0, st == layout.stages - 1,
                                        layout.tp, checkpointing, holds_output=layout.pp > 1)
                 for st in stages]
    acts = sum(per_stage[chunk] for flight in in_flight(layout, pp_rank, grad_accum) for chunk in flight)
    scratch = M.loss_backward_bytes(cfg, acts_recipe, tokens) if layout.stages - 1 in stages else 0
    if checkpointing == "full":
        scratch = max(scratch, math.ceil(M.recompute_bytes(cfg, acts_recipe, tokens) / layout.tp))
    # micro-batches accumulate into the rank's gradients, which then exist all through backward; FSDP2 without
    # a pipeline accumulates them unsharded (`accumulated`) and makes each unit's shard as it reduce-scatters it
    grads = states["grads"] if layout.pp > 1 or grad_accum > 1 and not fsdp else 0
    gathered = accumulated = 0
    if fsdp:
        by_unit = units(cfg, layout, rank)
        sizes = {unit: sum(p.tp_numel for p in params) for unit, params in by_unit.items()}
        roots = sum(n for unit, n in sizes.items() if str(unit).startswith("root"))
        blocks = sorted((n for unit, n in sizes.items() if not str(unit).startswith("root")), reverse=True)
        kept = sum(sizes.values()) if layout.strategy == "zero2" else roots + sum(blocks[:2])
        gathered = recipe.compute_bytes * kept
        accumulated = 4 * sum(sizes.values()) if grad_accum > 1 else 0
    buffers = 0  # PipelineStage's receive buffers, one per micro-batch and link, kept from step to step
    if layout.pp > 1:
        act = micro_batch * seq_len // layout.tp * cfg.d_model * acts_recipe.residual_bytes
        buffers = sum(grad_accum * act * ((st > 0) + (st < layout.stages - 1)) for st in stages)
    resident = states["params"] + states["optimizer"] + buffers
    backward = resident + acts + scratch + grads + gathered + accumulated
    step = resident + states["grads"] + (states["optimizer"] // moments if moments >= 2 else 0)
    return max(backward, step)
