"""What `trainwise scale fit | predict | optimal` compute, as functions the CLI and tests call.

A fit record (the JSON stored per corpus + tokenizer) holds the law, its bootstrap refits, the points
and the training recipe of the runs: the law predicts runs trained the same way (same LR schedule,
batch, sequence length), on the same text with the same tokenizer.

It also holds what the points identify (identify()): per parameter, whether the bootstrap pins it down;
per term, how much of the observed loss range it spans and whether its level is pinned down. `predict`
and `optimal` refuse to extrapolate along an axis (N or D) whose term is not identified, and name the
sweep that would identify it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainwise.config import DataConfig, RunConfig
from trainwise.data.sources import STDLIB_CORPUS
from trainwise.errors import TrainwiseError
from trainwise.scale.law import (
    FULL,
    HUBER_DELTA,
    IDENTIFIED_SPAN,
    PARAM_NAMES,
    Bootstrap,
    Form,
    Law,
    bootstrap,
    fit_law,
    identification,
)
from trainwise.scale.points import REPEAT_EPOCHS, non_embedding_params, read_runs
from trainwise.scale.store import find_fit
from trainwise.scale.sweep import choose_models, flops_per_token, ladder

N_CONVENTION = "non-embedding parameters (cost/params.py; active parameters for MoE)"
TERMS = {"N": ("A", "alpha"), "D": ("B", "beta")}  # the parameters of each axis's term
OPTIMAL_WIDTHS = tuple(range(64, 4097, 32))  # the shape family `optimal` searches (sweep.shape)


def recipe_of(cfg: RunConfig, schedule: str) -> dict:
    t = cfg.train
    return {"schedule": schedule, "lr": t.lr, "min_lr": t.min_lr, "warmup_steps": t.warmup_steps,
            "micro_batch": t.micro_batch, "grad_accum_steps": t.grad_accum_steps, "seq_len": t.seq_len,
            "optimizer": t.optimizer, "weight_decay": t.weight_decay,
            "eval_steps": t.eval_steps}  # the validation loss is the mean over these batches


def fit_runs(run_dirs: list[str | Path], points: str = "auto", samples: int = 100, seed: int = 0,
             form: Form = FULL) -> dict:
    """Fit the law (in `form`) to the runs' validation points; returns the fit record (module docstring)."""
    runs = read_runs(run_dirs, points)
    groups = [r.array() for r in runs if len(r.tokens)]
    if sum(map(len, groups)) < 5 and any(r.past_passes for r in runs):
        raise TrainwiseError(
            f"fewer than 5 validation rows within {REPEAT_EPOCHS} passes over the corpus "
            f"({runs[0].unique_tokens:,} training tokens): {'; '.join(f'{r.run_dir}: {r.used}' for r in runs)}. "
            "The law is fitted only where repeated tokens count as new ones: evaluate more often "
            "(train.eval_every), or train on more text.")
    recipes = {tuple(sorted(recipe_of(r.config, r.schedule).items())) for r in runs}
    record = {
        **fit_points(groups, form, samples, seed),
        "conventions": {"N": N_CONVENTION, "D": "tokens seen at the validation row",
                        "L": "validation loss, nats/token"},
        "recipe": dict(recipes.pop()) if len(recipes) == 1 else None,
        "corpus_train_tokens": runs[0].unique_tokens,
        "max_passes": REPEAT_EPOCHS,  # rows past this many passes over the corpus are not fitted
        "runs": [{"run_dir": str(r.run_dir), "name": r.config.model.name, "seed": r.config.train.seed,
                  "n_params": r.n_params, "used": r.used,
                  "points": [[float(d), float(l)] for d, l in zip(r.tokens, r.losses)]} for r in runs],
    }
    record["identification"] = identify(record)
    return record


def fit_points(groups: list[np.ndarray], form: Form = FULL, samples: int = 100, seed: int = 0) -> dict:
    """The law (in `form`), its bootstrap and residuals for groups of (N, D, L) points, one (P, 3) array
    per run: the part of a fit record that depends on the points alone."""
    if samples < 2:
        raise TrainwiseError(f"--bootstrap {samples}: a 5-95% interval needs at least 2 refits (100 by default).")
    every = np.concatenate(groups) if groups else np.zeros((0, 3))
    law, objective = fit_law(every[:, 0], every[:, 1], every[:, 2], form=form)
    boot = bootstrap(groups, law, samples=samples, seed=seed, form=form)
    rel = law.loss(every[:, 0], every[:, 1]) / every[:, 2] - 1
    return {"law": law.to_json(), "form": str(form), "objective": objective, "huber_delta": HUBER_DELTA,
            "bootstrap": {**boot.to_json(), "laws": [[getattr(b, k) for k in PARAM_NAMES] for b in boot.laws]},
            "residuals": {"rms_relative": float(np.sqrt(np.mean(rel ** 2))),
                          "max_abs_relative": float(np.abs(rel).max()), "points": len(rel)}}


def identify(record: dict) -> dict:
    """What the points pin down. Per parameter: law.identification (the rule on its own interval).
    Per term: its range over the fitted points in nats/token and as a share of the observed loss range
    (max - min; E is a constant and spans none of it), and its level at the centre of the fitted range
    (the geometric mean of the fitted sizes, or of the fitted D's ends) with its bootstrap interval. An
    axis (N or D) is identified when its exponent is and its term's level is (an interval at most
    IDENTIFIED_SPAN x wide, the parameters' rule): A and alpha trade off along a ridge, so A's own
    interval can span decades while the term they make, which is what an extrapolation uses, is pinned
    down (the 20-minute stdlib sweep of benchmarks/RESULTS.md: A spans 6e4x, the N term at its centre 7x)."""
    boot, law = bootstrap_of(record), law_of(record)
    parameters = identification(boot, Form.parse(record.get("form", "full")))
    pts = np.array([[r["n_params"], d, l] for r in record["runs"] for d, l in r["points"]])
    span = float(pts[:, 2].max() - pts[:, 2].min())
    ranges = fitted_ranges(record)
    centre = {"N": float(np.exp(np.log(sorted({r["n_params"] for r in record["runs"]})).mean())),
              "D": float(np.sqrt(ranges["D"][0] * ranges["D"][1]))}
    terms: dict = {"loss": [float(pts[:, 2].min()), float(pts[:, 2].max())], "E": law.E}
    axes = {}
    for axis, values in (("N", law.A / pts[:, 0] ** law.alpha), ("D", law.B / pts[:, 1] ** law.beta)):
        lo, hi = float(values.min()), float(values.max())
        level = law.A / centre[axis] ** law.alpha if axis == "N" else law.B / centre[axis] ** law.beta
        p5, p95 = boot.term_interval(axis, centre[axis])
        level_ok = p5 > 0 and p95 / p5 <= IDENTIFIED_SPAN
        terms[axis] = {"min": lo, "max": hi, "share_of_range": (hi - lo) / span if span > 0 else 0.0,
                       "at": centre[axis], "level": float(level), "level_p5_p95": [p5, p95],
                       "level_identified": level_ok}
        axes[axis] = level_ok and parameters[TERMS[axis][1]]["identified"] is not False
    return {"parameters": parameters, "axes": axes, "terms": terms,
            "rule": "not identified: a 5-95% interval at a bound of the search or wider than 10x; an axis needs its "
                    "exponent and its term's level at the fitted range's centre identified"}


def identification_of(record: dict) -> dict:
    """The record's identification (computed for a fit stored before it was recorded)."""
    return record.get("identification") or identify(record)


def fitted_ranges(record: dict) -> dict[str, tuple[float, float]]:
    ns = [r["n_params"] for r in record["runs"]]
    ds = [d for r in record["runs"] for d, _ in r["points"]]
    return {"N": (min(ns), max(ns)), "D": (min(ds), max(ds))}


def refusal(record: dict, n_params: float, tokens: float) -> str | None:
    """Why the law may not be used at (N, D): an axis on which the point lies outside the fitted range
    while the fit does not identify that axis's term. None when it may."""
    ident, ranges = identification_of(record), fitted_ranges(record)
    target = {"N": n_params, "D": tokens}
    refused = [axis for axis, (lo, hi) in ranges.items()
               if not ident["axes"][axis] and not lo <= target[axis] <= hi]
    if not refused:
        return None
    reasons = []
    for axis in refused:
        lo, hi = ranges[axis]
        coefficient, exponent = TERMS[axis]
        term = ident["terms"][axis]
        why = ([f"{exponent}: {ident['parameters'][exponent]['why']}"]
               * (ident["parameters"][exponent]["identified"] is False))
        if not term["level_identified"]:
            p5, p95 = term["level_p5_p95"]
            why.append(f"the term at {axis} = {term['at']:,.0f} lies in {p5:.3g}-{p95:.3g} nats")
        reasons.append(f"{axis} = {target[axis]:,.0f} lies outside the fitted {lo:,.0f}-{hi:,.0f}, and the fit does "
                       f"not identify the {axis} term {coefficient}/{axis}^{exponent} ({'; '.join(why)})")
    return ("; ".join(reasons) + ", so the law cannot say how the loss moves along that axis. "
            + identifying_sweep(record, n_params if "N" in refused else None, tokens if "D" in refused else None))


def recipe_base(record: dict) -> RunConfig:
    """A run config with the fitted runs' recipe and vocabulary: the base of the sweep that made them."""
    base = RunConfig()
    base.model.vocab_size = base.tokenizer.vocab_size = record.get("vocab_size", base.tokenizer.vocab_size)
    for key, value in (record.get("recipe") or {}).items():
        if key != "schedule":
            setattr(base.train, key, value)
    return base


def identifying_sweep(record: dict, n_params: float | None, tokens: float | None) -> str:
    """The runs `scale sweep` would add to reach N and D: its IsoFLOP grid at the smallest C (doubling
    from 1e10) whose largest model reaches n_params (or the ladder's largest) and whose longest run
    reaches tokens; and whether this corpus holds that much text within REPEAT_EPOCHS passes."""
    base = recipe_base(record)
    top = max(map(non_embedding_params, ladder(base)))
    flops = 1e10
    while True:
        grid = choose_models(base, flops)
        if (n_params is None or max(map(non_embedding_params, grid)) >= min(n_params, top)) and \
                (tokens is None or flops / min(map(flops_per_token, grid)) >= tokens):
            break
        flops *= 2
    runs = ", ".join(f"{c.model.name} (N {non_embedding_params(c) / 1e6:.3g}M, D {flops / flops_per_token(c):.2g})"
                     for c in grid)
    text = (f"What would identify it: the runs `trainwise scale sweep` trains when its minutes buy C = {flops:.2g} "
            f"FLOPs per model: {runs}")
    if n_params is not None and n_params > top:
        text += " (the sweep's ladder ends there: for larger models, fit runs of them with `trainwise scale fit`)"
    unique = record.get("corpus_train_tokens")
    longest = flops / min(map(flops_per_token, grid))
    if unique and longest > REPEAT_EPOCHS * unique:
        text += (f". That is {longest / unique:,.0f} passes over this corpus's {unique:,} training tokens, past the "
                 f"{REPEAT_EPOCHS} the sweep allows: it needs more text"
                 + (f", e.g. --data {STDLIB_CORPUS} (the standard library's source, ~12 MB)"
                    if not str(record.get("corpus", "")).startswith(STDLIB_CORPUS) else ""))
    return text + "."


def repetition_note(record: dict, tokens: float) -> str | None:
    """A warning when D is many passes over the corpus: the law has no term for repeated tokens.
    Muennighoff et al. 2023 ("Scaling Data-Constrained Language Models") found up to ~4 epochs nearly
    as good as unique data, and fast-diminishing returns after; a small model may also overfit."""
    unique = record.get("corpus_train_tokens")
    if not unique or tokens <= REPEAT_EPOCHS * unique:
        return None
    return (f"D = {tokens / unique:.1f} passes over the corpus's {unique:,} training tokens. Beyond ~{REPEAT_EPOCHS} "
            "passes repeated tokens are worth less than new ones (Muennighoff et al. 2023) and small models "
            "overfit; the law has no term for that, so it predicts too low a loss. Use more text.")


def law_of(record: dict) -> Law:
    return Law(**record["law"])


def bootstrap_of(record: dict) -> Bootstrap:
    b = record["bootstrap"]
    return Bootstrap(b["unit"], [Law(*values) for values in b["laws"]])


def predict(record: dict, cfg: RunConfig, tokens: float, refuse: bool = True) -> dict:
    """The law's final validation loss for model cfg trained on `tokens` tokens, with the bootstrap's
    5-95% interval, and where N and D lie relative to the fitted points (extrapolation is said). Refuses
    (TrainwiseError) to extrapolate along an axis the fit does not identify; with refuse=False the
    reason is returned as "not_identified" instead."""
    if tokens <= 0:
        raise TrainwiseError(f"--tokens {tokens} must be positive (e.g. 2e6).")
    n = non_embedding_params(cfg)
    why = refusal(record, n, tokens)
    if why and refuse:
        raise TrainwiseError(f"no prediction for {cfg.model.name} on {tokens:.4g} tokens: {why}")
    law = law_of(record)
    lo, hi = bootstrap_of(record).predict_interval(n, tokens)
    (n_lo, n_hi), (d_lo, d_hi) = fitted_ranges(record).values()
    return {"model": cfg.model.name, "n_params": n, "tokens": float(tokens), "loss": float(law.loss(n, tokens)),
            "loss_p5_p95": [lo, hi], "n_range_fitted": [n_lo, n_hi], "d_range_fitted": [d_lo, d_hi],
            "extrapolates": not (n_lo <= n <= n_hi and d_lo <= tokens <= d_hi), "not_identified": why,
            "recipe": record.get("recipe"), "conventions": record["conventions"],
            "repetition_note": repetition_note(record, tokens)}


def n_beyond_fitted(record: dict, n_params: float) -> float | None:
    """How many times the largest fitted model's N a planned N is, when it is larger (else None)."""
    largest = max((r["n_params"] for r in record.get("runs", [])), default=None)
    return n_params / largest if largest and n_params > largest else None


def optimal(record: dict, flops: float, base: RunConfig | None = None, widths=OPTIMAL_WIDTHS) -> dict:
    """Compute-optimal N and D for C FLOPs. Two answers: the closed form for C = 6ND (Hoffmann et al.
    eq. 4), and the one this command plans: the best model of the sweep's shape family (`widths`,
    default OPTIMAL_WIDTHS) when each is trained on D = C / its exact per-token FLOPs (cost/flops.py:
    the LM head and attention included, which 6N leaves out and which dominate small models), among
    those whose D stays within REPEAT_EPOCHS passes over the fit's corpus (the data-constrained
    optimum: past them the law overrates repeated tokens); when none does, the best of all, with a note."""
    if flops <= 0:
        raise TrainwiseError(f"--flops {flops} must be positive (e.g. 1e15).")
    law = law_of(record)
    base = base or RunConfig()
    if record.get("recipe"):
        r = record["recipe"]
        for key in ("micro_batch", "seq_len", "grad_accum_steps", "lr", "min_lr", "warmup_steps", "eval_steps"):
            setattr(base.train, key, r[key])
    candidates = []
    for cfg in ladder(base, widths, train={}):
        fpt = flops_per_token(cfg)
        d = flops / fpt
        if d >= cfg.train.tokens_per_step:
            candidates.append((float(law.loss(non_embedding_params(cfg), d)), cfg, d, fpt))
    unique = record.get("corpus_train_tokens")
    within = [c for c in candidates if not unique or c[2] <= REPEAT_EPOCHS * unique]
    best = min(within or candidates, key=lambda c: c[0], default=None)
    if best is None:
        raise TrainwiseError(f"--flops {flops:.3g} buys less than one optimizer step of the smallest model; give more.")
    loss, cfg, d, fpt = best
    why = refusal(record, non_embedding_params(cfg), d)
    if why:
        raise TrainwiseError(f"--flops {flops:.3g}: the law's optimum is {cfg.model.name} (N = "
                             f"{non_embedding_params(cfg):,}) on {d:.3g} tokens, but {why}")
    unconstrained = min(candidates, key=lambda c: c[0])
    n6, d6 = law.optimal_6nd(flops)
    at_edge = cfg.model.d_model in (min(widths), max(widths))
    cfg.train.max_steps = max(1, round(d / cfg.train.tokens_per_step))
    return {"flops": float(flops), "convention": "exact per-token FLOPs (cost/flops.py), C = flops_per_token x D",
            "model": cfg.model.name, "d_model": cfg.model.d_model, "n_layers": cfg.model.n_layers,
            "n_params": non_embedding_params(cfg), "tokens": float(d), "flops_per_token": fpt,
            "loss": loss, "at_edge_of_family": at_edge, "config": cfg, "repetition_note": repetition_note(record, d),
            "data_bound": None if unconstrained is best else {  # what more text would let it choose
                "model": unconstrained[1].model.name, "tokens": unconstrained[2], "loss": unconstrained[0],
                "passes": unconstrained[2] / unique},
            "max_passes": REPEAT_EPOCHS, "n_beyond_fitted": n_beyond_fitted(record, non_embedding_params(cfg)),
            "six_nd": {"n_params": float(n6), "tokens": float(d6), "loss": float(law.loss(n6, d6)),
                       "convention": "C = 6ND, closed form (Hoffmann et al. 2022, eq. 4)"}}


def plan_prediction(model, tokens: float, data_cfg=None) -> dict | None:
    """For `trainwise plan`: the stored fit's predicted loss for this model and D on its corpus (the
    built-in one unless data_cfg says otherwise), or None when no fit is stored for that corpus and vocab."""
    found = find_fit(data_cfg or DataConfig(), model.vocab_size)
    if found is None:
        return None
    path, record = found
    cfg = RunConfig()
    cfg.model = model
    out = predict(record, cfg, tokens, refuse=False)
    refused = out["not_identified"] is not None  # no number where `scale predict` gives none
    return {"loss": None if refused else out["loss"], "loss_p5_p95": None if refused else out["loss_p5_p95"],
            "extrapolates": out["extrapolates"],
            "fit": str(path), "corpus": record.get("corpus"), "recipe": out["recipe"],
            "repetition_note": out["repetition_note"], "not_identified": out["not_identified"]}
