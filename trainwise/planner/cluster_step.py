"""The planner's step on a GPU cluster: each rank's operators recorded on its share of the model
(trainwise.measure.record on cost.layout.tp_share, T / cp tokens), the layout applied to the record
(sequence parallelism shards the element-wise work tensor parallelism leaves whole; expert parallelism
regroups the experts' matmuls; context parallelism gives each rank 1/cp of the attention), priced by
trainwise.cost.cluster with published kernel and collective figures.
"""

from __future__ import annotations

from dataclasses import replace

from trainwise.config import ModelConfig
from trainwise.cost import memory as M
from trainwise.cost.cluster import ClusterStep, RankWork, cluster_step
from trainwise.cost.layout import Layout, param_counts, tp_share
from trainwise.cost.ops import GATHERED, Op
from trainwise.cost.params import params
from trainwise.cost.recipe import Recipe
from trainwise.cost.steptime import scale_batch
from trainwise.hardware.table import Accelerator, Node
from trainwise.measure.record import block_ops

_CACHE: dict[str, tuple[bool, dict[str, list[Op]]]] = {}  # key -> (with fixed bytes, the record)


def _blocks(cfg: ModelConfig, micro_batch: int, seq_len: int, precision: str, checkpointing: str, optimizer: str,
            attention: str) -> dict[str, list[Op]]:
    """measure.record.block_ops of one sequence, memoised, scaled to the micro-batch (cost.steptime
    .scale_batch): `plan --fit` prices many layouts and micro-batches from a few records. The fixed bytes, which
    take a second record, are found once a larger micro-batch asks for them."""
    key, fixed = repr((cfg, seq_len, precision, checkpointing, optimizer, attention)), micro_batch > 1
    if key not in _CACHE or (fixed and not _CACHE[key][0]):
        _CACHE[key] = (fixed, block_ops(cfg, 1, seq_len, precision, checkpointing, optimizer, attention, fixed))
    return {part: scale_batch(ops, micro_batch, seq_len) for part, ops in _CACHE[key][1].items()}


def rank_work(cfg: ModelConfig, layout: Layout, micro_batch: int, seq_len: int, precision: str, checkpointing: str,
              optimizer: str = "adamw", fp8: str = "", fused: bool = False, states: float = 1.0) -> RankWork:
    """One rank's operators per micro-batch under `layout` (module docstring), with and without checkpointing;
    `fp8`: the blocks' linear layers in FP8 with that scaling (_fp8); `fused`: the element-wise work as a
    fusing stack runs it (fuses); `states`: the optimizer update's bytes over the record's (its states in
    other dtypes than the recorded weights)."""
    def record(ckpt: str) -> dict[str, list[Op]]:
        recorded = "unfused" if layout.attention_impl == "unfused" else "flash"  # fused kernels record alike
        share = _blocks(tp_share(cfg, layout.tp, layout.expert_tp), micro_batch, seq_len // layout.cp, precision,
                        ckpt, optimizer, recorded)
        whole = (_blocks(cfg, micro_batch, seq_len // layout.cp, precision, ckpt, optimizer, recorded)
                 if layout.sequence_parallel else None)
        out = {part: _apply(ops, layout, whole and whole.get(part)) for part, ops in share.items()}
        if states != 1:
            out = {part: [o.resized(1, states) if o.phase == "optimizer" else o for o in ops]
                   for part, ops in out.items()}
        return {part: _fp8(ops, fp8) if fp8 and part != "ends" else ops for part, ops in out.items()}

    main = record(checkpointing)
    plain = record("none") if checkpointing != "none" else None
    work = lambda b: RankWork(b["layer"], b["ends"], b.get("moe_layer"), fused=fused)  # noqa: E731
    return replace(work(main), plain=work(plain) if plain else None)


def _apply(ops: list[Op], layout: Layout, whole: list[Op] | None) -> list[Op]:
    """The layout on a tensor-parallel rank's record: sequence parallelism divides by tp the element-wise
    ops the record has unchanged from the whole model's (norms, residual adds, dropout: what tensor
    parallelism leaves whole); context parallelism multiplies the attention kernels (recorded on T / cp
    tokens) by cp, each rank's 1/cp share of the T x T work (load-balanced ring attention); expert
    parallelism gives each rank E / ep experts with ep times the tokens each (x etp / tp where the experts'
    tensor parallelism differs from the attention's: Layout.etp)."""
    same = {(o.name, o.phase, o.dtype, o.calls, o.bytes) for o in whole or [] if o.shape is None}
    out = []
    for op in ops:
        if same and op.phase != "optimizer" and (op.name, op.phase, op.dtype, op.calls, op.bytes) in same:
            op = op.resized(1 / layout.tp, 1 / layout.tp)
        if op.cls == "attention":  # the kernel the layout names, priced at its published rate (cost.gpu)
            op = replace(op, kernel=layout.attention_impl)
        if layout.cp > 1 and op.cls == "attention":
            op = op.resized(layout.cp, layout.cp)
        if "grouped_mm" in op.name and op.shape and layout.ep * layout.expert_tp != layout.tp:
            # tokens per expert: the ep ranks' tokens, each rank's T / tp (sequence parallel) gathered over etp
            e, a, b, n = op.shape
            grow = layout.ep * layout.expert_tp / layout.tp
            op = replace(op, shape=(e // layout.ep, a, round(b * grow), n) if op.layout.endswith("split-k")
                         else (e // layout.ep, round(a * grow), b, n))
        out.append(op)
    return out


# Bytes per element of the cast to FP8 before a GEMM: the bf16 tensor read (2), the FP8 copy and its transpose
# written (1 + 1: Transformer Engine's cast-transpose, the transpose for the backward GEMM that reads it).
FP8_CAST_BYTES = 4
# Current scaling reads the tensor once more for its amax before casting; delayed scaling takes the scale from
# the amax history and block scaling from each block, both inside the cast kernel.
AMAX_PASS_BYTES = 2


def _fp8(ops: list[Op], scaling: str) -> list[Op]:
    """A block's linear layers in FP8 (Transformer Engine's recipes): each bf16 GEMM (the router, in fp32,
    and attention stay) priced at the FP8 rate (cost.gpu.matmul_rate), and before it the cast of the
    activation it reads first: the forward GEMM's input and the input-gradient GEMM's output gradient (the
    weight-gradient GEMM reads both casts' transposes). Weights are cast once per step, not per
    micro-batch, and the casts fused into a preceding norm are priced as separate passes."""
    per_element = FP8_CAST_BYTES + (AMAX_PASS_BYTES if scaling == "current" else 0)
    out = []
    for op in ops:
        if op.cls != "matmul" or op.shape is None or op.dtype != "bf16":
            out.append(op)
            continue
        out.append(replace(op, dtype="fp8"))
        if op.phase == "forward" or not op.layout.startswith("T"):
            batch, m, k, _ = op.shape
            out.append(Op("fp8 cast", "elementwise/other", op.phase, "bf16", None, op.calls, 0.0,
                          per_element * batch * m * k * op.calls))
    return out


def fuses(recipe: Recipe, compiled: bool, fused: bool | None = None) -> bool:
    """Whether a run's stack fuses its element-wise work: `fused` where the run says (cost.run.Run.fused),
    else torch.compile (inductor's generated kernels) and the stacks that train in Megatron's mixed precision
    or FP8 (Megatron-LM's fused LayerNorm, bias-GELU, bias-dropout-add and softmax kernels; Transformer
    Engine's fused norms, RoPE and gated activations). Fused, an operator moves only the tensors that must be
    in memory (cost.ops.Op.fused)."""
    if fused is not None:
        return fused
    return compiled or recipe.name == "megatron" or bool(recipe.fp8)


def predict_cluster_step(cfg: ModelConfig, layout: Layout, acc: Accelerator, node: Node, *, micro_batch: int,
                         seq_len: int, recipe: Recipe, checkpointing: str, optimizer: str = "adamw",
                         tp_overlap: str | None = None, compiled: bool = False,
                         moe_imbalance: float = 1.0, fused: bool | None = None) -> ClusterStep:
    """One optimizer step of `cfg` under `layout` on a cluster of `acc` in `node`s (cost.cluster)."""
    gathered = layout.strategy in GATHERED
    precision = recipe.record_precision(gathered)
    # recorded in 16 bits for FSDP2's policy, the update still moves the recipe's states (fp32 under amp)
    states = recipe.param_bytes / recipe.compute_bytes if gathered and recipe.record_precision() != precision else 1
    work = rank_work(cfg, layout, micro_batch, seq_len, precision, checkpointing, optimizer, recipe.fp8,
                     fuses(recipe, compiled, fused), states)
    # FSDP2's mixed-precision policy gathers the parameters in the compute dtype (and reduces in fp32)
    return cluster_step(cfg, layout, work, param_counts(cfg, layout), acc=acc, node=node, micro_batch=micro_batch,
                        seq_len=seq_len, checkpointing=checkpointing, act_bytes=recipe.compute_bytes,
                        grad_bytes=_reduced_grad_bytes(recipe),
                        param_bytes=_gathered_param_bytes(cfg, recipe, gathered), tp_overlap=tp_overlap,
                        moe_imbalance=moe_imbalance)


def _gathered_param_bytes(cfg: ModelConfig, recipe: Recipe, gathered: bool) -> float:
    """Bytes per parameter the data-parallel all-gathers move: the compute dtype's where FSDP gathers them
    (FSDP2's mixed-precision policy), else the parameters' own; FP8 parameters (Recipe.fp8_params) gathered in
    FP8, 1 byte each, beside the rest."""
    whole = recipe.compute_bytes if gathered else recipe.param_bytes
    if not recipe.fp8_params:
        return whole
    fp8 = M.block_matmul_params(cfg) / params(cfg).total
    return whole - fp8 * (whole - 1)


def _reduced_grad_bytes(recipe: Recipe) -> int:
    """Bytes per gradient the data-parallel reduction moves: the recipe's gradients' (the `megatron` recipe's
    16-bit ones, Recipe.reduce_bytes)."""
    return recipe.reduce_bytes or recipe.grad_bytes

