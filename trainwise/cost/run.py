"""The description of one training run that the planner and the cost models read (docs/ARCHITECTURE.md,
"The run description"): the model, the batch shape, the precision recipe, the optimizer, activation
checkpointing, compilation, the layout over ranks, the hardware asked for and the run's length in tokens.
Built once, from a run config (`Run.of`) or from the planner's flags, and passed whole to the planner, the
per-rank memory model, the memory check and verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwise.config import ModelConfig, RunConfig
from trainwise.cost.layout import Layout
from trainwise.cost.recipe import RECIPES, Recipe, get_recipe

# MoE routing as trained models route: the most loaded expert-parallel rank's tokens over the mean, once the
# experts' average loads are balanced (in training by the balancing loss or bias; there by placing experts by
# load), what is left being the step-to-step spread: DeepSeek-R1 on EP 36, the mean over its MoE layers and 100
# steps of max / mean, 1.115 (NVIDIA TensorRT-LLM's tech blog "Scaling Expert Parallelism", its load statistics;
# 2.56 with the experts placed in order). The published MoE benchmarks force 1.0 (balanced).
MOE_IMBALANCE = 1.115


def routed_imbalance(cfg: ModelConfig, imbalance: float) -> float:
    """The most loaded expert-parallel rank's routed tokens over the mean: the routing's `imbalance`, held to the
    model's capacity factor where it drops what exceeds each expert's capacity (model.dropless false: a rank's
    experts keep at most capacity_factor x the mean; the dispatch is still priced at every assignment). The
    cluster step prices that rank's expert GEMMs and dispatch, the per-rank memory model its experts' saved
    copies."""
    return imbalance if cfg.dropless else min(imbalance, cfg.capacity_factor)


@dataclass(frozen=True)
class Machine:
    """The hardware a run is planned on, as asked for: a table accelerator or this machine's device by name
    (`gpu`: "a100-80gb", "cpu", "cuda"), or a peak FLOP/s; the other fields override the table's figures
    (memory bytes per device, bandwidths in bytes/s, the node)."""

    gpu: str | None = None
    peak_flops: float | None = None
    bandwidth: float | None = None
    memory: int | None = None
    gpus_per_node: int | None = None
    intra_node_bw: float | None = None
    inter_node_bw: float | None = None
    clock_share: float | None = None  # a table GPU's kernel rates held to this share (hardware.table)


@dataclass(frozen=True)
class Run:
    model: ModelConfig | None  # None: only a parameter count is known (the planner's 6ND rule)
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1  # K micro-batches per optimizer step (and per pipeline)
    recipe: Recipe = RECIPES["amp"]
    optimizer: str = "adamw"  # adamw | sgd | sgd-momentum (cost.recipe.OPTIMIZER_MOMENTS)
    checkpointing: str = "none"  # none | selective | full
    compiled: bool = False  # a whole-model torch.compile (what autograd saves changes)
    layout: Layout = field(default_factory=Layout)
    tokens: float | None = None  # D, the run's training tokens; None: everything per step
    machine: Machine | None = None  # None: no hardware (everything but time is known)
    # MoE routing: the most loaded expert-parallel rank's tokens over the mean (MOE_IMBALANCE; 1.0: balanced, as
    # the published MoE benchmarks force it); the planner prices that rank's expert GEMMs and dispatch
    moe_imbalance: float = MOE_IMBALANCE
    # the stack fuses its element-wise work (Transformer Engine's and Megatron's fused kernels, torch.compile):
    # None: as the recipe and torch.compile imply (planner.cluster_step.fuses)
    fused: bool | None = None
    # the stack's cross-entropy kernel (cost.loss.STACK_LOSSES: torch, megatron, flash-attn, te), which sets what the
    # loss keeps; None: trainwise's own where it trains the run (cost.run.trains), Megatron-Core's elsewhere
    loss_kernel: str | None = None

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len

    @classmethod
    def of(cls, cfg: RunConfig, precision: str, layout: Layout | None = None, compiled: bool = False,
           machine: Machine | None = None) -> Run:
        """The run a trainwise config describes, as the trainer executes it: `precision` is the one the
        trainer resolved: fp32, or bf16 / fp16 autocast over fp32 weights (the "amp" recipe). SGD with
        momentum keeps one moment per parameter. Without `layout`: one device, K micro-batches per step."""
        t = cfg.train
        optimizer = "sgd-momentum" if t.optimizer == "sgd" and t.momentum != 0 else t.optimizer
        return cls(cfg.model, micro_batch=t.micro_batch, seq_len=t.seq_len, grad_accum=t.grad_accum_steps,
                   recipe=get_recipe("fp32" if precision == "fp32" else "amp"), optimizer=optimizer,
                   checkpointing=t.activation_checkpointing, compiled=compiled,
                   layout=layout or Layout(micro_batches=t.grad_accum_steps),
                   tokens=t.max_steps * t.tokens_per_step * (layout.dp if layout else 1), machine=machine)


def trains(run: Run) -> bool:
    """Whether trainwise's trainer runs this layout as planned: fp32 or autocast over fp32 weights, sequence
    parallel with tp, flash attention, context parallelism only as all-gather attention without pp
    (runtime.context_parallel), expert parallelism only over the data-parallel ranks (of each pipeline stage:
    runtime.expert_parallel), each expert's width split over tp (etp = tp)."""
    lay = run.layout
    experts = lay.ep == 1 or lay.expert_tp == lay.tp
    context = lay.cp == 1 or lay.cp_impl == "allgather" and lay.pp == 1
    return (run.recipe.name in ("fp32", "amp") and context and experts and lay.attention_impl == "flash"
            and (lay.tp == 1 or lay.sequence_parallel))


def fsdp_grad_sync(run: Run) -> str:
    """When ZeRO-3 reduce-scatters the run's gradients (Layout.fsdp_grad_sync), or where the layout leaves it to
    the stack (None): "micro-batch" for ZeRO-3 on one stage where another stack runs it (torchtitan's FSDP2,
    Megatron-FSDP), "step" where trainwise's trainer does (trains) and wherever the setting does not apply."""
    lay = run.layout
    return lay.fsdp_grad_sync or ("micro-batch" if lay.zero == 3 and lay.pp == 1 and not trains(run) else "step")
