"""Per rank under torchrun: each rank's params, grads, optimizer states and step peak, measured in the run,
against the planner's ZeRO stage for its strategy (verify.json's "per_rank")."""

from __future__ import annotations

import math

from trainwise.config import ZERO_STAGE, RunConfig
from trainwise.cost import memory as M
from trainwise.cost.params import params as count_params
from trainwise.planner.plan import train_settings
from trainwise.runtime.distributed import Dist
from trainwise.runtime.optim import param_groups
from trainwise.runtime.step import build_model
from trainwise.verify.verify import entry


def per_rank_verify(cfg: RunConfig, measured: list[dict], d: Dist) -> dict:
    """Predicted (planner: ZeRO-0 for DDP, ZeRO-1 for zero1, ZeRO-2 for zero2, ZeRO-3 for FSDP; dp =
    world size) vs measured, per rank. For zero1 each rank's optimizer share follows
    ZeroRedundancyOptimizer's whole-tensor partition of this model's parameter groups
    (cost.memory.zero1_partition); zero2 is planned in FSDP2's layout (cost.memory.fsdp2_zero2_recipe)."""
    settings = train_settings(cfg.train)
    zero = ZERO_STAGE[d.strategy]
    n_params = count_params(cfg.model).total
    recipe = M.get_recipe(settings["precision"])
    if zero == 2:
        recipe = M.fsdp2_zero2_recipe(recipe)
    plan = M.state_bytes(n_params, recipe, settings["optimizer"], zero=zero, dp=d.world_size)
    predicted = [{"params": plan.params, "grads": plan.grads, "optimizer": plan.optimizer + plan.master}
                 for _ in range(d.world_size)]
    if zero == 1:
        full = M.state_bytes(n_params, recipe, settings["optimizer"])
        for rank, owned in enumerate(M.zero1_partition(_group_numels(cfg), d.world_size)):
            predicted[rank]["optimizer"] = math.ceil((full.optimizer + full.master) * owned / n_params)
    shares = (M.zero1_partition(_group_numels(cfg), d.world_size) if zero == 1 else [None] * d.world_size)
    for rank, owned in enumerate(shares):  # the step's peak on each rank (cost.memory.rank_peak_bytes)
        predicted[rank]["peak_memory_bytes"] = M.rank_peak_bytes(
            cfg.model, M.get_recipe(settings["precision"]), settings["optimizer"], d.strategy, d.world_size,
            settings["micro_batch"], settings["seq_len"], settings["grad_accum"], settings["checkpointing"],
            optimizer_share=None if owned is None else owned / n_params)
    ranks = [{k: entry(p[k], m.get(k)) for k in p} for p, m in zip(predicted, measured)]
    return {"strategy": d.strategy, "world_size": d.world_size, "zero_stage_planned": zero, "ranks": ranks}


def _group_numels(cfg: RunConfig) -> list[list[int]]:
    """Element counts of the model's parameters, per optimizer parameter group (built on the meta device)."""
    model = build_model(cfg.model, "meta")
    return [[p.numel() for p in group["params"]] for group in param_groups(model, cfg.train.weight_decay)]


def format_per_rank(section: dict) -> str:
    lines = [f"per-rank model states and step peak, {section['strategy']} on {section['world_size']} ranks vs the "
             f"ZeRO-{section['zero_stage_planned']} plan:",
             f"{'rank':>4}  {'state':<10}{'predicted':>16}{'measured':>16}{'error':>9}"]
    for r, entries in enumerate(section["ranks"]):
        for name, e in entries.items():
            if e["measured"] is None:
                continue
            name = "peak" if name == "peak_memory_bytes" else name
            lines.append(f"{r:>4}  {name:<10}{e['predicted'] / 1e6:>13.3f} MB{e['measured'] / 1e6:>13.3f} MB"
                         f"{e['error']:>+9.1%}")
    if section["zero_stage_planned"] == 1:
        even = sum(e["optimizer"]["predicted"] for e in section["ranks"]) / section["world_size"]
        lines.append(f"(zero1 shards by whole tensors, as ZeroRedundancyOptimizer does; an even split, "
                     f"DeepSpeed's ZeRO-1, would be {even / 1e6:.3f} MB of optimizer states per rank)")
    if section["zero_stage_planned"] == 2:
        lines.append("(zero2 is FSDP2 keeping the gathered parameters from forward to backward: params = that "
                     "replicated copy, in the compute dtype; optimizer = moments + the fp32 shard it steps, "
                     "the master copy; gradients are kept in fp32)")
    return "\n".join(lines)
