"""Per rank under torchrun: each rank's params, grads, optimizer states, step peak and what it sent in the
step (per collective: calls and bytes), measured in the run, against the plan for that rank (verify.json's
"per_rank"). Data parallel only: the planner's ZeRO stage for the strategy (cost.memory); tensor, pipeline or
expert parallel: trainwise.cost.rank, parameter by parameter and collective by collective (expert parallelism's
all-to-alls at the routing the run measured: each rank's "expert_tokens")."""

from __future__ import annotations

import math
from dataclasses import replace

from trainwise.config import ZERO_STAGE, RunConfig
from trainwise.cost import memory as M
from trainwise.cost import rank as R
from trainwise.cost.layout import Layout
from trainwise.cost.params import params as count_params
from trainwise.cost.rank_memory import rank_peak
from trainwise.cost.recipe import fsdp2_zero2_recipe
from trainwise.cost.run import Run
from trainwise.runtime.distributed import Dist
from trainwise.runtime.optim import param_groups
from trainwise.runtime.step import build_model
from trainwise.verify.verify import entry

STATES = ("params", "grads", "optimizer", "peak_memory_bytes")


def step_shape(cfg: RunConfig, precision: str, layout: Layout, expert_tokens: list | None = None) -> R.StepShape:
    """The step of `cfg` as trainwise.cost.rank counts its messages: under bf16/fp16 autocast matmul outputs
    are 2 bytes; FSDP2's mixed-precision policy (replicate's too: Layout.replicate) also gathers parameters and
    runs the residual stream in that dtype. expert_tokens: each rank's assignments per expert in the step (None:
    uniform routing)."""
    t, low = cfg.train, precision in ("bf16", "fp16")
    fsdp_low = low and layout.dp * layout.cp > 1 and (layout.strategy in ("zero2", "fsdp") or layout.replicate)
    tokens = tuple(tuple(r) for r in expert_tokens) if expert_tokens and all(expert_tokens) else None
    return R.StepShape(t.micro_batch, t.seq_len, t.grad_accum_steps, 2 if low else 4, 2 if fsdp_low else 4,
                       2 if fsdp_low else 4, recompute=t.activation_checkpointing == "full",
                       attention_recompute=t.activation_checkpointing != "none", expert_tokens=tokens,
                       loss_scaled=precision == "fp16")


def predicted_ranks(cfg: RunConfig, precision: str, layout: Layout, expert_tokens: list | None = None) -> list[dict]:
    """Every rank's predicted params, grads, optimizer, peak_memory_bytes (cost.rank_memory.rank_peak, the
    model the plan and the memory check read) and comm (with expert parallelism at `expert_tokens`, each
    rank's measured assignments per expert, when given: its all-to-alls and, in its peak, the copies its experts
    received)."""
    run = Run.of(cfg, precision, layout)
    shape = step_shape(cfg, precision, layout, expert_tokens)
    if layout.model_parallel > 1 or layout.ep > 1:
        peaks = [rank_peak(received_routing(run, r, shape.expert_tokens), r) for r in range(layout.gpus)]
        ranks = [{"params": p.params, "grads": p.grads, "optimizer": p.optimizer + p.master,
                  "peak_memory_bytes": p.peak} for p in peaks]
    else:
        ranks = _zero_plan(cfg, run)
    for r, rank in enumerate(ranks):
        rank["comm"] = R.rank_comm(cfg.model, layout, r, shape)
    return ranks


def received_routing(run: Run, rank: int, expert_tokens: tuple | None) -> Run:
    """The run with its routing imbalance (Run.moe_imbalance) as `rank`'s experts met it in the measured step:
    the assignments its ep group routed to them over the group's mean per rank (below 1 on a rank that
    received fewer); the planner's default (cost.run.MOE_IMBALANCE) where none was measured."""
    cfg, lay = run.model, run.layout
    if lay.ep <= 1 or not expert_tokens:
        return run
    group, ep_rank = R.expert_group(lay, rank)
    local = cfg.n_experts // lay.ep
    received = sum(expert_tokens[r][e] for r in group for e in range(ep_rank * local, (ep_rank + 1) * local))
    mean = sum(sum(expert_tokens[r]) for r in group) / lay.ep
    return replace(run, moe_imbalance=received / mean)


def _zero_plan(cfg: RunConfig, run: Run) -> list[dict]:
    """Data parallel only (its dp x cp ranks with context parallelism): ZeRO-0 for DDP, ZeRO-1 for zero1 (each
    rank's optimizer share follows ZeroRedundancyOptimizer's whole-tensor partition of this model's parameter
    groups: cost.memory.zero1_partition), ZeRO-2 for zero2 (planned in FSDP2's layout: cost.recipe.fsdp2_zero2_recipe),
    ZeRO-3 for FSDP; the step's peak on each rank is cost.rank_memory.rank_peak."""
    layout = run.layout
    zero, dp = ZERO_STAGE[layout.strategy], layout.dp * layout.cp  # context-parallel ranks shard alike
    n_params = count_params(cfg.model).total
    recipe = fsdp2_zero2_recipe(run.recipe) if zero == 2 else run.recipe
    plan = M.state_bytes(n_params, recipe, run.optimizer, zero=zero, dp=dp)
    predicted = [{"params": plan.params, "grads": plan.grads, "optimizer": plan.optimizer + plan.master}
                 for _ in range(dp)]
    shares = M.zero1_partition(_group_numels(cfg), dp) if zero == 1 else [None] * dp
    if zero == 1:
        full = M.state_bytes(n_params, recipe, run.optimizer)
        for rank, owned in enumerate(shares):
            predicted[rank]["optimizer"] = math.ceil((full.optimizer + full.master) * owned / n_params)
    for rank, owned in enumerate(shares):
        share = None if owned is None else owned / n_params
        predicted[rank]["peak_memory_bytes"] = rank_peak(run, rank, optimizer_share=share).peak
    return predicted


def comm_entries(predicted: dict, measured: dict | None) -> dict:
    """{collective: {"calls": entry, "bytes": entry}} over the collectives either side has (0 where absent)."""
    measured = measured or {}
    zero = {"calls": 0, "bytes": 0}
    return {kind: {key: entry(predicted.get(kind, zero)[key], measured.get(kind, zero)[key])
                   for key in ("calls", "bytes")}
            for kind in sorted(set(predicted) | set(measured))}


def per_rank_verify(cfg: RunConfig, measured: list[dict], d: Dist, precision: str = "fp32") -> dict:
    """Predicted vs measured, per rank (module docstring)."""
    layout = d.layout
    predicted = predicted_ranks(cfg, precision, layout, [m.get("expert_tokens") for m in measured])
    ranks = []
    for p, m in zip(predicted, measured):
        rank = {k: entry(p[k], m.get(k)) for k in STATES}
        rank["comm"] = comm_entries(p["comm"], m.get("comm"))
        ranks.append(rank)
    return {"strategy": layout.strategy, "world_size": d.world_size, "zero_stage_planned": ZERO_STAGE[layout.strategy],
            "layout": {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp, "cp": layout.cp, "ep": layout.ep,
                       "vpp": layout.vpp, "pp_schedule": layout.pp_schedule if layout.pp > 1 else None},
            "ranks": ranks}


def _group_numels(cfg: RunConfig) -> list[list[int]]:
    """Element counts of the model's parameters, per optimizer parameter group (built on the meta device)."""
    model = build_model(cfg.model, "meta")
    return [[p.numel() for p in group["params"]] for group in param_groups(model, cfg.train.weight_decay)]


def format_per_rank(section: dict) -> str:
    layout = section.get("layout", {})
    divided = layout.get("tp", 1) > 1 or layout.get("pp", 1) > 1 or layout.get("ep", 1) > 1
    ep = f" (ep {layout['ep']})" if layout.get("ep", 1) > 1 else ""
    cp = f" x cp {layout['cp']}" if layout.get("cp", 1) > 1 else ""
    what = (f"tp {layout['tp']} x pp {layout['pp']}{cp} x dp {layout['dp']}{ep} ({section['strategy']}) vs "
            "trainwise.cost.rank"
            if divided else f"{section['strategy']} on {section['world_size']} ranks"
                            + (f" (dp {layout['dp']} x cp {layout['cp']})" if layout.get("cp", 1) > 1 else "")
                            + f" vs the ZeRO-{section['zero_stage_planned']} plan")
    lines = [f"per-rank model states, step peak and communication, {what}:",
             f"{'rank':>4}  {'state':<10}{'predicted':>16}{'measured':>16}{'error':>9}"]
    for r, entries in enumerate(section["ranks"]):
        for name in STATES:
            e = entries[name]
            if e["measured"] is None:
                continue
            name = "peak" if name == "peak_memory_bytes" else name
            lines.append(f"{r:>4}  {name:<10}{e['predicted'] / 1e6:>13.3f} MB{e['measured'] / 1e6:>13.3f} MB"
                         f"{_error(e):>9}")
        for kind, e in entries.get("comm", {}).items():
            calls, nbytes = e["calls"], e["bytes"]
            lines.append(f"{r:>4}  {kind:<15}{calls['predicted']:>5} calls {nbytes['predicted']:>12,} B  measured "
                         f"{calls['measured']:>5} calls {nbytes['measured']:>12,} B")
    if section["zero_stage_planned"] == 1:
        even = sum(e["optimizer"]["predicted"] for e in section["ranks"]) / section["world_size"]
        lines.append(f"(zero1 shards by whole tensors, as ZeroRedundancyOptimizer does; an even split, "
                     f"DeepSpeed's ZeRO-1, would be {even / 1e6:.3f} MB of optimizer states per rank)")
    if section["zero_stage_planned"] == 2 and not divided:
        lines.append("(zero2 is FSDP2 keeping the gathered parameters from forward to backward: params = that "
                     "replicated copy, in the compute dtype; optimizer = moments + the fp32 shard it steps, "
                     "the master copy; gradients are kept in fp32)")
    lines.append("(communication: bytes this rank sent in the step, as ring algorithms move them)")
    return "\n".join(lines)


def _error(e: dict) -> str:
    return "n/a" if e["error"] is None else f"{e['error']:+.1%}"
