"""The description of one training run that the cost models read (docs/ARCHITECTURE.md, "The run
description"): the model, the batch shape, the precision recipe, the optimizer, activation checkpointing,
compilation and the layout over ranks. Built once, from a run config (`Run.of`) or from the planner's
flags, and passed whole to the per-rank memory model, the memory check and verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwise.config import ModelConfig, RunConfig
from trainwise.cost import memory as M
from trainwise.cost.layout import Layout



@dataclass(frozen=True)
class Run:
    model: ModelConfig
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1  # K micro-batches per optimizer step (and per pipeline)
    recipe: M.Recipe = M.RECIPES["amp"]
    optimizer: str = "adamw"  # adamw | sgd | sgd-momentum (cost.memory.OPTIMIZER_MOMENTS)
    checkpointing: str = "none"  # none | selective | full
    compiled: bool = False  # a whole-model torch.compile (what autograd saves changes)
    layout: Layout = field(default_factory=Layout)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len

    @classmethod
    def of(cls, cfg: RunConfig, precision: str, layout: Layout | None = None, compiled: bool = False) -> Run:
        """The run a trainwise config describes, as the trainer executes it: `precision` is the one the
        trainer resolved: fp32, or bf16 / fp16 autocast over fp32 weights (the "amp" recipe). SGD with
        momentum keeps one moment per parameter."""
        t = cfg.train
        optimizer = "sgd-momentum" if t.optimizer == "sgd" and t.momentum != 0 else t.optimizer
        return cls(cfg.model, micro_batch=t.micro_batch, seq_len=t.seq_len, grad_accum=t.grad_accum_steps,
                   recipe=M.get_recipe("fp32" if precision == "fp32" else "amp"), optimizer=optimizer,
                   checkpointing=t.activation_checkpointing, compiled=compiled, layout=layout or Layout())
