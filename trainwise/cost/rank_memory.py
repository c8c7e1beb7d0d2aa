"""The per-rank memory model: the peak of one training step on one rank of any layout trainwise trains
(one process; DDP, ZeRO-1, FSDP2's zero2 and fsdp; tensor and pipeline parallelism and their mixes), from
trainwise.cost.rank's parameters, gradients and optimizer states and the activations of the micro-batches
the pipeline schedule holds at once. The memory check before step 1, the plan of a run and verify's
per-rank comparison all read `rank_peak`.

cost.memory's bytes per token (read off the tensors autograd saves) are divided by tp where sequence
parallelism splits the positions or tensor parallelism the heads and widths, and kept whole where every
rank holds all positions (the gathered inputs of column-parallel projections, the gathered logits, a MoE
layer's routing); pipeline schedules decide how many micro-batches a stage holds at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from trainwise.config import ModelConfig
from trainwise.cost import memory as M
from trainwise.cost.layout import Layout, rank_stages, stage_layers
from trainwise.cost.rank import rank_params, schedule_ops, units
from trainwise.cost.run import Run


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
                           holds_output: bool = False, compiled: bool = False) -> int:
    """Bytes one micro-batch leaves saved on one rank for a pipeline stage of `layers` (the whole model when
    first and last): the blocks (tp_bytes_per_token; compiled: cost.memory.compiled_block_bytes_per_token);
    token ids (first) and targets (last), int64; on the last stage the final norm (on T/tp positions), the LM
    head's gathered input cH and the loss's fp32 log-softmax 4V (all T, full vocabulary: the logits are
    gathered; compiled, the fused loss saves the logits cV and a logsumexp instead); under tensor
    parallelism the embedding's masked ids and mask (int64 + bool, all T); a pipeline stage keeps its output
    until the gradient comes back (`holds_output`: sH on T/tp positions, or the last stage's logits, cV,
    gathered); under autocast the bf16 copies of the stage's matmul weights (their 1/tp)."""
    tokens, H, c, s = micro_batch * seq_len, cfg.d_model, recipe.compute_bytes, recipe.residual_bytes
    if compiled and checkpointing != "full":
        per_token = sum(M.compiled_block_bytes_per_token(cfg, recipe, i, seq_len, checkpointing) for i in layers)
    else:
        per_token = sum(tp_bytes_per_token(cfg, recipe, i, tp, checkpointing) for i in layers)
    if first:
        per_token += 8 + (9 if tp > 1 else 0)
    if last:
        loss = c * cfg.vocab_size + 4 if compiled and not cfg.loss_chunk_tokens else M.loss_saved_bytes_per_token(cfg)
        per_token += 8 + M.norm_saved_bytes(cfg, s) / tp + c * H + loss
    if holds_output:
        per_token += c * cfg.vocab_size if last else s * H / tp
    weights = 0
    if c != s:
        blocks = 0 if checkpointing == "full" else sum(M.matmul_weight_params(cfg, i) for i in layers)
        weights = c * (blocks + (cfg.vocab_size * cfg.d_model if last else 0)) / tp
    return math.ceil(tokens * per_token + weights)


@dataclass(frozen=True)
class RankPeak:
    """One rank's bytes in one training step: its states at rest and the step's two high points."""

    params: int
    grads: int
    optimizer: int  # the moments and, where the recipe keeps one, the master copy
    activations: int  # saved for backward at the backward high point (every micro-batch then in flight)
    backward: int  # the high point of backward
    step: int  # the high point of the optimizer step

    @property
    def peak(self) -> int:
        return max(self.backward, self.step)


def rank_peak(run: Run, rank: int = 0, optimizer_share: float | None = None) -> RankPeak:
    """The peak of one training step on `rank` (RankPeak.peak), the larger of two high points:
      backward: parameters + optimizer states + the pipeline's receive buffers (activations and gradients,
        one per micro-batch and link, kept from step to step) + the cross-entropy's backward scratch on the
        last stage (two fp32 B T V buffers, whole on every tp rank; compiled: one fused kernel, see
        cost.memory.compiled_loss_backward_bytes) or, under full checkpointing, one recomputed block's
        activations + under FSDP2 the gathered parameters in the compute dtype (zero2: all of the rank's,
        kept from forward to backward; fsdp: the stage roots and two blocks) + the most, over the backwards
        of the schedule (cost.rank.schedule_ops), of the activations of the micro-batches in flight and the
        gradients, which exist once a backward of the step has run: the rank's gradients, DDP's buckets
        (which hold them all run long, plus under no_sync the micro-batches' own .grad tensors), or FSDP2's
        unsharded fp32 gradients of the micro-batches before the last;
      optimizer step: parameters + gradients + states + one moment of scratch (a foreach AdamW's sqrt(v)).
    States: fp32 parameters and gradients of the rank's shards (cost.rank.rank_params) and the recipe's
    optimizer moments; ZeRO-1 (ZeroRedundancyOptimizer) keeps `optimizer_share` of them (default 1/dp).
    FSDP2 runs the forward on gathered compute-dtype weights and inputs: residual stream in the compute
    dtype, no autocast weight copies, and is compiled per block (planned eager)."""
    cfg, lay, recipe, K = run.model, run.layout, run.recipe, run.grad_accum
    strategy = lay.strategy
    fsdp, ddp = strategy in ("zero2", "fsdp"), strategy in ("ddp", "zero1")
    params = rank_params(cfg, lay, rank)
    numel = sum(p.numel for p in params)
    moments = M.optimizer_moments(run.optimizer)
    full = M.state_bytes(numel, recipe, run.optimizer)
    share = optimizer_share if optimizer_share is not None else 1 / lay.dp if strategy == "zero1" else 1
    optimizer = math.ceil(full.optimizer * share) + math.ceil(full.master * share)
    scratch_step = math.ceil(full.optimizer * share) // moments if moments >= 2 else 0
    acts_recipe = replace(recipe, residual_bytes=recipe.compute_bytes) if fsdp else recipe
    compiled = run.compiled and lay.model_parallel == 1 and not fsdp
    pp_rank = lay.coords(rank)[1]
    stages = rank_stages(lay, pp_rank) if lay.pp > 1 else [0]
    per_stage = [stage_activation_bytes(cfg, acts_recipe, run.micro_batch, run.seq_len,
                                        stage_layers(cfg.n_layers, lay.stages, st), st == 0, st == lay.stages - 1,
                                        lay.tp, run.checkpointing, holds_output=lay.pp > 1, compiled=compiled)
                 for st in stages]
    tokens = run.tokens_per_micro_batch
    scratch = 0
    if lay.stages - 1 in stages:
        scratch = M.loss_backward_bytes(cfg, acts_recipe, tokens)
        if compiled and not cfg.loss_chunk_tokens:
            scratch = M.compiled_loss_backward_bytes(cfg, acts_recipe, tokens, run.checkpointing)
    if run.checkpointing == "full":
        scratch = max(scratch, math.ceil(M.recompute_bytes(cfg, acts_recipe, tokens) / lay.tp))
    gathered = accumulated = 0
    if fsdp:
        sizes = {unit: sum(p.tp_numel for p in ps) for unit, ps in units(cfg, lay, rank).items()}
        roots = sum(n for unit, n in sizes.items() if str(unit).startswith("root"))
        blocks = sorted((n for unit, n in sizes.items() if not str(unit).startswith("root")), reverse=True)
        kept = sum(sizes.values()) if strategy == "zero2" else roots + sum(blocks[:2])
        gathered = recipe.compute_bytes * kept
        accumulated = 4 * sum(sizes.values()) if K > 1 else 0
    grads = 4 * numel
    # what holds gradients in backward, once a backward of the step has run (DDP's buckets: from the start)
    held = (grads if lay.pp > 1 else 0) + accumulated if fsdp else grads
    no_sync = grads if ddp and K > 1 else 0
    flights = [sum(per_stage[c] for c in live) for live in in_flight(lay, pp_rank, K)]
    held_from = 0 if ddp else 1  # the first backward finds no gradients (zero_grad sets them to None)
    in_flight_high = max(f + (held if i >= held_from else 0) for i, f in enumerate(flights))
    buffers = 0
    if lay.pp > 1:
        act = tokens // lay.tp * cfg.d_model * acts_recipe.residual_bytes
        buffers = sum(K * act * ((st > 0) + (st < lay.stages - 1)) for st in stages)
    resident = 4 * numel + optimizer + buffers
    backward = resident + in_flight_high + scratch + gathered + no_sync
    step = resident + grads + scratch_step
    return RankPeak(4 * numel, grads, optimizer, max(flights), backward, step)


def in_flight(layout: Layout, pp_rank: int, micro_batches: int) -> list[list[int]]:
    """The micro-batches in flight on a pipeline rank at each backward of its schedule (the one being run
    included), as the local stage index of each, replaying cost.rank.schedule_ops: GPipe holds all K at
    its first backward, 1F1B min(K, pp - rank), interleaved 1F1B its warm-up forwards and one more."""
    live, out = [], []
    for kind, chunk in schedule_ops(layout, pp_rank, micro_batches):
        if kind == "F":
            live.append(chunk)
        else:
            out.append(list(live))
            live.remove(chunk)
    return out


def highest_peak(run: Run) -> tuple[int, RankPeak] | None:
    """The rank whose step peaks highest and its RankPeak, one rank per pipeline stage compared (the ranks
    of a stage hold alike), for a layout trainwise trains: fp32 or autocast over fp32 weights, sequence
    parallel with tp, flash attention, no context or expert parallelism. None for any other layout."""
    lay = run.layout
    if (run.recipe.name not in ("fp32", "amp") or lay.cp > 1 or lay.ep > 1 or lay.attention_impl != "flash"
            or lay.tp > 1 and not lay.sequence_parallel):
        return None
    stride = lay.gpus // lay.pp
    return max(((r, rank_peak(run, r)) for r in range(0, lay.gpus, stride)), key=lambda item: item[1].peak)
