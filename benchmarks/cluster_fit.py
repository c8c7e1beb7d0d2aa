"""`plan --fit` over layouts against the published layouts of the development sets (64 GPUs or fewer).

The check: on every planned dense row of both development sets (benchmarks/cluster_model.py: Narayanan et al.
2021 and Korthikanti et al. 2022 on A100; benchmarks/cluster_dev_set_2.py: tables A-E on H100) with 64 GPUs or
fewer, the layout search (trainwise.planner.layouts.fit_run_layouts, what `trainwise plan --fit --gpus N` runs on
a table GPU) ranks the published layout among its three fastest wherever the search space contains it; where it
does not, the notes say term by term why.

Each row is the Run cluster_model.py plans (Plan.run of its own function: the second set's table_a ... table_e
are called with their `compare` and `header` swapped for a recorder, so the lambdas that build each Run are
reused as they are; the first set's rows go through cluster_model.plan with the arithmetic of its main()). The
search runs at the row's GPUs and global batch (micro-batch x accumulation x dp), same model, recipe, sequence,
machine and kept settings, memory budget = the GPU's memory (Plan.budget). Reported per row: the search space,
whether the published (tp, pp, vpp, cp, ep, ZeRO, micro-batch, accumulation, checkpointing) is in it and which
settings the search holds fixed differ from the row's (tp_overlap off, sequence parallelism on with tp > 1), its
rank among the layouts that fit (1 = fastest) or the search's reason for setting it aside, the three fastest, and,
out of the top three, the published layout's breakdown (Plan.cluster.breakdown) minus the fastest's, term by term,
printed as `plan --fit` prints its "slower:" lines (commands/plan.py formats them inline: no public function to
reuse). A published layout outside the space is also priced as the search prices its candidates (the row's plan
with the search's held-fixed settings) and placed among them ("would rank"), next to the row's own plan.

A search of more than CAP candidates (about a minute on this machine: most of a candidate's time is the
per-rank memory model) is restricted with candidate_layouts' own knob, max_micro_batch (its default 8; the CLI
has no flag for it): the largest value under CAP, never below the published micro-batch; the printout says so.

    python benchmarks/cluster_fit.py                  # 10-13 minutes on two shared cores
    python benchmarks/cluster_fit.py --json fit.json --jobs 2
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields, replace
from pathlib import Path

import cluster_model as CM
import trainwise.planner.layouts as L
from trainwise.cost.layout import Layout
from trainwise.cost.run import Run
from trainwise.planner.plan import plan_run

GiB = 2**30
MAX_GPUS, CAP = 64, 1200
SEARCH_MAX_MB = inspect.signature(L.candidate_layouts).parameters["max_micro_batch"].default
DIMS = ("tp", "pp", "vpp", "cp", "ep", "zero", "micro_batch", "checkpointing")  # grad_accum follows from them
SEARCHED_LAYOUT = {"tp", "pp", "vpp", "cp", "ep", "dp", "zero", "micro_batches", "pp_schedule"}
SEARCHED_RUN = {"micro_batch", "grad_accum", "checkpointing", "layout"}
TP_ONLY = {"tp_overlap", "sequence_parallel"}  # no effect without tensor parallelism
# kept from the row in the candidates it applies to (ZeRO-3 on one stage), "step" in the others
ZERO3_ONLY = {"fsdp_grad_sync"}
RULES = {  # candidate_layouts' docstring, per dimension
    "tp": "divisors of the heads within a node", "pp": "divisors of the GPUs left, at most the layers",
    "vpp": "1, or 2-8 with the layers split evenly into pp x vpp chunks and the micro-batches a multiple of pp",
    "cp": "1, or up to 8 for sequences of 8k and more", "ep": "divisors of the experts (MoE only)",
    "zero": "ZeRO 0, 1 and 3 (ZeRO-2 is not searched)",
    "micro_batch": f"divisors of a data-parallel rank's batch up to {SEARCH_MAX_MB}, leaving >= pp micro-batches",
    "checkpointing": "none, selective, op (dense models), full"}


# --------------------------------------------------------------------------------------------------- the rows
def first_set() -> list[dict]:
    """Narayanan's and Korthikanti's rows with <= MAX_GPUS GPUs, planned with cluster_model.plan as its main()
    plans them (that loop is not a function: its arithmetic is repeated here)."""
    rows = []
    for (size, heads, hidden, layers, tp, pp, dp, gbs, mbs, lps, _published, ddp) in CM.NARAYANAN:
        vpp, m = (layers // pp // lps if lps else 1), gbs // (mbs * dp)
        make = functools.partial(CM.plan, CM.gpt(f"{size}B", heads, hidden, layers), tp * pp * dp, tp=tp, pp=pp,
                                 vpp=vpp, micro_batch=mbs, grad_accum=m, checkpointing="full",
                                 sequence_parallel=False, dp_overlap=ddp == "torch")
        rows.append(dict(table="Narayanan", run=f"Narayanan {size}B", gpus=tp * pp * dp, make=make))
    for (name, heads, hidden, layers, tp, pp, gbs, mbs, vpp, *_) in CM.KORTHIKANTI:
        for setting, ckpt, sp in (("full recompute, TP", "full", False), ("selective + SP", "selective", True)):
            make = functools.partial(CM.plan, CM.gpt(name, heads, hidden, layers), tp * pp, tp=tp, pp=pp, vpp=vpp,
                                     micro_batch=mbs, grad_accum=gbs // mbs, checkpointing=ckpt,
                                     sequence_parallel=sp, dp_overlap=False)
            rows.append(dict(table="Korthikanti", run=f"Korthikanti {name} {setting}", gpus=tp * pp, make=make))
    return [r for r in rows if r["gpus"] <= MAX_GPUS]


def second_set() -> list[dict]:
    """The dense rows table_a ... table_e plan, recorded instead of planned (the MoE rows are the next issue's)."""
    rows = []

    def record(_out, table, label, families, _published_s, _tokens, gpus, make, *_a, **_k):
        if CM.MOE not in families:
            rows.append(dict(table=table.key, run=f"{table.key} {label}", gpus=gpus, make=make))

    saved = CM.compare, CM.header
    CM.compare, CM.header = record, lambda *a, **k: None
    try:
        CM.table_a([]), CM.table_b([]), CM.table_c([]), CM.table_d([]), CM.table_e([])
    finally:
        CM.compare, CM.header = saved
    return [r for r in rows if r["gpus"] <= MAX_GPUS]


# --------------------------------------------------------------------------------------------------- the search
def run_key(run: Run) -> tuple:
    lay = run.layout
    return (lay.tp, lay.pp, lay.vpp, lay.cp, lay.ep, lay.zero, run.micro_batch, run.grad_accum, run.checkpointing)


def cand_key(c) -> tuple:
    lay = c.layout
    return (lay["tp"], lay["pp"], lay["vpp"], lay["cp"], lay["ep"], lay["zero"], c.micro_batch, lay["micro_batches"],
            c.checkpointing)


def search(job: tuple):
    """fit_run_layouts on `run`, candidate_layouts restricted to `max_mb` where it is below the default, and the
    Run the search planned for each key in `keys` (the published layouts) and for each tp: what it holds fixed."""
    run, gb, budget, max_mb, keys = job
    orig_cands, orig_plan, seen, calls = L.candidate_layouts, L.plan_run, {}, []

    def plan_and_keep(cand: Run, **kw):
        if calls:  # the first plans the bare GPUs (the node), not a candidate
            seen[("tp", cand.layout.tp)] = cand  # what the search holds fixed, seen at each tp
            if run_key(cand) in keys:
                seen[run_key(cand)] = cand
        calls.append(1)
        return orig_plan(cand, **kw)

    if max_mb != SEARCH_MAX_MB:
        L.candidate_layouts = functools.partial(orig_cands, max_micro_batch=max_mb)
    L.plan_run = plan_and_keep
    t0 = time.time()
    try:
        good, bad = L.fit_run_layouts(run, global_batch=gb, memory_budget=budget)
    finally:
        L.candidate_layouts, L.plan_run = orig_cands, orig_plan
    return good, bad, seen, time.time() - t0


def prepare(row: dict) -> dict:
    """Plan the row; its global batch, budget, search space and the restriction, if any."""
    p = row["make"]()
    run, lay = p.run, p.run.layout
    gb, node = run.micro_batch * run.grad_accum * lay.dp, p.hardware.node.gpus

    def space(m: int) -> list[dict]:
        return L.candidate_layouts(run.model, lay.gpus, node, gb, run.seq_len, m)

    full = space(SEARCH_MAX_MB)
    max_mb = SEARCH_MAX_MB
    if len(full) > CAP:
        max_mb = max([m for m in range(1, SEARCH_MAX_MB) if len(space(m)) <= CAP] or [1])
        if run.micro_batch <= SEARCH_MAX_MB:
            max_mb = max(max_mb, run.micro_batch)
    norm = replace(run, micro_batch=1, grad_accum=1, checkpointing="none",
                   layout=replace(lay, tp=1, pp=1, vpp=1, cp=1, ep=1, dp=lay.gpus, zero=0, micro_batches=1,
                                  sequence_parallel=False, pp_schedule="1f1b"))
    return dict(row, plan=p, gb=gb, budget=p.budget, full=full, max_mb=max_mb,
                searched=len(full) if max_mb == SEARCH_MAX_MB else len(space(max_mb)),
                search_key=repr((norm, gb, p.budget, max_mb)))


# --------------------------------------------------------------------------------------------------- the report
def short(d: dict) -> str:
    """dp tp pp vpp cp (ep) ZeRO B K checkpointing of a layout dict."""
    ep = f" ep{d['ep']}" if d.get("ep", 1) > 1 else ""
    return (f"dp{d['dp']} tp{d['tp']} pp{d['pp']} vpp{d['vpp']} cp{d['cp']}{ep} z{d['zero']} B{d['micro_batch']} "
            f"K{d['grad_accum']} {d['checkpointing']}")


def cand_dict(c) -> dict:
    lay = c.layout
    return {k: lay[k] for k in ("dp", "tp", "pp", "vpp", "cp", "ep", "zero")} | {
        "micro_batch": c.micro_batch, "grad_accum": lay["micro_batches"], "checkpointing": c.checkpointing}


def term_diff(a: dict, b: dict) -> list[tuple[str, float]]:
    """a - b per breakdown term, the largest increase first."""
    return sorted(((k, a.get(k, 0.0) - b.get(k, 0.0)) for k in dict.fromkeys([*a, *b])), key=lambda kv: -kv[1])


def fmt_terms(diff: list[tuple[str, float]], n: int | None = None, slower_only: bool = False) -> str:
    """As `plan --fit`'s "slower:" lines: `tp_comm +1.21 s` (terms under 0.5 ms left out; `slower_only`: only
    those of the first term's sign)."""
    kept = [(k, d) for k, d in diff if abs(d) >= 5e-4 and (not slower_only or (d > 0) == (diff[0][1] > 0))][:n]
    return ", ".join(f"{k[:-2]} {d:+.3g} s" for k, d in kept) or "no term"


def outside(pub: dict, full: list[dict]) -> list[dict]:
    """The dimensions of `pub` the search space lacks, with the values it tries and its rule (candidate_layouts):
    those one change away from a searched layout (the values tried with every other dimension as published),
    else those whose value the search never tries (with every value it tries)."""
    near = {d: sorted({c[d] for c in full if all(c[k] == pub[k] for k in DIMS if k != d)}) for d in DIMS}
    out = [{"dim": d, "value": pub[d], "tried": near[d], "rule": RULES[d]} for d in DIMS if near[d]]
    if not out:
        out = [{"dim": d, "value": pub[d], "tried": sorted({c[d] for c in full}), "rule": RULES[d]} for d in DIMS
               if pub[d] not in {c[d] for c in full}]
    return out or [{"dim": "combination", "value": "/".join(str(pub[d]) for d in DIMS), "tried": [],
                    "rule": "each value is searched, not together"}]


def report(row: dict, good: list, bad: list, seen: dict, seconds: float) -> dict:
    """One row's record (printed as it goes)."""
    p, run = row["plan"], row["plan"].run
    lay = run.layout
    pub = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, "ep": lay.ep, "zero": lay.zero,
           "micro_batch": run.micro_batch, "grad_accum": run.grad_accum, "checkpointing": run.checkpointing}
    key = run_key(run)
    in_space = any(all(c[k] == pub[k] for k in DIMS) for c in row["full"])
    match = next((c for c in good if cand_key(c) == key), None)
    aside = next((c for c in bad if cand_key(c) == key), None)
    s_run = seen.get(key) or seen.get(("tp", lay.tp))
    held = [] if s_run is None else (  # the settings the search holds fixed, where the row's differ
        [(f.name, getattr(lay, f.name), getattr(s_run.layout, f.name)) for f in fields(Layout)
         if f.name not in SEARCHED_LAYOUT and getattr(lay, f.name) != getattr(s_run.layout, f.name)
         and not (lay.tp == 1 and f.name in TP_ONLY)
         and not (f.name in ZERO3_ONLY and (s_run.layout.zero, s_run.layout.pp) != (3, 1))]
        + [(f.name, getattr(run, f.name), getattr(s_run, f.name)) for f in fields(Run)
           if f.name not in SEARCHED_RUN and getattr(run, f.name) != getattr(s_run, f.name)])
    # the published layout priced as the search prices its candidates: the row's plan, with the search's settings
    lay_held, run_held = ({n: b for n, _, b in held if n in {f.name for f in fields(c)}} for c in (Layout, Run))
    q = plan_run(replace(run, layout=replace(lay, **lay_held), **run_held), memory_budget=row["budget"]) if held else p
    rank = good.index(match) + 1 if match else None
    best = good[0] if good else None

    def would(plan) -> int | None:
        return 1 + sum(c.step_seconds < plan.step_seconds for c in good) if good else None

    rec = {"run": row["run"], "table": row["table"], "gpus": lay.gpus, "global_batch": row["gb"],
           "seq_len": run.seq_len, "budget_gib": row["budget"] / GiB, "space": len(row["full"]),
           "searched": len(good) + len(bad), "max_micro_batch": row["max_mb"],
           "restricted": row["max_mb"] != SEARCH_MAX_MB, "search_s": seconds, "fitting": len(good),
           "set_aside": len(bad), "published": pub, "in_space": in_space, "outside": [] if in_space else
           outside(pub, row["full"]), "held_fixed": [[n, repr(a), repr(b)] for n, a, b in held], "rank": rank,
           "set_aside_reason": aside.reason if aside else None,
           "search_step_s": match.step_seconds if match else None,
           "priced_step_s": q.step_seconds, "priced_fits": q.fits, "priced_gib": q.per_device_bytes / GiB,
           "priced_would_rank": would(q), "row_step_s": p.step_seconds,
           "row_fits": p.fits, "row_gib": p.per_device_bytes / GiB, "row_peak_gib": (p.peak_bytes or 0) / GiB,
           "row_would_rank": would(p),
           "top3": [{"layout": cand_dict(c), "step_s": c.step_seconds, "memory_gib": c.per_device_bytes / GiB,
                     "breakdown": c.breakdown} for c in good[:3]]}
    rec["in_top3"] = rank is not None and rank <= 3
    against = "as the search prices it" if held else "the row's plan"
    diff = term_diff(q.cluster.breakdown, best.breakdown) if (q.cluster and best and not rec["in_top3"]) else []
    rec["diff"] = {"against": against, "terms": dict(diff)} if diff else None
    faster = bool(diff) and q.step_seconds < best.step_seconds  # then the terms it gains on, the largest first
    slower = (f"{q.step_seconds / best.step_seconds - 1:+.1%} vs fastest: "
              f"{fmt_terms(diff[::-1] if faster else diff, 3, True)}" if diff else "")
    who = "priced as the search prices it, it" if held else "its own plan"
    if not in_space:
        rec["reason"] = ("outside the search: " + "; ".join(
            f"{o['dim']} {o['value']} (tried {', '.join(map(str, o['tried'])) or '-'})" for o in rec["outside"])
            + (f"; {who} would rank {would(q)} of {len(good)} ({slower})" if good and q.fits else
               f"; {who} does not fit either ({q.per_device_bytes / GiB:.1f} GiB per GPU)" if good else ""))
    elif aside:
        rec["reason"] = f"set aside by the search: {aside.reason}"
    elif not rec["in_top3"]:
        rec["reason"] = f"rank {rank} of {len(good)}, {slower}"
    else:
        rec["reason"] = ""
    if held:
        rec["reason"] += (" " if rec["reason"] else "") + "[search holds " + ", ".join(
            f"{n} {b!r} (row: {a!r})" for n, a, b in held) + "]"
    if match and abs(match.step_seconds / q.step_seconds - 1) > 1e-9:
        rec["inconsistent"] = (f"the search prices the published layout at {match.step_seconds:.4g} s, the row's "
                               f"plan with the search's settings at {q.step_seconds:.4g} s")
    show(rec)
    return rec


def show(r: dict) -> None:
    print(f"\n{r['run']}: {r['gpus']} GPUs, global batch {r['global_batch']} x {r['seq_len']}, "
          f"{r['budget_gib']:.1f} GiB per GPU")
    restricted = (f" (restricted: micro-batches <= {r['max_micro_batch']} of the space's {r['space']} layouts)"
                  if r["restricted"] else "")
    print(f"  searched {r['searched']} layouts{restricted} in {r['search_s']:.0f} s: {r['fitting']} fit, "
          f"{r['set_aside']} set aside")
    state = (f"rank {r['rank']} of {r['fitting']} ({r['search_step_s']:.4g} s)" if r["rank"] else
             f"set aside: {r['set_aside_reason']}" if r["set_aside_reason"] else
             "in the space but not searched (restriction)" if r["in_space"] else "NOT in the search space")
    print(f"  published {short(r['published'])}: {state}")
    for o in r["outside"]:
        print(f"    {o['dim']} {o['value']}: the search tries {', '.join(map(str, o['tried'])) or 'none'} "
              f"({o['rule']})")
    for name, a, b in r["held_fixed"]:
        print(f"    held fixed by the search: {name} {b} (the row: {a})")
    if r["held_fixed"] and not r["rank"]:
        fits = "fits" if r["priced_fits"] else "does NOT fit"
        would = f", would rank {r['priced_would_rank']} of {r['fitting']}" if r["priced_fits"] else ""
        print(f"  as the search prices it: {r['priced_step_s']:.4g} s, {r['priced_gib']:.1f} GiB per GPU ({fits})"
              + would)
    fits = "fits" if r["row_fits"] else "does NOT fit" if r["row_fits"] is False else "fit unknown"
    would = (f", {'its time ' * (r['row_fits'] is False)}would rank {r['row_would_rank']} of {r['fitting']}"
             if r["row_would_rank"] else "")
    print(f"  the row's own plan: {r['row_step_s']:.4g} s, {r['row_gib']:.1f} GiB per GPU ({fits}; its rank peak, "
          f"Plan.peak_bytes: {r['row_peak_gib']:.1f} GiB){would}")
    for i, c in enumerate(r["top3"], 1):
        print(f"  {i}. {short(c['layout']):<48} {c['step_s']:>9.4g} s {c['memory_gib']:>6.1f} GiB")
    if r["diff"]:
        d = list(r["diff"]["terms"].items())
        print(f"  published - fastest ({r['diff']['against']}): {fmt_terms(d)}")
    if r.get("inconsistent"):
        print(f"  INCONSISTENT: {r['inconsistent']}")


def summary(recs: list[dict]) -> dict:
    inside = [r for r in recs if r["in_space"]]
    exact = [r for r in inside if not r["held_fixed"]]
    top = [r for r in inside if r["in_top3"]]
    others = [r for r in recs if not r["in_top3"]]
    out = {"rows": len(recs), "in_space": len(inside), "in_space_exact": len(exact),
           "in_space_held_fixed_differ": len(inside) - len(exact), "in_top3": len(top),
           "in_top3_exact": sum(not r["held_fixed"] for r in top),
           "set_aside": sum(r["set_aside_reason"] is not None for r in inside),
           "priced_would_be_top3": sum(bool(r["priced_fits"] and r["priced_would_rank"])
                                       and r["priced_would_rank"] <= 3 for r in recs),
           "row_plan_would_be_top3": sum(bool(r["row_fits"] and r["row_would_rank"]) and r["row_would_rank"] <= 3
                                         for r in recs),
           "row_plan_does_not_fit": [r["run"] for r in recs if r["row_fits"] is False],
           "outside_by_dim": {d: sum(any(o["dim"] == d for o in r["outside"]) for r in recs) for d in DIMS},
           "restricted": [r["run"] for r in recs if r["restricted"]],
           "inconsistent": [r["run"] for r in recs if r.get("inconsistent")],
           "others": [{"run": r["run"], "reason": r["reason"]} for r in others]}
    print(f"\n\nSummary: {out['rows']} rows with <= {MAX_GPUS} GPUs checked; the published layout is in the search "
          f"space on {out['in_space']} ({out['in_space_exact']} exactly, {out['in_space_held_fixed_differ']} with "
          f"a setting the search holds fixed differing: priced as the search prices it); {out['in_top3']} of those "
          f"rank in the top three ({out['in_top3_exact']} exact), {out['set_aside']} set aside by the search. "
          f"Priced as the search prices its candidates (its held-fixed settings), the published layout fits and "
          f"would rank in the top three on {out['priced_would_be_top3']} of {out['rows']} rows; the row's own plan "
          f"(its settings) on {out['row_plan_would_be_top3']} of "
          f"{out['rows']}; it does not fit by Plan.fits on {len(out['row_plan_does_not_fit'])}: "
          + "; ".join(out["row_plan_does_not_fit"]))
    if any(out["outside_by_dim"].values()):
        print("outside the search space, by dimension: " + ", ".join(
            f"{d} {n}" for d, n in out["outside_by_dim"].items() if n))
    if out["restricted"]:
        print(f"searches restricted (max_micro_batch, CAP {CAP} layouts): {len(out['restricted'])}: "
              + "; ".join(out["restricted"]))
    print("ranks (published layout among those that fit; - not in the space; x set aside):")
    print("  " + "; ".join(f"{r['run']} {r['rank'] or ('x' if r['set_aside_reason'] else '-')}/{r['fitting']}"
                           for r in recs))
    print(f"not in the top three ({len(others)}):")
    for o in out["others"]:
        print(f"  {o['run']}: {o['reason']}")
    for r in out["inconsistent"]:
        print(f"INCONSISTENT: {r}")
    return out


def main() -> int:
    global MAX_GPUS, CAP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows and the summary here")
    ap.add_argument("--jobs", type=int, default=1, help="searches in parallel (processes; default 1)")
    ap.add_argument("--only", help="rows whose name contains this")
    ap.add_argument("--max-gpus", type=int, default=MAX_GPUS)
    ap.add_argument("--cap", type=int, default=CAP, help="candidates a search may price before it is restricted")
    args = ap.parse_args()
    MAX_GPUS, CAP = args.max_gpus, args.cap
    t0 = time.time()
    rows = [r for r in first_set() + second_set() if not args.only or args.only in r["run"]]
    print(f"`plan --fit` over layouts vs the published layouts: {len(rows)} dense development rows with <= "
          f"{MAX_GPUS} GPUs; a search of more than {CAP} layouts restricted to fewer micro-batch sizes", flush=True)
    rows = [prepare(r) for r in rows]
    jobs: dict[str, tuple] = {}
    for r in rows:  # one search per distinct run (Korthikanti's two settings; torchtitan's eager/compiled pair)
        j = jobs.setdefault(r["search_key"], (r["plan"].run, r["gb"], r["budget"], r["max_mb"], set()))
        j[4].add(run_key(r["plan"].run))
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) if args.jobs > 1 else _Inline() as pool:
        futures = {k: pool.submit(search, j) for k, j in jobs.items()}
        recs = [report(r, *futures[r["search_key"]].result()) for r in rows]
    out = summary(recs)
    print(f"({time.time() - t0:.0f} s; {len(jobs)} searches)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": recs, "summary": out, "cap": CAP, "max_gpus": MAX_GPUS},
                                              indent=1, default=str))
    return 0


class _Inline:
    """An executor that runs each job when its result is asked for (one process, rows printed as they go)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *a):
        return _Lazy(lambda: fn(*a))


class _Lazy:
    def __init__(self, thunk):
        self.thunk, self.done = thunk, None

    def result(self):
        if self.done is None:
            self.done = (self.thunk(),)
        return self.done[0]


if __name__ == "__main__":
    raise SystemExit(main())
