"""A pipeline's stages and schedules: which layers each stage holds, which stages each pipeline rank runs
and in which order (torch.distributed.pipelining's schedules), how long its bubble is, and which of its
sends its work waits on.
"""

from __future__ import annotations

import math

from trainwise.cost.layout import V_SCHEDULES, ZERO_BUBBLE, Layout


def chunk_layers(n_layers: int, chunks: int) -> list[int]:
    """Layers of each of `chunks` pipeline chunks in pipeline order. Evenly when they divide; otherwise
    every chunk gets ceil(L / chunks) and the shortfall is taken from the ends, last and first chunk
    alternately: those also hold the LM head + loss and the embedding (Llama 3 405B: 126 layers on 16
    stages ran 7 on the first and last and 8 on the others, Dubey et al. 2024 section 3.3.2)."""
    per = math.ceil(n_layers / chunks)
    out = [per] * chunks
    short, i = per * chunks - n_layers, 0
    while short:
        j = chunks - 1 - i // 2 if i % 2 == 0 else i // 2
        if out[j] > 1:
            out[j] -= 1
            short -= 1
        i = (i + 1) % (2 * chunks)
    return out


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """The layers of pipeline stage `stage` of `stages`: contiguous, sized as the planner cuts them
    (chunk_layers: even where they divide, otherwise one fewer on the last and first stages,
    which also hold the LM head and the embedding)."""
    sizes = chunk_layers(n_layers, stages)
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])




def v_shape(layout: Layout) -> bool:
    """The stages sit in a V (zbv, dualpipev): both ends of the pipeline on rank 0."""
    return layout.pp_schedule in V_SCHEDULES and layout.pp > 1


def rank_stages(layout: Layout, pp_rank: int) -> list[int]:
    """Stages of pipeline rank `pp_rank`: pp_rank, pp_rank + pp, ... (the interleaved schedules' loop), or
    pp_rank and 2 pp - 1 - pp_rank (the V of zbv and dualpipev: the first and the last stage on rank 0, the
    middle two on the last rank, which passes its activations from one to the other without a send)."""
    if v_shape(layout):
        return [pp_rank, 2 * layout.pp - 1 - pp_rank]
    return [pp_rank + i * layout.pp for i in range(layout.vpp)]




def schedule_ops(layout: Layout, pp_rank: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order in which a pipeline rank runs forwards ("F") and backwards ("B") of its local stages
    (index into rank_stages), as torch.distributed.pipelining's schedules do: GPipe all forwards, then all
    backwards; 1F1B (PipeDream-Flush) min(K, pp - rank) forwards, then a backward and a forward in turn;
    interleaved 1F1B (Narayanan et al. 2021) min((vpp - 1) K/rounds + 2 (pp - 1 - rank), K vpp) forwards,
    then a forward and a backward in turn, the local stage of each from ScheduleInterleaved1F1B's
    formulas (K/rounds micro-batches per stage before the next). The zero-bubble schedules (ZERO_BUBBLE)
    also run a backward in two halves, "I" (the input's gradient, sent on at once) and "W" (the weights'),
    in the order torch's own schedule computes (_zero_bubble_ops)."""
    K, pp, vpp = micro_batches, layout.pp, layout.vpp
    if pp == 1:
        return [op for _ in range(K) for op in (("F", 0), ("B", 0))]
    if layout.pp_schedule in ZERO_BUBBLE:
        return _zero_bubble_ops(layout, pp_rank, K)
    if layout.pp_schedule == "gpipe":
        return [("F", 0)] * K + [("B", 0)] * K
    if layout.pp_schedule == "1f1b":
        warmup = min(K, pp - pp_rank)
        ops = [("F", 0)] * warmup
        for i in range(K - warmup):
            ops += [("B", 0), ("F", 0)]
        return ops + [("B", 0)] * warmup
    per_round, total, warmup = _interleaved_warmup(pp, vpp, pp_rank, K)
    forward = [("F", (op // per_round) % vpp) for op in range(total)]
    backward = [("B", vpp - 1 - ((op - warmup) // per_round) % vpp) for op in range(warmup, warmup + total)]
    ops = forward[:warmup]
    for i in range(total - warmup):
        ops += [forward[warmup + i], backward[i]]
    return ops + backward[total - warmup:]


def _interleaved_warmup(pp: int, vpp: int, pp_rank: int, micro_batches: int) -> tuple[int, int, int]:
    """(micro-batches per round, forwards of the rank's stages per step, forwards before its first backward) of
    the interleaved 1F1B schedule (schedule_ops)."""
    per_round = micro_batches // max(1, micro_batches // pp)
    total = micro_batches * vpp
    return per_round, total, min((vpp - 1) * per_round + 2 * (pp - 1 - pp_rank), total)


def p2p_exposed_share(layout: Layout, pp_rank: int) -> float:
    """The share of a pipeline rank's sends and receives that its work waits on: all of them, or under
    Layout.pp_overlap those of the interleaved schedule's warm-up forwards and cool-down backwards (as many
    of each), of the step's forwards and backwards of its stages."""
    if not (layout.pp_overlap and layout.pp_schedule == "interleaved"):
        return 1.0
    _, total, warmup = _interleaved_warmup(layout.pp, layout.vpp, pp_rank, layout.micro_batches)
    return warmup / total


def _zero_bubble_ops(layout: Layout, pp_rank: int, micro_batches: int) -> list[tuple[str, int]]:
    """A zero-bubble schedule's actions on `pp_rank`, from the generator torch.distributed.pipelining's schedule
    runs (each rank's list of the whole pipeline's order, computed the same on every rank), read without
    building stages: the generator needs only the pipeline's sizes. DualPipeV's overlapped forward-and-backward
    pairs run their forward first."""
    from torch.distributed.pipelining import schedules

    cls = {"interleaved_zb": schedules.ScheduleInterleavedZeroBubble, "zbv": schedules.ScheduleZBVZeroBubble,
           "dualpipev": schedules.ScheduleDualPipeV}[layout.pp_schedule]
    order = cls.__new__(cls)  # the sizes the generator reads (each schedule's __init__ sets them from its stages)
    order.pp_group_size, order._n_microbatches, order.rank = layout.pp, micro_batches, pp_rank
    order.n_local_stages, order.num_stages, order._num_stages = layout.vpp, layout.stages, layout.stages
    order.number_of_rounds = max(1, micro_batches // layout.pp)
    order.microbatches_per_round = micro_batches // order.number_of_rounds
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}
    local = rank_stages(layout, pp_rank)
    ops = []
    for action in order._calculate_single_rank_operations(pp_rank):
        for a in (action.sub_actions or (action,)) if action is not None else ():
            ops.append((kinds[a.computation_type.value], local.index(a.stage_index)))
    return ops


def bubble_fraction(pp: int, vpp: int, micro_batches: int) -> float:
    """Pipeline bubble as a fraction of the ideal (bubble-free) time: (p - 1) / (v m) for 1F1B and GPipe
    (v = 1) and the interleaved schedule (Narayanan et al. 2021, sections 2.2.1-2.2.2)."""
    return (pp - 1) / (vpp * micro_batches)



def schedule_seconds(layout: Layout, forward: list[float], backward: list[float]) -> float:
    """Seconds from a step's first forward to its last backward when every pipeline rank runs its schedule_ops
    in order, each action as soon as its rank is free and its input is there: a stage's forward after the
    previous stage's forward of the same micro-batch, its backward or input-gradient half (I) after the next
    stage's (the last stage's after its own forward), a weight-gradient half (W) after the oldest I of its stage
    still waiting for one (torch's queue). forward[r] / backward[r]: rank r's seconds per micro-batch, all its
    stages, split evenly between them; I and W each half a backward (the zero-bubble schedules' premise that the
    two halves cost alike). Transfers take no time here: the step prices them apart."""
    p, m, last, share = layout.pp, layout.micro_batches, layout.stages - 1, layout.vpp  # share: stages a rank holds
    ops = [[(kind, rank_stages(layout, r)[j]) for kind, j in schedule_ops(layout, r, m)] for r in range(p)]
    done: dict[tuple, float] = {}  # ("F" | "G" (input gradient), stage, micro-batch) -> when it finished
    next_mb: dict[tuple, int] = {}  # (kind, stage) -> its next micro-batch
    waiting: dict[int, list[int]] = {}  # stage -> micro-batches whose I ran and W has not
    pos, free = [0] * p, [0.0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(ops[r]):
                kind, s = ops[r][pos[r]]
                if kind == "W":
                    k, need, seconds = waiting[s][0], [("G", s, waiting[s][0])], backward[r] / share / 2
                else:
                    k = next_mb.get((kind in "BI", s), 0)
                    need = ([("F", s - 1, k)] if s else []) if kind == "F" else [("F", s, k)] + (
                        [("G", s + 1, k)] if s < last else [])
                    seconds = (forward[r] if kind == "F" else backward[r] / (2 if kind == "I" else 1)) / share
                if any(d not in done for d in need):
                    break
                free[r] = max([free[r]] + [done[d] for d in need]) + seconds
                if kind == "W":
                    waiting[s].pop(0)
                else:
                    done["F" if kind == "F" else "G", s, k] = free[r]
                    next_mb[kind in "BI", s] = k + 1
                    if kind == "I":
                        waiting.setdefault(s, []).append(k)
                pos[r] += 1
                moved = True
    if any(pos[r] < len(ops[r]) for r in range(p)):
        raise RuntimeError(f"the {layout.pp_schedule} schedule's order does not run to its end (pp {p}, m {m})")
    return max(free)


def awaiting_weights(layout: Layout, pp_rank: int, micro_batches: int) -> list[list[int]]:
    """At each backward of the rank's schedule (in_flight's order), the local stages of the micro-batches whose
    input half has run and whose weights' half has not, the one being run included (its I keeps them at its
    end): empty for schedules that do not split a backward."""
    waiting, out = [], []
    for kind, chunk in schedule_ops(layout, pp_rank, micro_batches):
        if kind == "I":
            waiting.append(chunk)
        if kind in ("B", "I"):
            out.append(list(waiting))
        if kind == "W":
            waiting.remove(chunk)
    return out


def in_flight(layout: Layout, pp_rank: int, micro_batches: int) -> list[tuple[list[int], bool]]:
    """The micro-batches in flight on a pipeline rank at each backward of its schedule (the one being run
    included), as the local stage index of each, and whether the weights' gradients exist by then (a backward
    has finished), replaying cost.schedule.schedule_ops: GPipe holds all K at its first backward, 1F1B
    min(K, pp - rank), interleaved 1F1B its warm-up forwards and one more. A zero-bubble schedule's input half
    ("I") keeps what the weights' half ("W") needs, so a micro-batch is in flight until its W."""
    live, out, after = [], [], False
    for kind, chunk in schedule_ops(layout, pp_rank, micro_batches):
        if kind == "F":
            live.append(chunk)
        elif kind in ("B", "I"):
            out.append((list(live), after))
        if kind in ("B", "W"):
            live.remove(chunk)
            after = True
    return out
