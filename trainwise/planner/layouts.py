"""`trainwise plan --fit` on a GPU cluster: the layouts (tp, pp, vpp, cp, ep, ZeRO, micro-batch,
checkpointing) that fit the GPUs' memory for a global batch, ranked by the step time the cluster model
predicts (trainwise.cost.cluster), each with the reason it was kept or set aside.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainwise.config import CHECKPOINTING, ModelConfig
from trainwise.cost.layout import make_layout
from trainwise.cost.run import Run
from trainwise.cost.time import DEFAULT_MFU
from trainwise.errors import TrainwiseError
from trainwise.planner.plan import MAX_MICRO_BATCHES, Plan, check_micro_batches, plan_run



@dataclass(frozen=True)
class LayoutCandidate:
    layout: dict  # cost.layout.Layout.to_json()
    micro_batch: int
    checkpointing: str
    per_device_bytes: int
    fits: bool
    step_seconds: float | None = None
    mfu: float | None = None
    breakdown: dict | None = None
    reason: str = ""

    def to_json(self) -> dict:
        return self.__dict__


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelConfig, gpus: int, gpus_per_node: int, global_batch: int, seq_len: int,
                      max_micro_batch: int = 8) -> list[dict]:
    """The layouts worth pricing: tp a divisor of the heads inside a node; pp a divisor of the GPUs left,
    at most the layers; vpp when the layers split evenly into pp x vpp chunks; cp for sequences of 8k and
    more; ep a divisor of the experts; micro-batches dividing each data-parallel rank's share of the
    global batch, leaving at least pp micro-batches per pipeline (a multiple of pp when interleaved); ZeRO
    0, 1 and 3 (FSDP; with data parallelism); every checkpointing mode (op-level: dense attention models).
    Sequence parallelism with every tp > 1."""
    check_micro_batches(global_batch // (gpus * max_micro_batch))  # fewer than any layout runs
    out, dense = [], not model.is_moe and model.attention != "mla"
    for tp in (t for t in _divisors(gpus) if t <= gpus_per_node and model.n_heads % t == 0):
        for pp in (p for p in _divisors(gpus // tp) if p <= model.n_layers):
            for cp in (c for c in _divisors(gpus // (tp * pp)) if c == 1 or (seq_len >= 8192 and c <= 8)):
                dp = gpus // (tp * pp * cp)
                if global_batch % dp:
                    continue
                vpps = [1] + [v for v in range(2, 9) if pp > 1 and model.n_layers % (pp * v) == 0]
                eps = [e for e in _divisors(model.n_experts) if (dp * cp) % e == 0 and e <= 64] if model.is_moe else [1]
                for b in (b for b in _divisors(global_batch // dp) if b <= max_micro_batch):
                    # micro-batches per pipeline: at least pp, a multiple of it interleaved
                    m = global_batch // (dp * b)
                    if m > MAX_MICRO_BATCHES:
                        continue
                    for vpp in (v for v in vpps if m >= pp and (v == 1 or m % pp == 0)):
                        for ep in eps:
                            for zero in ((0, 1, 3) if dp * cp > 1 else (0,)):
                                for ckpt in (c for c in CHECKPOINTING if c != "op" or dense):
                                    out.append(dict(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, zero=zero, micro_batch=b,
                                                    grad_accum=m, checkpointing=ckpt))
    return out


def fit_run_layouts(run: Run, *, global_batch: int,
                    memory_budget: int) -> tuple[list[LayoutCandidate], list[LayoutCandidate]]:
    """Every candidate layout of `run`'s GPUs (run.layout.gpus on run.machine; its attention, overlap, FSDP-copy
    and, where ZeRO-3 has one stage, gradient-sync settings kept) planned (plan_run: the one memory model and the
    cluster model), each with its micro-batch, accumulation and checkpointing: (fitting ones fastest first, the
    others with their reason)."""
    model, seq_len, lay = run.model, run.seq_len, run.layout
    gpus = lay.gpus
    base = plan_run(replace(run, micro_batch=1, grad_accum=1, checkpointing="none", layout=make_layout(gpus)),
                    mfu=DEFAULT_MFU)
    node = base.hardware.node
    if node is None and gpus > 1:
        raise TrainwiseError(f"--fit over layouts needs the GPUs' node: give --gpus-per-node with --gpu "
                             f"{run.machine.gpu}.")
    good, bad = [], []
    for c in candidate_layouts(model, gpus, node.gpus if node else 1, global_batch, seq_len):
        try:
            layout = make_layout(gpus, tp=c["tp"], pp=c["pp"], vpp=c["vpp"], cp=c["cp"], ep=c["ep"], zero=c["zero"],
                                 micro_batches=c["grad_accum"], dp_overlap=lay.dp_overlap,
                                 attention_impl=lay.attention_impl, cp_impl=lay.cp_impl, tp_overlap=lay.tp_overlap,
                                 ep_overlap=lay.ep_overlap, pp_overlap=lay.pp_overlap, fsdp_copies=lay.fsdp_copies,
                                 ep_dispatch=lay.ep_dispatch, fsdp_prefetch=lay.fsdp_prefetch,
                                 fsdp_grad_sync=lay.fsdp_grad_sync if c["zero"] == 3 and c["pp"] == 1 else "step")
            cand = replace(run, micro_batch=c["micro_batch"], grad_accum=c["grad_accum"],
                           checkpointing=c["checkpointing"], layout=layout)
            plan = plan_run(cand, mfu=DEFAULT_MFU, memory_budget=memory_budget)  # memory first: an MFU prices nothing
        except TrainwiseError as err:
            bad.append(LayoutCandidate(_layout_json(c, gpus), c["micro_batch"], c["checkpointing"], 0, False,
                                       reason=str(err).split(";")[0]))
            continue
        if not plan.fits:
            bad.append(_candidate(plan, c, reason=f"{plan.per_device_bytes / 2**30:.1f} GiB per GPU > "
                                                  f"{memory_budget / 2**30:.1f} GiB"))
            continue
        good.append(_candidate(plan_run(cand, memory_budget=memory_budget), c))
    good.sort(key=lambda c: (c.step_seconds, c.layout["zero"], c.layout["pp"]))
    return good, bad


def _layout_json(c: dict, gpus: int) -> dict:
    return {k: c[k] for k in ("tp", "pp", "vpp", "cp", "ep", "zero")} | {
        "dp": gpus // (c["tp"] * c["pp"] * c["cp"]), "micro_batches": c["grad_accum"]}


def _candidate(plan: Plan, c: dict, reason: str = "") -> LayoutCandidate:
    return LayoutCandidate(plan.layout.to_json(), c["micro_batch"], c["checkpointing"], plan.per_device_bytes,
                           plan.fits is True, plan.step_seconds, plan.mfu, plan.cluster.breakdown if plan.cluster
                           else None, reason)
