"""report.html: written at the end of `trainwise train`, self-contained, every section present, every plot
loads in a real browser (headless Chromium); TensorBoard events from the same metrics stream."""

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from chromium import chromium_command

from trainwise.cli import main
from trainwise.config import RunConfig, apply_overrides
from trainwise.trainer.loop import train

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32",
        "train.seq_len=32", "train.micro_batch=4", "tokenizer.vocab_size=300", "train.eval_every=4",
        "train.eval_steps=2", "train.log_every=1", "train.warmup_steps=2", "train.sample_tokens=20",
        "train.precision=fp32", "train.checkpoint_every=100", "train.max_steps=12"]
SECTIONS = ("Loss", "Learning rate", "Throughput and MFU", "Plan vs measured", "Memory by category", "Roofline",
            "Config", "Final sample")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One tiny run with TensorBoard logging on: report.html, sample.txt and events come from train()."""
    from pydoc_data.topics import topics

    tmp = tmp_path_factory.mktemp("report")
    corpus = tmp / "docs.txt"
    corpus.write_text("\n\n".join(topics[k] for k in sorted(topics))[:60_000], encoding="utf-8")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRAINWISE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    cfg = apply_overrides(RunConfig(), TINY + [f"data.paths=['{corpus}']", "log.tensorboard=true"])
    train(cfg, out=tmp / "run", quiet=True)
    mp.undo()
    return tmp / "run"


def test_train_writes_a_self_contained_report(run_dir):
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    for section in SECTIONS:
        assert f"<h2>{section}</h2>" in page, section
    images = re.findall(r'<img alt="([^"]+)" src="([^"]+)"', page)
    assert [alt for alt, _ in images] == ["loss vs tokens", "learning rate", "throughput", "memory by category",
                                          "roofline"]
    assert all(src.startswith("data:image/png;base64,") for _, src in images)
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from the network
    sample = (run_dir / "sample.txt").read_text(encoding="utf-8")
    assert sample and html.escape(sample[:20]) in page
    assert "flops_per_step" in page and "MiB" in page  # plan-vs-measured table, bytes with units


def test_the_roofline_is_drawn_from_the_operators_the_plan_recorded(run_dir, tmp_path, monkeypatch):
    """The report prices the step the run's plan recorded (planner.device_step's memoised record): written again
    in the process that trained, it records nothing, and its roofline is the same chart as the one train() drew."""
    from trainwise.measure import record
    from trainwise.report.html import write_report

    def run(*args, **kwargs):
        raise AssertionError("the report recorded the step again")

    monkeypatch.setattr(record, "_run", run)  # every record of a step on fake tensors goes through it
    again = write_report(run_dir, tmp_path / "report.html").read_text(encoding="utf-8")
    roofline = r'<img alt="roofline" src="([^"]+)"'
    assert re.findall(roofline, again) == re.findall(roofline, (run_dir / "report.html").read_text(encoding="utf-8"))
    assert "Roofline could not be drawn" not in again


def test_tensorboard_logs_the_metrics_stream(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_loss = events.Scalars("loss/train")
    assert [e.step for e in train_loss] == [r["step"] for r in rows]
    assert [e.value for e in train_loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [e.step for e in events.Scalars("loss/val")] == [r["step"] for r in rows if "val_loss" in r]
    assert {"optim/lr", "throughput/tokens_per_s", "throughput/mfu"} <= set(events.Tags()["scalars"])


def test_report_of_a_run_without_verify_or_sample_says_what_is_missing(run_dir, tmp_path, capsys):
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config.toml", "plan.json", "metrics.jsonl"):
        shutil.copy(run_dir / name, partial / name)
    assert main(["report", str(partial), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["report"] == str(partial / "report.html")
    page = (partial / "report.html").read_text(encoding="utf-8")
    assert "No verify.json yet" in page and "No sample.txt" in page and "Predicted only" in page
    assert main(["report", str(tmp_path / "nothing")]) == 2  # not a run directory: a message, no traceback


def test_every_plot_loads_in_headless_chromium(run_dir, tmp_path):
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    # After load, a script writes into the title how many <img> decoded to a non-empty bitmap.
    probe = ("<script>window.addEventListener('load', () => { const imgs = [...document.images]; "
             "const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length; "
             "document.title = `images ${ok}/${imgs.length}`; });</script>")
    probed = tmp_path / "probe.html"
    probed.write_text(page.replace("</body>", probe + "</body>"), encoding="utf-8")
    flags = chromium_command(tmp_path / "profile")
    dom = subprocess.run(flags + ["--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120).stdout
    n = page.count("<img ")
    assert f"<title>images {n}/{n}</title>" in dom, re.findall(r"<title>.*?</title>", dom)

    shot = tmp_path / "report.png"
    subprocess.run(flags + ["--window-size=1280,2600", f"--screenshot={shot}", (run_dir / "report.html").as_uri()],
                   capture_output=True, timeout=120)
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))
    assert pixels.shape[:2] == (2600, 1280)
    assert pixels[..., :3].std() > 0.05  # not a blank page
