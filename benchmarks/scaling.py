"""Does a scaling law fitted on a short sweep predict a bigger run? (issue 18, point 3)

1. `trainwise scale sweep`: an IsoFLOP grid on the built-in corpus inside --minutes (default 10, the
   issue allows up to 20), sized by the planner with each model's measured MFU, no run past 4 passes
   over the corpus (on the built-in one that bound, not the minutes, sets C); then the fit.
2. A held-out run at 4x the sweep's largest compute: the compute-optimal model of the sweep's shape
   ladder for that budget according to the fit, within 4 passes over the corpus (`scale optimal`,
   restricted to the ladder's widths so the run stays a few minutes), trained with the sweep's recipe.
3. The law's prediction, made before the held-out run starts, against its measured final val loss: the
   mean over --seeds seeds (default 3), each seed's printed too.

    PYTHONPATH=. python benchmarks/scaling.py --minutes 10 --out /tmp/scaling-bench 2>&1 | tee scaling.log

Prints the CPU model and the load; writes the fit chart and a JSON summary into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from trainwise.config import RunConfig
from trainwise.hardware.cache import cpu_model
from trainwise.commands.scale import _plot, format_fit
from trainwise.scale.fitting import fit_runs, optimal, predict
from trainwise.scale.points import non_embedding_params
from trainwise.scale.store import save_fit
from trainwise.scale.sweep import EVALS_PER_RUN, SWEEP_WIDTHS, flops_per_token, ladder_config, run_sweep
from trainwise.tokenizer import Tokenizer
from trainwise.trainer.loop import train


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--out", default="/tmp/scaling-bench")
    ap.add_argument("--factor", type=float, default=4.0, help="held-out compute / the sweep's largest")
    ap.add_argument("--seeds", type=int, default=3,
                    help="train the held-out run with this many seeds (the default's first): at this scale one "
                         "run's final loss moves by a few percent with the seed, the law predicts their mean")
    args = ap.parse_args()
    out = Path(args.out)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average at start {load()}; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")

    t0 = time.perf_counter()
    runs = run_sweep(args.minutes, out / "sweep", RunConfig())
    sweep_s = time.perf_counter() - t0
    dirs = [str(r.run_dir) for r in runs]
    record = fit_runs(dirs, samples=100)
    first = Path(dirs[0])
    record["stored"] = str(save_fit(record, RunConfig().data, Tokenizer.load(first / "tokenizer.json")))
    _plot(record, str(out / "fit.png"))
    print(f"\nsweep: {sweep_s / 60:.1f} min wall (budget {args.minutes:g}), load average now {load()}")
    print(f"{'model':<15} {'N (non-emb)':>12} {'D tokens':>11} {'C FLOPs':>10} {'pred s':>7} {'meas s':>7} {'val loss':>9}")
    for r in runs:
        final = record["runs"][dirs.index(str(r.run_dir))]["points"][-1][1]
        print(f"{r.config.model.name:<15} {non_embedding_params(r.config):>12,} {r.tokens:>11,} "
              f"{r.tokens * flops_per_token(r.config):>10.3g} {r.predicted_s:>7.0f} {r.measured_s:>7.0f} {final:>9.4f}")
    print(format_fit(record))

    c_top = max(r.tokens * flops_per_token(r.config) for r in runs)
    held = optimal(record, args.factor * c_top, RunConfig(), widths=SWEEP_WIDTHS)
    cfg = ladder_config(RunConfig(), held["d_model"], held["n_layers"])  # the sweep's recipe, exactly
    cfg.train.max_steps = held["config"].train.max_steps
    cfg.train.eval_every = max(1, cfg.train.max_steps // EVALS_PER_RUN)
    tokens = cfg.train.max_steps * cfg.train.tokens_per_step
    pred = predict(record, cfg, tokens)
    lo, hi = pred["loss_p5_p95"]
    print(f"\nheld-out: C = {args.factor:g} x {c_top:.3g} = {args.factor * c_top:.3g} FLOPs -> {cfg.model.name}, "
          f"N = {pred['n_params']:,}, D = {tokens:,} ({cfg.train.max_steps} steps)")
    if held["data_bound"]:
        b = held["data_bound"]
        print(f"(bound by the corpus: the law alone would pick {b['model']} on {b['tokens']:,.0f} tokens, "
              f"{b['passes']:.1f} passes over it; the choice stays within {held['max_passes']})")
    print(f"predicted before training: {pred['loss']:.4f} nats/token (bootstrap 5-95%: {lo:.4f}-{hi:.4f})"
          + ("; extrapolated" if pred["extrapolates"] else ""))
    t1 = time.perf_counter()
    seeds = [cfg.train.seed] + list(range(1, args.seeds))
    losses = []
    for seed in seeds:
        cfg.train.seed = seed
        losses.append(train(cfg, out=out / f"heldout-{cfg.model.name}-seed{seed}", quiet=True).val_loss)
        print(f"  seed {seed}: final val loss {losses[-1]:.4f} nats/token (prediction error {pred['loss'] / losses[-1] - 1:+.2%})")
    held_s = time.perf_counter() - t1
    measured = sum(losses) / len(losses)
    error = pred["loss"] / measured - 1
    print(f"measured: {measured:.4f} nats/token, mean of {len(seeds)} seeds (spread {min(losses):.4f}-{max(losses):.4f}, "
          f"{(max(losses) - min(losses)) / measured:.1%}), after {held_s / 60:.1f} min; prediction error "
          f"{error:+.2%} ({'within' if abs(error) <= 0.03 else 'OUTSIDE'} 3%); load average now {load()}")
    summary = {"cpu": cpu_model(), "minutes": args.minutes, "sweep_s": sweep_s, "held_s": held_s,
               "fit": {k: record[k] for k in ("law", "residuals", "recipe")},
               "bootstrap_p5_p95": record["bootstrap"]["p5_p95"],
               "sweep": [{"model": r.config.model.name, "n_params": non_embedding_params(r.config), "tokens": r.tokens,
                          "predicted_s": r.predicted_s, "measured_s": r.measured_s} for r in runs],
               "heldout": {"model": cfg.model.name, "n_params": pred["n_params"], "tokens": tokens,
                           "flops": args.factor * c_top, "predicted": pred["loss"], "p5_p95": [lo, hi],
                "data_bound": held["data_bound"], "passes": tokens / record["corpus_train_tokens"],
                           "seeds": seeds, "losses": losses, "measured": measured, "error": error}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(f"summary: {out / 'summary.json'}; chart: {out / 'fit.png'}")


if __name__ == "__main__":
    main()
