"""What `trainwise scale fit | predict | optimal` compute, as functions the CLI and tests call.

A fit record (the JSON stored per corpus + tokenizer) holds the law, its bootstrap refits, the points
and the training recipe of the runs: the law predicts runs trained the same way (same LR schedule,
batch, sequence length), on the same text with the same tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainwise.config import DataConfig, RunConfig
from trainwise.errors import TrainwiseError
from trainwise.scale.law import HUBER_DELTA, PARAM_NAMES, Bootstrap, Law, bootstrap, fit_law
from trainwise.scale.points import REPEAT_EPOCHS, non_embedding_params, read_runs
from trainwise.scale.store import find_fit
from trainwise.scale.sweep import flops_per_token, ladder

N_CONVENTION = "non-embedding parameters (cost/params.py; active parameters for MoE)"
OPTIMAL_WIDTHS = tuple(range(64, 4097, 32))  # the shape family `optimal` searches (sweep.shape)


def recipe_of(cfg: RunConfig, schedule: str) -> dict:
    t = cfg.train
    return {"schedule": schedule, "lr": t.lr, "min_lr": t.min_lr, "warmup_steps": t.warmup_steps,
            "micro_batch": t.micro_batch, "grad_accum_steps": t.grad_accum_steps, "seq_len": t.seq_len,
            "optimizer": t.optimizer, "weight_decay": t.weight_decay,
            "eval_steps": t.eval_steps}  # the validation loss is the mean over these batches


def fit_runs(run_dirs: list[str | Path], points: str = "auto", samples: int = 100, seed: int = 0) -> dict:
    """Fit the law to the runs' validation points; returns the fit record (see the module docstring)."""
    runs = read_runs(run_dirs, points)
    groups = [r.array() for r in runs if len(r.tokens)]
    if sum(map(len, groups)) < 5 and any(r.past_passes for r in runs):
        raise TrainwiseError(
            f"fewer than 5 validation rows within {REPEAT_EPOCHS} passes over the corpus "
            f"({runs[0].unique_tokens:,} training tokens): {'; '.join(f'{r.run_dir}: {r.used}' for r in runs)}. "
            "The law is fitted only where repeated tokens count as new ones: evaluate more often "
            "(train.eval_every), or train on more text.")
    every = np.concatenate(groups) if groups else np.zeros((0, 3))
    law, objective = fit_law(every[:, 0], every[:, 1], every[:, 2])
    boot = bootstrap(groups, law, samples=samples, seed=seed)
    fitted = law.loss(every[:, 0], every[:, 1])
    rel = fitted / every[:, 2] - 1
    recipes = {tuple(sorted(recipe_of(r.config, r.schedule).items())) for r in runs}
    return {
        "law": law.to_json(), "objective": objective, "huber_delta": HUBER_DELTA,
        "bootstrap": {**boot.to_json(), "laws": [[getattr(b, k) for k in PARAM_NAMES] for b in boot.laws]},
        "residuals": {"rms_relative": float(np.sqrt(np.mean(rel ** 2))), "max_abs_relative": float(np.abs(rel).max()),
                      "points": int(len(rel))},
        "conventions": {"N": N_CONVENTION, "D": "tokens seen at the validation row", "L": "validation loss, nats/token"},
        "recipe": dict(recipes.pop()) if len(recipes) == 1 else None,
        "corpus_train_tokens": runs[0].unique_tokens,
        "max_passes": REPEAT_EPOCHS,  # rows past this many passes over the corpus are not fitted
        "runs": [{"run_dir": str(r.run_dir), "name": r.config.model.name, "n_params": r.n_params, "used": r.used,
                  "points": [[float(d), float(l)] for d, l in zip(r.tokens, r.losses)]} for r in runs],
    }


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


def predict(record: dict, cfg: RunConfig, tokens: float) -> dict:
    """The law's final validation loss for model cfg trained on `tokens` tokens, with the bootstrap's
    5-95% interval, and where N and D lie relative to the fitted points (extrapolation is said)."""
    if tokens <= 0:
        raise TrainwiseError(f"--tokens {tokens} must be positive (e.g. 2e6).")
    n = non_embedding_params(cfg)
    law = law_of(record)
    lo, hi = bootstrap_of(record).predict_interval(n, tokens)
    ns = [r["n_params"] for r in record["runs"]]
    ds = [d for r in record["runs"] for d, _ in r["points"]]
    return {"model": cfg.model.name, "n_params": n, "tokens": float(tokens), "loss": float(law.loss(n, tokens)),
            "loss_p5_p95": [lo, hi], "n_range_fitted": [min(ns), max(ns)], "d_range_fitted": [min(ds), max(ds)],
            "extrapolates": not (min(ns) <= n <= max(ns) and min(ds) <= tokens <= max(ds)),
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
    out = predict(record, cfg, tokens)
    return {"loss": out["loss"], "loss_p5_p95": out["loss_p5_p95"], "extrapolates": out["extrapolates"],
            "fit": str(path), "corpus": record.get("corpus"), "recipe": out["recipe"],
            "repetition_note": out["repetition_note"]}
