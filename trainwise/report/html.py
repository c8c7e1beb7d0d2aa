"""`report.html`: one self-contained page about a run (plots embedded as PNG data URIs, no network).

Reads the run directory only (docs/ARCHITECTURE.md, "The run directory"): metrics.jsonl, plan.json, verify.json,
config.toml, sample.txt; every section whose input is missing says so instead of failing, so the
report also works on a run that is still training or was stopped early.
"""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path

from trainwise import rundir
from trainwise.config import load_config
from trainwise.errors import TrainwiseError
from trainwise.files import write_atomic
from trainwise.planner.device_step import cached_step_ops
from trainwise.planner.machine import resolve_hardware
from trainwise.report import plots
from trainwise.measure.roofline import roofline_points

CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;color:#1f2937;background:#f3f4f6;
margin:0;line-height:1.45}
main{max-width:1180px;margin:0 auto;padding:28px 24px 48px}
h1{font-size:26px;margin:0 0 4px}h2{font-size:17px;margin:0 0 12px;color:#111827}
.sub{color:#6b7280;margin:0 0 20px}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(130px,1fr));gap:12px;margin-bottom:18px}
.card{background:#fff;border-radius:10px;padding:12px 14px;box-shadow:0 1px 2px rgba(0,0,0,.06)}
.card .k{font-size:12px;color:#6b7280;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:20px;font-weight:600;margin-top:2px;font-variant-numeric:tabular-nums}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:18px}
section{background:#fff;border-radius:12px;padding:18px 20px;margin-bottom:18px;box-shadow:0 1px 3px rgba(0,0,0,.07)}
img{max-width:100%;height:auto;display:block;margin:0 auto}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums;font-size:14px}
th,td{padding:6px 10px;border-bottom:1px solid #e5e7eb;text-align:right}th{color:#6b7280;font-weight:600}
td:first-child,th:first-child{text-align:left}
.ok{color:#15803d;font-weight:600}.warn{color:#b45309;font-weight:600}.bad{color:#b91c1c;font-weight:600}
pre{background:#0f172a;color:#e2e8f0;padding:14px 16px;border-radius:8px;overflow:auto;font-size:13px;
max-height:460px;white-space:pre-wrap}
.note{color:#6b7280;font-style:italic}
.roof img{max-width:880px}
"""

UNITS = {"flops_per_step": "FLOPs", "peak_memory_bytes": "bytes", "step_time_s": "s", "mfu": ""}


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _img(data: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def _si(x: float, unit: str = "") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".strip()


def fmt_value(key: str, value: float | None) -> str:
    """A number with its unit, as a person reads it: bytes in MB and MiB, MFU in %."""
    if value is None:
        return "–"
    if key == "mfu":
        return f"{value:.2%}"
    if key.endswith("bytes") or key in ("params", "grads", "optimizer", "activations"):
        return f"{value / 1e6:,.2f} MB ({value / 2 ** 20:,.2f} MiB)"
    if key.endswith("_s"):
        return f"{value * 1e3:,.2f} ms" if value < 1 else f"{value:,.2f} s"
    return _si(value, UNITS.get(key, ""))


def _error_cell(err: float | None) -> str:
    if err is None:
        return "<td>–</td>"
    cls = "ok" if abs(err) <= 0.05 else "warn" if abs(err) <= 0.25 else "bad"
    return f'<td class="{cls}">{err:+.1%}</td>'


def verify_table(verify: dict) -> str:
    rows = []
    entries = [(k, verify[k]) for k in ("flops_per_step", "peak_memory_bytes", "step_time_s", "mfu") if k in verify]
    entries += [(f"memory: {k}", v) for k, v in verify.get("memory_bytes", {}).items()]
    for name, e in entries:
        key = name.removeprefix("memory: ")
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{fmt_value(key, e.get('predicted'))}</td>"
                    f"<td>{fmt_value(key, e.get('measured'))}</td>{_error_cell(e.get('error'))}</tr>")
    notes = "".join(f"<li>{html.escape(str(n))}</li>" for n in verify.get("notes", []))
    return ("<table><tr><th>quantity</th><th>predicted (plan)</th><th>measured</th><th>error</th></tr>"
            + "".join(rows) + "</table>"
            + f'<p class="note">device: {html.escape(str(verify.get("device", "?")))}. '
              "error = measured / predicted − 1; green within 5 %, amber within 25 %.</p>"
            + (f"<ul class='note'>{notes}</ul>" if notes else "")
            + (per_rank_table(verify["per_rank"]) if "per_rank" in verify else ""))


def per_rank_table(section: dict) -> str:
    """Each rank's model states and step peak under torchrun against the planner's ZeRO stage (verify.json's
    per_rank; the peak is cost.rank_memory.rank_peak vs the rank's last step, measure.memtrack.StepPeakMeter)."""
    label = {"peak_memory_bytes": "step peak"}
    rows = [f"<tr><td>{rank}</td><td>{html.escape(label.get(name, name))}</td>"
            f"<td>{fmt_value('bytes', e['predicted'])}</td><td>{fmt_value('bytes', e['measured'])}</td>"
            f"{_error_cell(e['error'])}</tr>"
            for rank, entries in enumerate(section["ranks"]) for name, e in entries.items() if "predicted" in e]
    return (f"<h3>Per rank: {html.escape(section['strategy'])} on {section['world_size']} ranks vs the "
            f"ZeRO-{section['zero_stage_planned']} plan</h3>"
            "<table><tr><th>rank</th><th>state</th><th>predicted</th><th>measured</th><th>error</th></tr>"
            + "".join(rows) + "</table>")


def summary_cards(rows: list[dict], plan: dict | None, verify: dict | None) -> str:
    cards = []
    if plan:
        m = plan.get("model", {})
        cards.append(("parameters", _si(m.get("params_total", 0))))
        if m.get("params_active") and m.get("params_active") != m.get("params_total"):
            cards.append(("active / token", _si(m["params_active"])))
    if rows:
        last = rows[-1]
        cards += [("steps", f"{last['step']:,}"), ("tokens", _si(last["tokens"])),
                  ("train loss", f"{last['loss']:.4f}")]
        val = [r["val_loss"] for r in rows if "val_loss" in r]
        if val:
            cards.append(("val loss", f"{val[-1]:.4f}"))
        bpb = [r["val_bpb"] for r in rows if "val_bpb" in r]
        if bpb:  # bits per byte of validation text: compares across tokenizers (trainwise.evaluate)
            cards.append(("val bits/byte", f"{bpb[-1]:.4f}"))
        tps = sorted(r["tokens_per_s"] for r in rows[1:] or rows)
        cards.append(("median tokens/s", _si(tps[len(tps) // 2])))
        mfu = sorted(r["mfu"] for r in rows[1:] or rows)
        cards.append(("median MFU", f"{mfu[len(mfu) // 2]:.2%}"))
    if verify and verify.get("device"):
        cards.append(("device", str(verify["device"])))
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="k">{html.escape(k)}</div><div class="v">{html.escape(v)}</div></div>'
        for k, v in cards) + "</div>"


def roofline_section(run_dir: Path, plan: dict | None, verify: dict | None) -> str:
    """The roofline of one training step of this run's model, on the run's device, or a note why not."""
    try:
        cfg = load_config(run_dir / rundir.CONFIG)
        hw = (plan or {}).get("hardware", {})
        peak = (verify or {}).get("run", {}).get("peak_flops") or hw.get("peak_flops")
        bw = (hw.get("bandwidth_bytes_per_s")
              or resolve_hardware((verify or {}).get("device", "cpu")).bandwidth_bytes_per_s)
        if not peak or not bw:
            return '<p class="note">Roofline: the peak FLOP/s or memory bandwidth of the device is unknown.</p>'
        precision = (verify or {}).get("run", {}).get("precision", "fp32")
        t = cfg.train
        # the eager step's operators as the planner records them, memoised: where the run trained, its plan
        # recorded this step already
        points = roofline_points(cached_step_ops(cfg.model, t.micro_batch, t.seq_len, precision,
                                                 t.activation_checkpointing, False, t.optimizer))
        title = f"{cfg.model.name}: one training step (B={t.micro_batch}, T={t.seq_len}, {precision})"
        return _img(plots.roofline_chart(points, peak, bw, title), "roofline") + (
            f'<p class="note">peak {_si(peak, "FLOP/s")}, bandwidth {_si(bw, "B/s")}; each point is one operator '
            "type at its arithmetic intensity, placed on the roof it can reach at best.</p>")
    except Exception as err:  # the report must not fail for want of one chart  # noqa: BLE001
        return f'<p class="note">Roofline could not be drawn: {html.escape(str(err))}</p>'


def memory_section(plan: dict | None, verify: dict | None) -> str:
    categories = ("params", "grads", "optimizer", "activations")
    if verify and verify.get("memory_bytes"):
        mem = verify["memory_bytes"]
        predicted = {k: mem[k]["predicted"] for k in categories if k in mem}
        measured = {k: mem[k]["measured"] for k in categories if k in mem}
        return _img(plots.memory_chart(predicted, measured), "memory by category")
    if plan and plan.get("memory"):
        predicted = {k: plan["memory"].get(f"{k}_bytes", 0) for k in categories}
        return (_img(plots.memory_chart(predicted, None), "memory by category")
                + '<p class="note">Predicted only: verify.json (measured memory) is not in the run directory yet.</p>')
    return '<p class="note">No plan.json or verify.json in the run directory.</p>'


def build_report(run_dir: str | Path) -> str:
    """The HTML text of the report of `run_dir`."""
    run_dir = Path(run_dir)
    if not (run_dir / rundir.CONFIG).is_file():
        raise TrainwiseError(f"'{run_dir}' is not a trainwise run directory (no config.toml).")
    rows = [r for r in rundir.read_metrics(run_dir) if "loss" in r]
    plan, verify = _json(run_dir / rundir.PLAN), _json(run_dir / rundir.VERIFY)
    name = (plan or {}).get("model", {}).get("name", "run")
    parts = [f"<h1>trainwise report: {html.escape(run_dir.resolve().name)}</h1>",
             f'<p class="sub">model {html.escape(name)} · generated {time.strftime("%Y-%m-%d %H:%M")} '
             f"from {html.escape(str(run_dir.resolve()))}</p>", summary_cards(rows, plan, verify)]
    if rows:
        parts.append('<div class="grid">'
                     f"<section><h2>Loss</h2>{_img(plots.loss_chart(rows), 'loss vs tokens')}</section>"
                     f"<section><h2>Learning rate</h2>{_img(plots.lr_chart(rows), 'learning rate')}</section>"
                     "</div>")
    else:
        parts.append('<section><p class="note">No metrics logged yet (metrics.jsonl is empty).</p></section>')
    throughput = _img(plots.throughput_chart(rows), "throughput") if rows else '<p class="note">No metrics yet.</p>'
    parts.append('<div class="grid">'
                 f"<section><h2>Throughput and MFU</h2>{throughput}</section>"
                 f"<section><h2>Memory by category</h2>{memory_section(plan, verify)}</section></div>")
    table = (verify_table(verify) if verify
             else '<p class="note">No verify.json yet: run <code>trainwise verify DIR</code>.</p>')
    parts.append(f"<section><h2>Plan vs measured</h2>{table}</section>")
    parts.append(f'<section class="roof"><h2>Roofline</h2>{roofline_section(run_dir, plan, verify)}</section>')
    config = (run_dir / rundir.CONFIG).read_text(encoding="utf-8")
    parts.append(f"<section><h2>Config</h2><pre>{html.escape(config)}</pre></section>")
    sample_path = run_dir / rundir.SAMPLE
    sample = (f"<pre>{html.escape(sample_path.read_text(encoding='utf-8'))}</pre>" if sample_path.is_file()
              else '<p class="note">No sample.txt in the run directory.</p>')
    parts.append(f"<section><h2>Final sample</h2>{sample}</section>")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>trainwise report: {html.escape(run_dir.resolve().name)}</title><style>{CSS}</style></head>"
            f"<body><main>{''.join(parts)}</main></body></html>")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report (default DIR/report.html) atomically and return its path."""
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / rundir.REPORT
    text = build_report(run_dir)
    write_atomic(out, text)
    return out
