"""`trainwise scale fit | predict | optimal | sweep`: a thin layer over trainwise.scale."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from trainwise import rundir
from trainwise.commands.args import plot_file, positive_number, whole_number
from trainwise.config import DataConfig, RunConfig, load_config
from trainwise.cost.run import Machine, Run
from trainwise.cost.time import DEFAULT_MFU
from trainwise.errors import TrainwiseError
from trainwise.files import write_atomic
from trainwise.planner.derivation import plan_table
from trainwise.planner.plan import plan_run
from trainwise.presets import get_preset
from trainwise.scale.fitting import (
    fit_runs,
    identification_of,
    law_of,
    optimal,
    predict,
)
from trainwise.scale.law import Form
from trainwise.scale.plot import fit_chart
from trainwise.scale.store import find_fit, load_fit_file, save_fit, stored_fits
from trainwise.scale.sweep import SWEEP_DATA, run_sweep, sweep_base
from trainwise.tokenizer import Tokenizer

EXAMPLES = f"""examples:
  trainwise scale sweep --minutes 20                      # IsoFLOP grid on {SWEEP_DATA[0]}, then fit
  trainwise scale fit runs/scale-sweep/*/ --plot fit.png  # fit finished runs (stored per corpus+tokenizer)
  trainwise scale fit runs/demo-*/ --form alpha=beta      # a reduced form, when the data are short
  trainwise scale predict --model trainwise-small --tokens 4e6
  trainwise scale optimal --flops 1e14

The sweep and, without --data, predict and optimal use {SWEEP_DATA[0]}: the standard library's own
source (~12 MB, code-heavy), big enough for a sweep to identify the law; `trainwise train` keeps the
small built-in corpus (CPython's reference docs) as its default.
"""
FORM_HELP = ("full (default: E, A, B, alpha, beta), alpha=beta (one exponent), or E=VALUE (E held, nats/token): "
             "the reduced forms fit fewer parameters when the data cannot identify all five")


def register(sub_parsers, help_text: str) -> None:
    p = sub_parsers.add_parser("scale", help=help_text, epilog=EXAMPLES,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", metavar="<action>")
    sub.required = True

    f = sub.add_parser("fit", help="fit the law to the validation curves of finished runs")
    f.add_argument("runs", nargs="+", metavar="RUN")
    f.add_argument("--points", choices=["auto", "final", "all"], default="auto",
                   help="auto: every validation row of constant-LR runs, the final row of decaying ones")
    f.add_argument("--bootstrap", type=int, default=100, help="bootstrap refits for the uncertainty (default 100)")
    f.add_argument("--form", default="full", help=FORM_HELP)
    f.add_argument("--plot", type=plot_file, metavar="FILE.png", help="write the chart of the fit")
    f.add_argument("--json", action="store_true", help="print the fit record as JSON")
    f.set_defaults(func=cmd_fit)

    for name, helptext in (("predict", "the expected final validation loss of a planned run"),
                           ("optimal", "compute-optimal N and D for a FLOP budget, and the plan for them")):
        q = sub.add_parser(name, help=helptext)
        if name == "predict":
            q.add_argument("--model", required=True, help="preset name or trainwise TOML (its [data] picks the fit)")
            q.add_argument("--tokens", type=positive_number,
                           help="training tokens D (default: a TOML's max_steps x tokens/step)")
        else:
            q.add_argument("--flops", type=positive_number, required=True, help="compute budget C in FLOPs")
            q.add_argument("--gpu", default="cpu", help="hardware of the plan (default: this CPU, measured)")
            q.add_argument("--peak-flops", type=positive_number, help="peak FLOP/s per device (overrides --gpu)")
            q.add_argument("--mfu", type=positive_number,
                           help="model FLOP utilisation of the plan (default the planner's)")
        q.add_argument("--data", nargs="+", metavar="PATH",
                       help=f"corpus of the fit (default: {SWEEP_DATA[0]}, the sweep's)")
        q.add_argument("--vocab-size", type=whole_number,
                       help="tokenizer vocab size of the fit (default 4096 or the TOML's)")
        q.add_argument("--fit", metavar="FIT.json", help="a fit file instead of the stored fit of the corpus")
        q.add_argument("--json", action="store_true")
        q.set_defaults(func=cmd_predict if name == "predict" else cmd_optimal)

    s = sub.add_parser("sweep", help="train a small IsoFLOP grid inside a time budget, then fit it")
    s.add_argument("--minutes", type=positive_number, required=True, help="wall-time budget of the training, minutes")
    s.add_argument("--data", nargs="+", metavar="PATH",
                   help=f"corpus (default: {SWEEP_DATA[0]}, the standard library's source, ~12 MB of mostly code)")
    s.add_argument("--out", help="directory for the runs (default runs/scale-sweep-DATE-TIME); "
                   "one that holds a stopped sweep: continue it")
    s.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override the base config (lr, vocab)")
    s.add_argument("--form", default="full", help=FORM_HELP)
    s.add_argument("--plot", type=plot_file, metavar="FILE.png", help="write the chart of the fit")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_sweep)


def _store(record: dict, runs: list[str]) -> Path:
    first = Path(runs[0])
    return save_fit(record, load_config(first / rundir.CONFIG).data, Tokenizer.load(first / rundir.TOKENIZER))


def cmd_fit(args: argparse.Namespace) -> int:
    record = fit_runs(args.runs, points=args.points, samples=args.bootstrap, form=Form.parse(args.form))
    return _finish_fit(record, [r["run_dir"] for r in record["runs"]], args)


def _finish_fit(record: dict, runs: list[str], args) -> int:
    path = _store(record, runs)
    record["stored"] = str(path)
    if args.plot:
        _plot(record, args.plot)
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        print(format_fit(record))
    return 0


def _plot(record: dict, out: str) -> None:
    import numpy as np

    groups = [(r["name"], r.get("seed"), np.array([[r["n_params"], d, l] for d, l in r["points"]]))
              for r in record["runs"]]
    write_atomic(out, fit_chart(groups, law_of(record)))
    print(f"plot: {out}")


def format_fit(record: dict) -> str:
    law, boot = record["law"], record["bootstrap"]
    ident = identification_of(record)
    form = record.get("form", "full")
    lines = ["L(N, D) = E + A / N^alpha + B / D^beta   (Hoffmann et al. 2022 approach 3: Huber(delta=1e-3) on log L,"
             " L-BFGS from a grid of starts)" + ("" if form == "full" else f"; reduced form {form}"),
             f"  N = {record['conventions']['N']}; D = tokens; L = validation loss in nats/token",
             f"  {'':<6} {'fit':>12} {'5%':>12} {'95%':>12}   ({boot.get('method', 'bootstrap over ' + boot['unit'])}, "
             f"{boot['samples']} refits)"]
    for k in ("E", "A", "B", "alpha", "beta"):
        lo, hi = boot["p5_p95"][k]
        p = ident["parameters"][k]
        verdict = "held by the form" if p["identified"] is None else \
            "identified" + (f" ({p['why']})" if p["why"] else "") if p["identified"] else f"NOT IDENTIFIED: {p['why']}"
        lines.append(f"  {k:<6} {law[k]:>12.4g} {lo:>12.4g} {hi:>12.4g}   {verdict}")
    t = ident["terms"]
    for axis, name in (("N", "N term A/N^alpha"), ("D", "D term B/D^beta")):
        term = t[axis]
        if "level" in term:
            p5, p95 = term["level_p5_p95"]
            lines.append(f"  {name} at {axis} = {term['at']:.3g} (the fitted range's centre): {term['level']:.3g} nats "
                         f"({p5:.3g}-{p95:.3g}): {'identified' if term['level_identified'] else 'NOT IDENTIFIED'}")
    lines.append(f"  the loss over the fitted points spans {t['loss'][0]:.4f}-{t['loss'][1]:.4f} nats/token; "
                 f"each term's range over them, as a share of that span: N term {t['N']['share_of_range']:.0%} "
                 f"({t['N']['min']:.3g}-{t['N']['max']:.3g} nats), D term {t['D']['share_of_range']:.0%} "
                 f"({t['D']['min']:.3g}-{t['D']['max']:.3g}); E = {t['E']:.3g} is constant")
    unknown = [axis for axis, ok in ident["axes"].items() if not ok]
    if unknown:
        lines.append(f"  the points do not identify the {' and '.join(unknown)} term: "
                     f"`scale predict` and `scale optimal` will not extrapolate along {' or '.join(unknown)} "
                     f"beyond the fitted runs ({ident['rule']})")
    if ident["parameters"]["E"]["identified"] is False:
        lines.append("  E is not identified: the law's floor is not known, and predictions far beyond the fitted runs "
                     "carry that")
    res = record["residuals"]
    lines.append(f"  {res['points']} points from {len(record['runs'])} runs; "
                 f"fit vs observed: rms {res['rms_relative']:.2%}, max {res['max_abs_relative']:.2%}")
    for r in record["runs"]:
        label = Path(r["run_dir"]).name
        label += "" if label == r["name"] else f" ({r['name']})"  # a seed's directory names its model
        lines.append(f"    {label} N={r['n_params']:,}: {r['used']}")
    if record.get("recipe"):
        r = record["recipe"]
        lines.append(f"  recipe (predictions hold for runs trained this way): {r['schedule']} LR {r['lr']:g}"
                     f" (min {r['min_lr']:g}), warmup {r['warmup_steps']}, micro_batch {r['micro_batch']} x grad_accum "
                     f"{r['grad_accum_steps']} x seq_len {r['seq_len']}")
    lines.append(f"stored: {record.get('stored')}")
    return "\n".join(lines)


def _record(args, vocab_size: int | None, data_cfg: DataConfig) -> dict:
    if args.fit:
        return load_fit_file(args.fit)
    vocab = args.vocab_size or vocab_size or 4096
    found = find_fit(data_cfg, vocab)
    if found is None:
        others = "; ".join(f"{path} ({record.get('corpus')}, vocab {record.get('vocab_size')})"
                           for path, record in stored_fits()[:5])
        raise TrainwiseError(
            f"no scaling-law fit is stored for this corpus with a {vocab}-token tokenizer. Fit one with "
            "`trainwise scale sweep --minutes 20` (or `trainwise scale fit RUN...` on finished runs of this "
            "corpus), or pass --fit FILE.json" + (f" (stored fits: {others})." if others else "."))
    return found[1]


def _base(args) -> tuple[RunConfig, dict]:
    """The run config from --model (preset or TOML) and --data; and its [train] length in tokens if known."""
    cfg, extra = RunConfig(), {}
    model = getattr(args, "model", None)
    if model and model.endswith(".toml"):
        cfg = load_config(model)
        extra["tokens"] = cfg.train.max_steps * cfg.train.tokens_per_step
    elif model:
        cfg.model = get_preset(model)
    if args.data:
        cfg.data.paths = list(args.data)
    elif not (model and model.endswith(".toml")):
        cfg.data.paths = list(SWEEP_DATA)
    if args.vocab_size:
        cfg.model.vocab_size = cfg.tokenizer.vocab_size = args.vocab_size
    return cfg, extra


def cmd_predict(args: argparse.Namespace) -> int:
    cfg, extra = _base(args)
    tokens = args.tokens or extra.get("tokens")
    if tokens is None:
        raise TrainwiseError("give --tokens D, the training tokens of the planned run (e.g. 4e6).")
    record = _record(args, cfg.model.vocab_size, cfg.data)
    out = predict(record, cfg, tokens)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    lo, hi = out["loss_p5_p95"]
    print(f"{out['model']}: N = {out['n_params']:,} non-embedding parameters, D = {out['tokens']:.4g} tokens")
    print(f"predicted final validation loss: {out['loss']:.4f} nats/token (bootstrap 5-95%: {lo:.4f} - {hi:.4f})")
    if out["extrapolates"]:
        print(f"note: outside the fitted points (N {out['n_range_fitted'][0]:,}-{out['n_range_fitted'][1]:,}, "
              f"D {out['d_range_fitted'][0]:.3g}-{out['d_range_fitted'][1]:.3g}): an extrapolation"
              + ("; the fit does not identify E, the law's floor" if identification_of(record)["parameters"]["E"][
                  "identified"] is False else ""))
    if out["repetition_note"]:
        print(f"warning: {out['repetition_note']}")
    if out["recipe"]:
        print(f"for a run trained like the fitted ones: {out['recipe']['schedule']} LR {out['recipe']['lr']:g}, "
              f"micro_batch {out['recipe']['micro_batch']} x seq_len {out['recipe']['seq_len']}")
    return 0


def cmd_optimal(args: argparse.Namespace) -> int:
    base, _ = _base(args)
    out = optimal(_record(args, base.model.vocab_size, base.data), args.flops, base)
    cfg = out.pop("config")
    machine = Machine(gpu=None if args.peak_flops else args.gpu, peak_flops=args.peak_flops)
    plan = plan_run(replace(Run.of(cfg, "bf16"), tokens=out["tokens"], machine=machine), mfu=args.mfu or DEFAULT_MFU)
    out["plan"] = plan.to_json()
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    s = out["six_nd"]
    print(f"compute-optimal for C = {out['flops']:.4g} FLOPs ({out['convention']}):")
    print(f"  {out['model']} (d_model {out['d_model']}, {out['n_layers']} layers): "
          f"N = {out['n_params']:,} non-embedding parameters, D = {out['tokens']:.4g} tokens "
          f"({out['tokens'] / out['n_params']:.1f} tokens/parameter), predicted loss {out['loss']:.4f} nats/token")
    if out["repetition_note"]:
        print(f"  warning: {out['repetition_note']}")
    if out["data_bound"]:
        b = out["data_bound"]
        print(f"  bound by the corpus: with unlimited text {b['model']} on {b['tokens']:.4g} tokens would be best "
              f"(law: {b['loss']:.4f}), but that is {b['passes']:.1f} passes over it; this choice stays within "
              f"{out['max_passes']}")
    if out["n_beyond_fitted"] and out["n_beyond_fitted"] > 2:
        print(f"  warning: N is {out['n_beyond_fitted']:.0f}x the largest fitted model's: the law has not seen such "
              f"models, and on repeated tokens extra parameters buy less than it says (Muennighoff et al. 2023); "
              f"train a sweep of larger models, or use more text")
    if out["at_edge_of_family"]:
        print("  note: the best model is at the edge of the searched shape family; the true optimum lies beyond it")
    print(f"  closed form for C = 6ND: N = {s['n_params']:.4g}, D = {s['tokens']:.4g}, loss {s['loss']:.4f} "
          "(6N leaves out the LM head and attention, so it overstates the tokens a small model gets)")
    m, t = cfg.model, cfg.train
    sets = (f"model.d_model={m.d_model} model.n_layers={m.n_layers} model.n_heads={m.n_heads} "
            f"model.n_kv_heads={m.n_kv_heads} train.max_steps={t.max_steps} train.micro_batch={t.micro_batch} "
            f"train.seq_len={t.seq_len} train.lr={t.lr:g} train.min_lr={t.min_lr:g} "
            f"train.warmup_steps={t.warmup_steps} train.eval_steps={t.eval_steps}")
    print("\ntrain it with the fitted runs' recipe: trainwise train" + "".join(f" --set {s}" for s in sets.split()))
    print("\nplan:")
    print(plan_table(plan))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    form = Form.parse(args.form)  # before the minutes are spent
    base = sweep_base(list(args.set or []) + (["data.paths=" + json.dumps(args.data)] if args.data else []))
    out = Path(args.out or time.strftime("runs/scale-sweep-%Y%m%d-%H%M%S"))
    runs = run_sweep(args.minutes, out, base, say=(lambda *a: None) if args.json else print)
    dirs = [str(r.run_dir) for r in runs]
    record = fit_runs(dirs, form=form)
    record["sweep"] = {"minutes": args.minutes, "runs": [{"run_dir": str(r.run_dir), "tokens": r.tokens,
                                                           "predicted_s": r.predicted_s, "measured_s": r.measured_s,
                                                           "mfu_probe": r.mfu} for r in runs]}
    return _finish_fit(record, dirs, args)
