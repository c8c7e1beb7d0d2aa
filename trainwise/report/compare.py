"""`trainwise compare RUN RUN... [--out FILE.html]`: runs side by side, on one self-contained page and
in a terminal table.

The page: loss against tokens and against model FLOPs (so a bigger model is charged for its compute),
tokens/s and MFU, memory by category, the plan's predictions against what each run measured, and the
config keys whose values differ between the runs, highlighted. It reads each run directory only
(metrics.jsonl, plan.json, verify.json, config.toml), with the charts and tables of report.html.
"""

from __future__ import annotations

import html
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from trainwise import rundir
from trainwise.config import config_to_dict, load_config
from trainwise.errors import TrainwiseError
from trainwise.files import write_atomic
from trainwise.report import plots
from trainwise.report.html import CSS, _error_cell, _img, _json, _si, fmt_value

VERIFY_KEYS = ("flops_per_step", "peak_memory_bytes", "step_time_s", "mfu")
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations")
COMPARE_CSS = """
td.diff{background:#fef3c7;font-weight:600}
.pvm td:nth-child(2),.pvm th:nth-child(2){text-align:left}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px}
"""


@dataclass
class RunData:
    name: str
    path: Path
    config: dict[str, object]  # "section.key" -> value, from config.toml
    rows: list[dict]  # metrics.jsonl rows with a loss, each with "flops" (cumulative model FLOPs) added
    plan: dict | None
    verify: dict | None

    def summary(self) -> dict:
        """The run's numbers in SI base units (bytes, FLOPs, seconds), None where the run lacks them."""
        rows, plan, verify = self.rows, self.plan or {}, self.verify or {}
        evals = [r for r in rows if "val_loss" in r]
        steady = rows[1:] or rows  # the first interval holds warm-up (and compile)
        measured = {k: verify[k].get("measured") for k in VERIFY_KEYS if k in verify}
        return {
            "run": self.name, "path": str(self.path),
            "params": plan.get("model", {}).get("params_total"),
            "steps": rows[-1]["step"] if rows else None,
            "tokens": rows[-1]["tokens"] if rows else None,
            "flops": rows[-1]["flops"] if rows and rows[-1].get("flops") is not None else None,
            "train_loss": rows[-1]["loss"] if rows else None,
            "val_loss": evals[-1]["val_loss"] if evals else None,
            "val_bpb": evals[-1].get("val_bpb") if evals else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if rows else None,
            "mfu": statistics.median(r["mfu"] for r in steady) if rows else None,
            "peak_memory_bytes": measured.get("peak_memory_bytes"),
            "predicted_vs_measured": {k: verify[k] for k in VERIFY_KEYS if k in verify},
            "memory_bytes": verify.get("memory_bytes", {}),
        }


def load_runs(run_dirs: list[str]) -> list[RunData]:
    if len(run_dirs) < 2:
        raise TrainwiseError("compare needs at least two run directories, e.g. `trainwise compare runs/a runs/b`.")
    runs = []
    for raw in run_dirs:
        path = Path(raw)
        if not (path / rundir.CONFIG).is_file():
            raise TrainwiseError(f"'{raw}' is not a trainwise run directory (no config.toml); pass directories "
                                 "that `trainwise train --out DIR` wrote.")
        plan = _json(path / rundir.PLAN)
        flops_per_token = ((plan or {}).get("flops", {}).get("model_flops_per_token")
                           or (plan or {}).get("flops", {}).get("per_token_train"))
        rows = [r for r in rundir.read_metrics(path) if "loss" in r]
        for r in rows:  # model FLOPs spent so far: tokens x FLOPs per token (the planner's count)
            r["flops"] = r["tokens"] * flops_per_token if flops_per_token else None
        sections = config_to_dict(load_config(path / rundir.CONFIG))
        config = {f"{section}.{key}": value for section, values in sections.items() for key, value in values.items()}
        runs.append(RunData(_unique_name(path, runs), path, config, rows, plan, _json(path / rundir.VERIFY)))
    return runs


def _unique_name(path: Path, earlier: list[RunData]) -> str:
    name = path.resolve().name
    taken = {r.name for r in earlier}
    if name in taken:
        name = f"{path.resolve().parent.name}/{name}"
    while name in taken:
        name += "'"
    return name


def differing_keys(runs: list[RunData]) -> list[str]:
    """The config keys whose values are not the same in every run, in config order."""
    keys = list(dict.fromkeys(k for r in runs for k in r.config))
    return [k for k in keys if len({json.dumps(r.config.get(k), sort_keys=True) for r in runs}) > 1]


# ---------------------------------------------------------------------------------------------------
# The page


def _runs_with_rows(runs: list[RunData], need: str | None = None) -> list[tuple[str, list[dict]]]:
    return [(r.name, r.rows) for r in runs if r.rows and (need is None or r.rows[0].get(need) is not None)]


def _summary_table(runs: list[RunData]) -> str:
    head = ("<tr><th>run</th><th>parameters</th><th>steps</th><th>tokens</th><th>model FLOPs</th><th>train loss</th>"
            "<th>val loss</th><th>val bpb</th><th>tokens/s (median)</th><th>MFU (median)</th><th>peak memory</th></tr>")
    body = []
    for r, color in zip(runs, plots.PALETTE * 4):
        s = r.summary()
        num = lambda v, f: "–" if v is None else f(v)  # noqa: E731
        body.append(
            f'<tr><td><span class="swatch" style="background:{color}"></span>{html.escape(r.name)}</td>'
            f"<td>{num(s['params'], _si)}</td><td>{num(s['steps'], lambda v: f'{v:,}')}</td>"
            f"<td>{num(s['tokens'], _si)}</td><td>{num(s['flops'], lambda v: _si(v, 'FLOPs'))}</td>"
            f"<td>{num(s['train_loss'], lambda v: f'{v:.4f}')}</td><td>{num(s['val_loss'], lambda v: f'{v:.4f}')}</td>"
            f"<td>{num(s['val_bpb'], lambda v: f'{v:.4f}')}</td><td>{num(s['tokens_per_s'], _si)}</td>"
            f"<td>{num(s['mfu'], lambda v: f'{v:.2%}')}</td>"
            f"<td>{fmt_value('peak_memory_bytes', s['peak_memory_bytes'])}</td></tr>")
    return (f"<table>{head}{''.join(body)}</table><p class='note'>loss in nats/token (depends on the tokenizer); "
            "bpb = bits per UTF-8 byte of validation text (compares across tokenizers); MB = 10^6 bytes, MiB = 2^20; "
            "medians skip the first logged interval (warm-up).</p>")


def _memory_section(runs: list[RunData]) -> str:
    names, memory, sources = [], [], []
    for r in runs:
        if r.verify and r.verify.get("memory_bytes"):
            memory.append({k: e["measured"] for k, e in r.verify["memory_bytes"].items()})
            sources.append("measured")
        elif r.plan and r.plan.get("memory"):
            memory.append({k: r.plan["memory"].get(f"{k}_bytes", 0) for k in MEMORY_CATEGORIES})
            sources.append("predicted")
        else:
            continue
        peak = (r.verify or {}).get("peak_memory_bytes", {}).get("measured")
        if peak is not None:
            memory[-1]["peak"] = peak
        names.append(r.name)
    if not names:
        return '<p class="note">No run has plan.json or verify.json.</p>'
    categories = list(MEMORY_CATEGORIES) + (["peak"] if any("peak" in m for m in memory) else [])
    if all(s == "measured" for s in sources):
        note = "Measured on one real training step of each run (verify.json)."
    else:
        note = ", ".join(f"{html.escape(n)}: {s}" for n, s in zip(names, sources)) + (
            " (measured: verify.json, one real step; predicted: plan.json, for a run without verify.json).")
    return (_img(plots.runs_memory_chart(names, memory, categories), "memory by category")
            + f'<p class="note">{note} peak = the most memory in use at once during the step.</p>')


def _verify_table(runs: list[RunData]) -> str:
    rows = []
    for r in runs:
        entries = [(k, (r.verify or {}).get(k)) for k in VERIFY_KEYS]
        entries += [(f"memory: {k}", e) for k, e in (r.verify or {}).get("memory_bytes", {}).items()]
        for i, (name, e) in enumerate(entries):
            if e is None:
                continue
            key = name.removeprefix("memory: ")
            run_cell = f"<td>{html.escape(r.name)}</td>" if i == 0 else "<td></td>"
            rows.append(f"<tr>{run_cell}<td>{html.escape(name)}</td><td>{fmt_value(key, e.get('predicted'))}</td>"
                        f"<td>{fmt_value(key, e.get('measured'))}</td>{_error_cell(e.get('error'))}</tr>")
        if r.verify is None:
            rows.append(f"<tr><td>{html.escape(r.name)}</td><td colspan='4' class='note'>no verify.json</td></tr>")
    return ("<table class='pvm'><tr><th>run</th><th>quantity</th><th>predicted (plan)</th><th>measured</th>"
            "<th>error</th></tr>"
            + "".join(rows) + "</table><p class='note'>error = measured / predicted − 1; green within 5 %, "
            "amber within 25 %.</p>")


def _config_table(runs: list[RunData]) -> str:
    keys = differing_keys(runs)
    if not keys:
        return '<p class="note">The runs have the same config.</p>'
    head = "<tr><th>key</th>" + "".join(f"<th>{html.escape(r.name)}</th>" for r in runs) + "</tr>"
    body = []
    for key in keys:
        values = [r.config.get(key) for r in runs]
        first = json.dumps(values[0], sort_keys=True)
        cells = "".join(  # highlighted: every value that differs from the first run's
            f'<td class="{"diff" if json.dumps(v, sort_keys=True) != first else ""}">{html.escape(_show(v))}</td>'
            for v in values)
        body.append(f"<tr><td>{html.escape(key)}</td>{cells}</tr>")
    same = len({k for r in runs for k in r.config}) - len(keys)
    return (f"<table>{head}{''.join(body)}</table><p class='note'>{len(keys)} keys differ (highlighted where a "
            f"value differs from the first run's); {same} keys are the same in every run.</p>")


def _show(value: object) -> str:
    return "–" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def build_compare(runs: list[RunData]) -> str:
    """The HTML text of the compare page."""
    with_flops = _runs_with_rows(runs, need="flops")
    parts = [f"<h1>trainwise compare: {len(runs)} runs</h1>",
             f'<p class="sub">{" · ".join(html.escape(str(r.path.resolve())) for r in runs)} · generated '
             f'{time.strftime("%Y-%m-%d %H:%M")}</p>',
             f"<section><h2>Runs</h2>{_summary_table(runs)}</section>"]
    loss_tokens = (_img(plots.runs_loss_chart(_runs_with_rows(runs), "tokens", "tokens seen"), "loss vs tokens")
                   if _runs_with_rows(runs) else '<p class="note">No run has logged metrics yet.</p>')
    loss_flops = (_img(plots.runs_loss_chart(with_flops, "flops", "model FLOPs (fwd + bwd, plan.json count)"),
                       "loss vs FLOPs") if with_flops else '<p class="note">No run has plan.json and metrics.</p>')
    throughput = (_img(plots.runs_throughput_chart(_runs_with_rows(runs)), "throughput")
                  if _runs_with_rows(runs) else '<p class="note">No run has logged metrics yet.</p>')
    vocabs = {r.config.get("model.vocab_size") for r in runs}
    if len(vocabs) > 1:  # nats per token of different tokenizers are different units
        note = ('<p class="note">The runs have different vocabularies: loss in nats/token does not compare '
                "across them; bits per byte (val bpb above, <code>trainwise eval</code>) does.</p>")
        loss_tokens, loss_flops = loss_tokens + note, loss_flops + note
    parts.append('<div class="grid">'
                 f"<section><h2>Loss vs tokens</h2>{loss_tokens}</section>"
                 f"<section><h2>Loss vs FLOPs</h2>{loss_flops}</section></div>")
    parts.append('<div class="grid">'
                 f"<section><h2>Throughput and MFU</h2>{throughput}</section>"
                 f"<section><h2>Memory by category</h2>{_memory_section(runs)}</section></div>")
    parts.append(f"<section><h2>Plan vs measured</h2>{_verify_table(runs)}</section>")
    parts.append(f"<section><h2>Config differences</h2>{_config_table(runs)}</section>")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>trainwise compare</title><style>{CSS}{COMPARE_CSS}</style></head>"
            f"<body><main>{''.join(parts)}</main></body></html>")


def write_compare(run_dirs: list[str], out: str | Path) -> tuple[Path, list[RunData]]:
    runs = load_runs(run_dirs)
    out = Path(out)
    write_atomic(out, build_compare(runs))
    return out, runs


# ---------------------------------------------------------------------------------------------------
# The terminal


def format_table(runs: list[RunData]) -> str:
    """One column per run: the headline numbers, then the config keys that differ (marked *)."""
    summaries = [r.summary() for r in runs]
    fmt = {"params": lambda v: f"{v:,}", "steps": lambda v: f"{v:,}", "tokens": lambda v: f"{v:,}",
           "flops": lambda v: f"{v:.3e}", "train_loss": lambda v: f"{v:.4f}", "val_loss": lambda v: f"{v:.4f}",
           "val_bpb": lambda v: f"{v:.4f}", "tokens_per_s": lambda v: f"{v:,.0f}", "mfu": lambda v: f"{v:.2%}",
           "peak_memory_bytes": lambda v: f"{v / 2 ** 20:,.2f} MiB"}
    labels = {"params": "parameters", "flops": "model FLOPs (fwd+bwd)", "train_loss": "train loss (nats/token)",
              "val_loss": "val loss (nats/token)", "val_bpb": "val bits/byte", "tokens_per_s": "tokens/s (median)",
              "mfu": "MFU (median)", "peak_memory_bytes": "peak memory (measured)"}
    table = [["", *[s["run"] for s in summaries]]]
    for key, f in fmt.items():
        table.append([labels.get(key, key), *["–" if s[key] is None else f(s[key]) for s in summaries]])
    diffs = differing_keys(runs)
    if diffs:
        table.append(["config keys that differ:", *[""] * len(runs)])
        for key in diffs:
            first = runs[0].config.get(key)
            table.append([f"  {key}", *[_show(r.config.get(key)) + (" *" if r.config.get(key) != first else "")
                                         for r in runs]])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in table]
    return "\n".join(line.rstrip() for line in lines) + ("\n(* differs from the first run)" if diffs else "")
