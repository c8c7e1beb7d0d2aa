"""The per-rank memory model: the peak of one training step on one rank of any layout, from trainwise.cost.rank's
parameters, gradients and optimizer states and the activations of the micro-batches the pipeline schedule holds at
once. The memory check before step 1, the plan of a run and verify's per-rank comparison all read `rank_peak`.

A layout trainwise trains (one process; DDP, ZeRO-1, FSDP2's zero2 and fsdp; tensor and pipeline parallelism and
their mixes; expert parallelism over DDP's ranks; in fp32 or autocast) is priced as its trainer runs it, and so is
context parallelism as trainwise trains it (all-gather attention). Any other (context parallelism of other forms,
expert parallelism beside tp, Megatron's precision recipes, unfused attention, tensor parallelism without sequence
parallelism) is priced as Megatron-Core runs it, the stack of the cluster planner's development sets: sequence
parallelism saves each rank's shard of the column-parallel inputs and gathers it again in backward, the
cross-entropy is vocabulary-parallel, ZeRO shards over dp x cp (experts over dp x cp / ep).

cost.memory's bytes per token (read off the tensors autograd saves) are divided by tp where sequence parallelism
splits the positions or tensor parallelism the heads and widths, and kept whole where every rank holds all
positions; each rank holds T / cp of the positions; pipeline schedules decide how many micro-batches a stage holds
at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from trainwise.config import ModelConfig
from trainwise.cost import loss as L
from trainwise.cost import memory as M
from trainwise.cost.layout import ZERO_BUBBLE, Layout
from trainwise.cost.rank import divided, is_expert, rank_params, units
from trainwise.cost.recipe import Recipe, optimizer_moments
from trainwise.cost.run import Run, fsdp_grad_sync, routed_imbalance, trains
from trainwise.cost.schedule import awaiting_weights, in_flight, rank_stages, stage_layers


def layer_bytes_per_token(cfg: ModelConfig, recipe: Recipe, layer: int, layout: Layout, seq_len: int,
                          checkpointing: str = "none", regather: bool = False) -> float:
    """Bytes one tensor-parallel rank saves for backward per token of the sequence in one block: what
    cost.memory.activation_bytes_per_token_layer counts, split as Korthikanti et al. 2022 (section 4,
    Table 2) split it. Divided by tp: q, k, v, attention and the MLP width (each rank's heads and F/tp);
    with sequence parallelism also the norms, dropout masks and residual (each rank's T/tp positions).
    Whole on every rank: without sequence parallelism the norms' inputs, the inputs of the column-parallel
    projections and the dropout masks (their "10 sbh"); with it the all-gathered inputs of the
    column-parallel projections (2cH; a MoE layer's cH), unless backward gathers them again (`regather`,
    Megatron-LM's sequence parallelism, whose blocks keep less: cost.memory.megatron_lean_bytes); in
    a MoE layer the router, the routing and the dispatch buffers and the shared experts' input cast (every rank
    routes every token). Unfused attention saves the softmax output c x heads x T per token, and with attention
    dropout its mask (1 byte) and output, instead of flash attention's logsumexp (their 5as^2b term); selective
    recompute keeps none of them. Full checkpointing keeps each block's input: sH, / tp with sequence
    parallelism. FP8: cost.memory.fp8_saved_delta."""
    c, s, H, t = recipe.compute_bytes, recipe.residual_bytes, cfg.d_model, layout.tp
    sp = layout.sequence_parallel or t == 1
    if checkpointing == "full":
        return s * H / (t if sp else 1)
    if checkpointing == "op":  # the block's input (/ tp with sequence parallelism); the down projection's
        # output, a row-parallel matmul's partial sums on every position; the rest each rank's heads and width,
        # and with sequence parallelism the two reduce-scatters' outputs, kept too
        down = c * H if cfg.gated else 0
        rest = M.op_saved_bytes(cfg, recipe) - s * H - down
        return s * H / (t if sp else 1) + down + (rest + (2 * c * H if t > 1 and sp else 0)) / t
    norms, lean, act = M.megatron_lean_bytes(cfg, recipe, layer) if regather else (0, 0, 0)
    total = M.activation_bytes_per_token_layer(cfg, recipe, layer, checkpointing) - norms - lean - act
    if layout.attention_impl == "unfused" and checkpointing != "selective":
        total += cfg.n_heads * seq_len * (c + (1 + c if cfg.dropout > 0 else 0)) - 4 * cfg.n_heads
    if t == 1:
        return total
    moe, e = cfg.is_moe_layer(layer), M.gemm_input_bytes(recipe)  # e: a projection's kept input (FP8: its cast)
    shared = e * H if moe and cfg.n_shared_experts and not (c == 4 and s == 4) else 0
    folded = layout.folds_experts(regather)  # each rank routes its own T / tp positions: all / tp
    routed = M.moe_saved_bytes(cfg, recipe, 0) - cfg.top_k * (c - e) * H + shared - lean if moe and not folded else 0
    gathered = e * H * (1 if moe else 2)
    if not sp:
        whole = 2 * M.norm_saved_bytes(cfg, s) - norms + gathered + routed + (2 * H if cfg.dropout > 0 else 0)
    else:
        whole = routed + (0 if regather else gathered)
    return whole + (total - whole) / t


def stage_activation_bytes(run: Run, layers: range, first: bool, last: bool, recipe: Recipe, compiled: bool,
                           megatron: bool) -> int:
    """Bytes one micro-batch leaves saved on one rank for a pipeline stage of `layers` (the whole model when first and
    last), on its T / cp positions: the blocks (layer_bytes_per_token; compiled:
    cost.memory.compiled_block_bytes_per_token); token ids (first) and targets (last), int64; on the last stage the
    final norm, the LM head's input cH and the loss's fp32 log-softmax 4V (trainwise gathers the logits: whole on
    every tp rank; compiled or another stack's kernel (Run.loss_kernel) as cost.loss.loss_saved_bytes_per_token
    says; `megatron`: the head's input as each rank's shard and a vocabulary-parallel loss, 1/tp each); under tensor
    parallelism the embedding's masked ids and mask (int64 + bool); a pipeline stage of torch.distributed.pipelining
    keeps its output until the gradient comes back (sH, or the last stage's logits cV; Megatron-LM frees the
    output's data once sent); under autocast the compute-dtype copies of the stage's matmul weights (their 1/tp).
    Under expert parallelism the experts of the most loaded rank keep what the routed copies beyond the mean save
    (cost.run.routed_imbalance x cost.memory.expert_saved_bytes: the grouped input whole on each tp rank, 1/tp where
    Megatron-Core folds the experts, the MLP 1/tp)."""
    cfg, lay, ckpt = run.model, run.layout, run.checkpointing
    tokens, H, c, s, tp = run.tokens_per_micro_batch / lay.cp, cfg.d_model, recipe.compute_bytes, \
        recipe.residual_bytes, lay.tp
    seq = tp if lay.sequence_parallel or tp == 1 else 1  # what splits the residual stream's positions
    if compiled and ckpt not in ("full", "op"):
        per_token = sum(M.compiled_block_bytes_per_token(cfg, recipe, i, run.seq_len, ckpt) for i in layers)
    else:
        per_token = sum(layer_bytes_per_token(cfg, recipe, i, lay, run.seq_len, ckpt, megatron) for i in layers)
    if lay.ep > 1 and ckpt not in ("full", "op"):
        grouped, mlp = M.expert_saved_bytes(cfg, recipe, megatron)
        folded = lay.folds_experts(megatron)
        extra = cfg.top_k * (grouped / (tp if folded else 1) + mlp / tp) * sum(cfg.is_moe_layer(i) for i in layers)
        per_token += (routed_imbalance(cfg, run.moe_imbalance) - 1) * extra
    vocab = tp if megatron else 1  # the logits: gathered (trainwise) or vocabulary-parallel
    if first:
        per_token += 8 + (9 if tp > 1 else 0)
    if last:
        loss = L.loss_saved_bytes_per_token(cfg, recipe, L.loss_kernel(cfg, compiled, run.loss_kernel, megatron))
        per_token += 8 + M.norm_saved_bytes(cfg, s) / seq + c * H / (seq if megatron else 1) + loss / vocab
    if lay.pp > 1 and not megatron:
        per_token += c * cfg.vocab_size if last else s * H / seq
    blocks = 0 if c == s or ckpt in ("full", "op") else sum(M.matmul_weight_params(cfg, i) for i in layers)
    weights = c * (blocks + (cfg.vocab_size * cfg.d_model if last else 0)) / tp if c != s else 0
    if lay.cp > 1 and not megatron and ckpt == "none":
        weights += len(layers) * cp_attention_bytes(cfg, recipe, lay, run.micro_batch, run.seq_len)
    return math.ceil(tokens * per_token + weights)


def cp_attention_bytes(cfg: ModelConfig, recipe: Recipe, layout: Layout, micro_batch: int, seq_len: int) -> float:
    """What one layer's all-gather attention (trainwise.runtime.context_parallel) keeps per micro-batch beyond the
    same block on the rank's T/cp positions alone (layer_bytes_per_token): SDPA saves the gathered keys and values,
    B x T x 2 nkv/tp x hd, and its (T/cp, T) mask, both in the compute dtype; with RoPE and no qk_norm the qkv
    output, of which v was a view, is then not kept: B x T/cp x (q + 2 kv)/tp fewer. Activation checkpointing
    (any) recomputes the core and keeps none of it."""
    c, tp, hd, local = recipe.compute_bytes, layout.tp, cfg.head_dim, seq_len // layout.cp
    gathered = micro_batch * seq_len * 2 * cfg.n_kv_heads // tp * hd * c + local * seq_len * c
    freed = micro_batch * local * (cfg.n_heads + 2 * cfg.n_kv_heads) // tp * hd * c
    return gathered - (freed if cfg.position == "rope" and not cfg.qk_norm else 0)


@dataclass(frozen=True)
class RankPeak:
    """One rank's bytes in one training step: its states at rest and the step's two high points."""
    params: int
    grads: int
    optimizer: int  # the optimizer's moments
    master: int  # the fp32 master copy, where the recipe keeps one beside 16-bit parameters
    activations: int  # saved for backward at the backward high point (every micro-batch then in flight)
    backward: int  # the high point of backward
    step: int  # the high point of the optimizer step
    held: int = 0  # FSDP2's unsharded fp32 gradient sums through the accumulation (held_grad_sums), in backward
    # the least the caching allocator reserves over the step (torch.cuda.max_memory_reserved); 0: the peak
    reserved_at_least: int = 0

    @property
    def peak(self) -> int:
        return max(self.backward, self.step)

    @property
    def reserved(self) -> int:
        """The least the caching allocator holds at once: the peak, or, under FSDP without pp, the compute stream's
        high point before any gradient is reduced plus the rank's sharded gradients. FSDP's reduce-scatter (FSDP2's,
        FSDP1's) allocates those on its own stream, and the allocator reuses a freed block only on the stream that
        made it, so the blocks the backward frees cannot hold them. Fragmentation is not counted. The budget holds
        allocated memory, not this: an allocation that fails first makes the allocator free the blocks it caches."""
        return max(self.peak, self.reserved_at_least)


def rank_peak(run: Run, rank: int = 0, optimizer_share: float | None = None) -> RankPeak:
    """The peak of one training step on `rank` (RankPeak.peak), the larger of two high points:
      backward: parameters + optimizer states + torch's pipelining's receive buffers (one per micro-batch and
        link; Megatron-Core receives into the chunk's input, an activation) + the larger of an MLP's backward
        (mlp_backward_bytes) and the cross-entropy's backward scratch on the last stage (cost.loss.loss_kernel's:
        torch's two fp32 B T V buffers, whole on every tp rank, or vocabulary-parallel three of 1/tp; compiled,
        compiled_loss_backward_bytes) or, under full checkpointing, one recomputed block's activations + under FSDP2
        the gathered parameters in the compute dtype (zero2: all of the rank's, kept from forward to backward; fsdp:
        the stage roots and two blocks) + the most, over the backwards of the schedule (cost.schedule.schedule_ops),
        of the activations of the micro-batches in flight and the gradients, which exist once a backward of the
        step has run: the rank's gradients, DDP's buckets (which hold them all run long, plus under no_sync
        the micro-batches' own .grad tensors; Megatron-LM's gradient buffer takes them directly; experts
        divided by ep are outside the buckets), or FSDP2's unsharded fp32 gradients of the micro-batches
        before the last (outside trainwise and torch's pipeline schedules: the rank's gradient shard); under
        FSDP2 without pp also the high point block by block (fsdp_block_backward), with pp (one stage a rank,
        the schedules that do not split a backward) the backwards as torch's PipelineStage runs them instead
        (fsdp_pipeline_backward);
      optimizer step: parameters + gradients + states + one moment of scratch (other stacks' runs: a foreach
        AdamW's sqrt(v)), none where trainwise's fused AdamW or SGD updates each tensor in place (every layout it
        trains, DTensors included); under tp an untied embedding's gradient whole (whole_embedding_grad).
    A table tied between the embedding and the LM head on one rank (no FSDP2) gets its gradient from both: the
    autograd engine sums the two at the end of backward, when every other gradient exists (tied_grad_sum). States:
    the recipe's bytes per element of the rank's shards (cost.rank.rank_params: fp32 parameters and gradients in
    trainwise's runs) and its optimizer moments and master copy; ZeRO-1 keeps `optimizer_share` of them (default 1 /
    (dp x cp), experts' 1 / (dp x cp / ep)). FSDP2 runs the forward on gathered compute-dtype weights and inputs:
    residual stream in the compute dtype, no autocast weight copies, and is compiled per block (planned eager). ddp
    on a tp or pp mesh is FSDP2's replicate (Layout.replicate), priced as FSDP2 with every unit kept gathered."""
    cfg, lay, recipe, K, strategy = run.model, run.layout, run.recipe, run.grad_accum, run.layout.strategy
    megatron = not (plain := trains(run))  # plain: the fused optimizer steps each tensor in place (DTensors too)
    replicated = lay.replicate and plain  # FSDP2's replicate: priced as FSDP2 (Layout.replicate)
    fsdp, ddp = strategy in ("zero2", "fsdp") or replicated, strategy in ("ddp", "zero1") and not replicated
    params = rank_params(cfg, lay, rank, megatron)
    numel = sum(p.numel for p in params)
    moments = optimizer_moments(run.optimizer)
    if optimizer_share is None and strategy == "zero1":
        experts = sum(p.numel for p in params if is_expert(p.spec))
        sharded = (numel - experts) / (lay.dp * lay.cp) + experts / lay.expert_dp
    else:
        sharded = numel * (1 if optimizer_share is None else optimizer_share)
    optimizer, master = math.ceil(recipe.moment_bytes * moments * sharded), math.ceil(recipe.master_bytes * sharded)
    scratch_step = 0 if plain or moments < 2 else math.ceil(recipe.moment_bytes * sharded)
    acts_recipe = replace(recipe, residual_bytes=recipe.compute_bytes) if fsdp else recipe
    compiled = run.compiled and lay.model_parallel == 1 and lay.cp == 1 and not fsdp  # cp: eager (runtime.mesh)
    pp_rank = lay.coords(rank)[1]
    stages = rank_stages(lay, pp_rank) if lay.pp > 1 else [0]
    per_stage = [stage_activation_bytes(run, stage_layers(cfg.n_layers, lay.stages, st), st == 0,
                                        st == lay.stages - 1, acts_recipe, compiled, megatron)
                 + cast_experts(run, params, stage_layers(cfg.n_layers, lay.stages, st)) for st in stages]
    tokens = run.tokens_per_micro_batch // lay.cp
    scratch = math.ceil(M.mlp_backward_bytes(cfg, acts_recipe, tokens) / lay.tp)
    last = lay.stages - 1 in stages  # the loss is the last stage's
    kernel = L.loss_kernel(cfg, compiled, run.loss_kernel, megatron) if last else None
    if kernel == "compiled":
        scratch = L.compiled_loss_backward_bytes(cfg, acts_recipe, tokens, run.checkpointing)
    elif kernel:
        scratch = max(scratch, L.loss_backward_bytes(cfg, acts_recipe, tokens, lay.tp if megatron else 1, kernel))
    if run.checkpointing in ("full", "op"):
        scratch = max(scratch, math.ceil(M.recompute_bytes(cfg, acts_recipe, tokens, 1, run.checkpointing) / lay.tp))
    gathered = accumulated = 0
    if fsdp:
        sizes = {unit: sum(p.tp_numel for p in ps) for unit, ps in units(cfg, lay, rank, megatron, params).items()}
        roots = sum(n for unit, n in sizes.items() if str(unit).startswith("root"))
        blocks = sorted((n for unit, n in sizes.items() if not str(unit).startswith("root")), reverse=True)
        kept = roots + sum(blocks[:2]) if strategy == "fsdp" else sum(sizes.values())
        gathered = recipe.compute_bytes * kept
        # the micro-batches' unsharded fp32 gradients, kept until the last one's reduce-scatter (each_micro_batch)
        accumulated = held_grad_sums(run, rank)
    grads = recipe.grad_bytes * numel
    # what holds gradients in backward, once a backward of the step has run (DDP's buckets: from the start; experts
    # divided by ep are outside them, and outside trainwise's FSDP2, runtime.expert_parallel: their gradients exist
    # once a backward has run)
    outside = recipe.grad_bytes * sum(p.numel for p in params if divided(p.spec, lay)) if ddp or not megatron else 0
    sharded = K > 1 and each_micro_batch(run, megatron)  # the rank's gradient shard, from the first micro-batch on
    held = (grads - outside if lay.pp > 1 or sharded else 0) + accumulated if fsdp else grads - outside
    no_sync = grads - outside if ddp and K > 1 and not megatron else 0  # Megatron accumulates into its grad buffer
    # the first backward finds no gradients (zero_grad sets them to None), DDP's buckets excepted
    waiting = [0] * len(stages)  # a split backward's output gradients, kept from its I to its W, per local stage
    if lay.pp_schedule in ZERO_BUBBLE:
        waiting = [math.ceil(tokens * sum(weight_grad_inputs_per_token(cfg, acts_recipe, i) for i in
                                          stage_layers(cfg.n_layers, lay.stages, st)) / lay.tp) for st in stages]
    backwards = [(sum(per_stage[c] for c in live) + sum(waiting[c] for c in kept), after)
                 for (live, after), kept in zip(in_flight(lay, pp_rank, K), awaiting_weights(lay, pp_rank, K))]
    flights = [f for f, _ in backwards]
    table = whole_embedding_grad(run, params, recipe)  # held whole where the plan's gradients have its rows
    in_flight_high = max(f + (held if ddp or after else 0) + (outside + table - table // lay.tp if after else 0)
                         for f, after in backwards)
    buffers = 0
    if lay.pp > 1 and (plain or fsdp):  # torch's pipelining: trainwise's trainer and FSDP2's stacks (torchtitan)
        act = tokens // (lay.tp if lay.sequence_parallel else 1) * cfg.d_model * acts_recipe.residual_bytes
        buffers = sum(K * act * sum(0 <= n < lay.stages and n not in stages for n in (st - 1, st + 1))
                      for st in stages)  # a link to another rank's stage (a V's middle two share one)
    fp8_params = M.fp8_weights(params) if recipe.fp8_params else 0  # 1 byte each, not param_bytes
    params_bytes = recipe.param_bytes * numel - (recipe.param_bytes - 1) * fp8_params
    resident = params_bytes + optimizer + master + buffers + M.fp8_weight_bytes(recipe, params)
    backward = resident + in_flight_high + scratch + gathered + no_sync
    if fsdp and plain and lay.pp > 1 and lay.vpp == 1 and lay.pp_schedule not in ZERO_BUBBLE:
        backward = resident + fsdp_pipeline_backward(run, rank, acts_recipe, params, per_stage[0], scratch, outside)
    backward = max(backward, resident + grads + no_sync + tied_grad_sum(run, params, recipe))
    if table and K > 1:  # a later micro-batch's whole table beside the accumulated one, at its backward's end
        backward = max(backward, resident + grads + no_sync + table - table // lay.tp + table)
    reserved = 0
    if fsdp and lay.pp == 1:
        block, compute = fsdp_block_backward(run, rank, acts_recipe, megatron, params)
        backward = max(backward, resident + block)
        # a backward's start without the sharded gradients (on the reduce-scatter stream's blocks, added after)
        start = resident + max(flights) + scratch + gathered + accumulated
        reserved = 0 if replicated else max(start, resident + compute) + grads - outside
    step = resident + grads + scratch_step + table  # the clip: the whole table, and its rows anew beside it
    return RankPeak(params_bytes, grads, optimizer, master, max(flights), backward, step, accumulated, reserved)


def held_grad_sums(run: Run, rank: int = 0) -> int:
    """The micro-batches' unsharded fp32 gradient sums FSDP2 holds on `rank` through a step, until the last one's
    reduce-scatter (K > 1 micro-batches and not each_micro_batch; ddp on a mesh: FSDP2's replicate); 0 otherwise."""
    lay, megatron = run.layout, not trains(run)
    if lay.strategy not in ("zero2", "fsdp") and not (lay.replicate and not megatron) or run.grad_accum == 1 \
            or each_micro_batch(run, megatron):
        return 0
    params = rank_params(run.model, lay, rank, megatron)
    return 4 * sum(p.tp_numel for ps in units(run.model, lay, rank, megatron, params).values() for p in ps)


def each_micro_batch(run: Run, megatron: bool) -> bool:
    """Each micro-batch's gradients reduce-scattered as its backward runs: ZeRO-3's cost.run.fsdp_grad_sync, other
    stacks' ZeRO-2; never under torch's pipeline schedules (gradient sync off until a stage's last backward)."""
    return run.layout.pp == 1 and (fsdp_grad_sync(run) == "micro-batch" if run.layout.zero == 3 else megatron)


def fsdp_block_backward(run: Run, rank: int, recipe: Recipe, megatron: bool, params: list) -> tuple[int, int]:
    """The high point of FSDP2's backward through one pipeline stage's blocks beyond the rank's resident states,
    block by block from the last. Throughout: the root units gathered, their LM-head side gradients (a tied table's,
    the final norm's, the head's) held until the root reduces last, the sharded gradients of the blocks already
    reduced (every block's after a first micro-batch reduced them all, each_micro_batch; accumulating: the unsharded
    fp32 gradients of the blocks not yet reduced instead), the previous block's fp32 reduce-scatter input until the
    next one's, and the experts divided over ep with their whole gradients from their block on. Block j's three
    moments (tests/test_tp_pp.py's moe_fsdp and the planner's development notes in benchmarks/RESULTS.md measured
    them with FSDP2's memory tracker):
      start   block j gathered and block j - 1 prefetched (block 0: its all-gather's buffer still held beside
              it), the activations of blocks 0..j;
      end     the same gathered, block j's unsharded gradients in the gathered dtype, the activations of
              blocks before j;
      reduce  block j resharded, its gradients copied into its fp32 reduce-scatter input and reduced into a
              sharded output, the previous input freed; gradients in a 16-bit dtype measured a second
              block-sized copy of them there (the cast's, not traced further).
    zero2 keeps every block not yet run back gathered (from forward) in place of block j and its prefetch;
    Layout.fsdp_prefetch "post" gathers block j - 1 only at the reduce, not at block j's start and end.
    Activation checkpointing adds one recomputed block at each. Returns the high point and the same without the
    sharded gradients, which FSDP's reduce-scatter allocates on its own stream (RankPeak.reserved)."""
    cfg, lay, K = run.model, run.layout, run.grad_accum
    sizes = units(cfg, lay, rank, megatron, params)
    root = sum(p.tp_numel for unit, ps in sizes.items() if str(unit).startswith("root") for p in ps)
    head = sum(p.tp_numel for unit, ps in sizes.items() if str(unit).startswith("root") for p in ps
               if p.spec.name != "embed.weight" or cfg.tie_embeddings)
    blocks = sorted(unit for unit in sizes if not str(unit).startswith("root"))
    n = {b: sum(p.tp_numel for p in sizes[b]) for b in blocks}
    shard = {b: sum(p.numel for p in sizes[b]) for b in blocks}
    experts = dict.fromkeys(blocks, 0)
    for p in params:
        if divided(p.spec, lay) and p.spec.where in experts:
            experts[p.spec.where] += p.numel
    c, g = recipe.compute_bytes, run.recipe.grad_bytes
    tokens = run.tokens_per_micro_batch // lay.cp
    acts = [math.ceil(tokens * layer_bytes_per_token(cfg, recipe, b, lay, run.seq_len, run.checkpointing, megatron))
            + cast_experts(run, params, [b]) for b in blocks]
    redo = (math.ceil(M.recompute_bytes(cfg, recipe, tokens, 1, run.checkpointing) / lay.tp)
            if run.checkpointing in ("full", "op") else 0)
    accumulating = K > 1 and not each_micro_batch(run, megatron)  # gradient sync off until the last micro-batch
    # running sums over blocks[:k] (before) and blocks[k + 1:] (after)
    acts_before = gathered_before = 0
    shards_after = g * sum(shard.values())
    experts_after = g * sum(experts.values())
    high = compute = 0
    for k, j in enumerate(blocks):
        shards_after -= g * shard[j]
        if lay.strategy != "fsdp":  # zero2, replicate: gathered from forward on
            gathered = beside = gathered_before + n[j]
        else:
            beside = n[blocks[k - 1]] if k else 0  # the prefetched block
            ahead = 0 if lay.fsdp_prefetch == "post" else beside  # BACKWARD_POST gathers it after j's gradients
            gathered = n[j] + (ahead if k else n[j])
        shards = g * sum(shard.values()) if K > 1 and not accumulating else shards_after
        held = (4 * (root + gathered_before + n[j]) if accumulating else c * head) \
            + (g * sum(experts.values()) if K > 1 else experts_after) + c * root + redo + 8 * tokens
        previous = 4 * n[blocks[k + 1]] if k + 1 < len(blocks) else 0
        start = c * gathered + acts_before + acts[k] + previous
        end = c * (gathered - (0 if k else n[j])) + c * n[j] + acts_before + previous
        reduce = c * (beside if lay.strategy == "fsdp" else gathered - n[j]) + c * n[j] * (1 if c == 4 else 2) \
            + 4 * n[j] + acts_before
        high = max(high, held + shards + max(start, end, reduce + 4 * shard[j]))
        compute = max(compute, held + max(start, end, reduce))
        acts_before += acts[k]
        gathered_before += n[j]
        experts_after -= g * experts[j]
    return high, compute


def fsdp_pipeline_backward(run: Run, rank: int, recipe: Recipe, params: list, acts: int, scratch: int,
                           outside: int = 0) -> int:
    """The high point of FSDP2's backwards beyond the resident states on a pipeline rank of one stage, as torch's
    PipelineStage runs them in trainwise's trainer: every backward with gradient sync off and the units kept
    gathered after it (reshard_after_backward False), so the stage's unsharded fp32 gradients accumulate from
    its first backward on and are reduce-scattered, unit by unit, only after the last (perform_reduce_grad);
    fsdp's forwards reshard again, zero2 keeps every unit gathered from the first forward on, and so does ddp
    under pp, which is FSDP2's replicate (its unsharded copies in the compute dtype, fp32 included). No sharded
    gradient exists before that reduce (the step's zero_grad set it to None). `acts`: one micro-batch's
    activations on the stage; `scratch`: the cross-entropy's backward scratch (last stage) or a recomputed
    block's activations; `outside`: the gradients of the experts divided over ep (outside FSDP2), held once a
    backward has run. At each backward of the schedule (in_flight), with the micro-batches in flight:
      loss    (last stage) the loss runs back: the root units and the last block's prefetch gathered, the
              accumulated gradients, the scratch;
      head    then the head: its new gradient (in the compute dtype, and an fp32 copy of it to add) beside
              the accumulated ones, the logits' gradient (one of the scratch's two buffers, in the compute
              dtype) still held;
      block   the first block's backward begins: the roots, that block and the next one's prefetch gathered;
              on the other stages the root's all-gather buffer still held beside them (it is gathered just
              before, with no work between);
      end     every unit gathered and its gradient accumulated, the current micro-batch's activations freed,
              the first stage's embedding gradient new beside its accumulated one (as the head's; both the
              whole table under tp, as whole_embedding_grad says);
    and after the last backward the reduce: every unit gathered and accumulated while the first one's fp32
    reduce-scatter input and sharded output exist. (Measured with the allocator's events per schedule action
    on 4 ranks, pp 2 x dp 2: benchmarks/RESULTS.md.)"""
    cfg, lay = run.model, run.layout
    sizes = {u: sum(p.tp_numel for p in ps) for u, ps in units(cfg, lay, rank, False, params).items()}
    total = sum(sizes.values())
    root = sum(n for u, n in sizes.items() if str(u).startswith("root"))
    block = max((n for u, n in sizes.items() if not str(u).startswith("root")), default=0)
    head, embed = sizes.get("root-last", 0), sizes.get("root-first", 0)
    # under tp the first stage's vocabulary-parallel table gets its gradient whole (whole_embedding_grad)
    whole = vocab_table(params) - vocab_table(params, rows=True)
    grads, embed = 4 * (total + whole) + outside, embed + whole
    c = recipe.compute_bytes
    kept = lay.strategy != "fsdp"  # zero2, and ddp's replicate: gathered from the first forward on

    def new(n: int) -> int:  # a unit's new gradient, and its fp32 copy where it is added to an fp32 accumulation
        return c * n + (4 * n if c != 4 else 0)

    high = 0
    for live, after in in_flight(lay, lay.coords(rank)[1], run.grad_accum):
        held = grads if after else 0
        in_flight_acts = len(live) * acts
        near = c * (total if kept else root + block)  # the roots and the last block's prefetch
        moments = [in_flight_acts + held + scratch + near,
                   in_flight_acts + held + new(head) + scratch * c // 8 + near] if head else []
        moments.append(in_flight_acts + (held or 4 * head) + scratch * (not head)
                       + c * (total if kept else root + 2 * block + (0 if head else root)))
        moments.append(in_flight_acts - acts + grads + c * total + (new(embed) if after else 0))
        high = max(high, *moments)
    largest = max(sizes.values(), default=0)
    return max(high, c * total + grads + 4 * largest + math.ceil(4 * largest / max(1, lay.shard)))


def cast_experts(run: Run, params: list, layers) -> int:
    """Under FSDP2 with a 16-bit compute dtype, the experts divided over ep stay outside its mixed precision
    (fp32, whole on the rank): each micro-batch's forward casts them to the compute dtype, and the matmuls keep
    the copies for backward (bytes per micro-batch for `layers`; trainwise's runs)."""
    lay, c = run.layout, run.recipe.compute_bytes
    if lay.ep == 1 or lay.strategy not in ("zero2", "fsdp") and not lay.replicate or c == 4 or not trains(run):
        return 0
    layers = set(layers)
    return c * sum(p.numel for p in params if divided(p.spec, lay) and p.spec.where in layers)


def whole_embedding_grad(run: Run, params: list, recipe: Recipe) -> int:
    """Bytes of a vocabulary-parallel embedding's whole gradient on a tp rank of the first stage, untied or on a
    stage of its own (tied over pp: the head's copy is another stage's) (trainwise's runs, not FSDP2 nor its
    replicate: fsdp_pipeline_backward; else 0): DTensor's embedding backward computes the whole (V, H) table
    on every tp rank (a Replicate gradient of a Shard(0) parameter), accumulated so from the first backward
    to the gradient clip, which redistributes it to the rank's rows: the whole table and the rows at once
    there (rank_peak), and with accumulation each later micro-batch's whole table beside it as it is added.
    Measured at the clip of a pp 2 x tp 2 stage: benchmarks/RESULTS.md."""
    lay = run.layout
    if lay.tp == 1 or run.model.tie_embeddings and lay.pp == 1 or lay.strategy in ("zero2", "fsdp") or lay.replicate \
            or not trains(run):
        return 0
    return recipe.grad_bytes * vocab_table(params)


def vocab_table(params: list, rows: bool = False) -> int:
    """Elements of the vocabulary-parallel embedding table among a rank's parameters (0 where none): whole, or
    the rank's rows."""
    return sum(p.tp_numel if rows else math.prod(p.spec.shape) for p in params
               if p.spec.name == "embed.weight" and p.spec.tp_dim is not None)


def tied_grad_sum(run: Run, params: list, recipe: Recipe) -> int:
    """The end of a backward on a rank holding both uses of a tied table (pp 1; trainwise's runs, not under
    FSDP2, whose root unit reduce-scatters its own): the autograd engine holds the LM head's gradient of the
    table until the embedding's arrives, last, and sums the two. Measured beside every other gradient: two
    table-sized buffers in the gradient dtype (the sum out of place), one where autocast ran the head in a
    lower precision (its gradient cast back to a fresh tensor, which the sum can be added into in place), on
    one process and DDP alike (benchmarks/RESULTS.md)."""
    lay = run.layout
    if not run.model.tie_embeddings or lay.pp > 1 or lay.strategy in ("zero2", "fsdp") or not trains(run):
        return 0
    table = sum(p.numel for p in params if p.spec.name == "embed.weight")
    return recipe.grad_bytes * table * (1 if recipe.compute_bytes < recipe.grad_bytes else 2)


def weight_grad_inputs_per_token(cfg: ModelConfig, recipe: Recipe, layer: int) -> float:
    """Bytes per token a zero-bubble schedule's input half ("I") keeps for its weights' half ("W") beyond the
    saved activations: the gradient of each weight matmul's output (dW = x^T dy reads it), in the dtype the
    matmul ran in: attention's q, k, v and output projections; the MLP's gate and up (or fc) and down; in a
    MoE layer the router's fp32 logits, each routed assignment's expert gate and up and down (top_k per token)
    and the shared experts' MLP. Multi-head latent attention is counted as its q, k, v and output widths."""
    c, H = recipe.compute_bytes, cfg.d_model
    qkv = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim + H

    def mlp(width: int) -> int:
        return (2 if cfg.gated else 1) * width + H

    if not cfg.is_moe_layer(layer):
        return c * (qkv + mlp(cfg.ffn_hidden))
    F = cfg.expert_ffn_hidden
    shared = mlp(cfg.n_shared_experts * F) if cfg.n_shared_experts else 0
    return c * (qkv + cfg.top_k * mlp(F) + shared) + 4 * cfg.n_experts


def highest_peak(run: Run) -> tuple[int, RankPeak]:
    """The rank whose step peaks highest and its RankPeak, one rank per pipeline stage compared (the ranks
    of a stage hold alike)."""
    lay = run.layout
    stride = lay.gpus // lay.pp
    return max(((r, rank_peak(run, r)) for r in range(0, lay.gpus, stride)), key=lambda item: item[1].peak)
