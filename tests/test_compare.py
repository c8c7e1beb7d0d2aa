"""`trainwise compare`: three small real runs side by side, a self-contained page whose every panel
renders in headless Chromium (screenshot checked panel by panel), and a terminal table."""

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from chromium import chromium_command

from trainwise.cli import main
from trainwise.config import RunConfig, apply_overrides
from trainwise.errors import TrainwiseError
from trainwise.trainer.loop import train

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32",
        "train.seq_len=32", "train.micro_batch=4", "tokenizer.vocab_size=300", "train.eval_every=4",
        "train.eval_steps=2", "train.log_every=2", "train.warmup_steps=2", "train.sample_tokens=8",
        "train.precision=fp32", "train.checkpoint_every=100", "train.max_steps=8"]
VARIANTS = {"base": [], "wide": ["model.d_model=48", "model.n_heads=6", "model.n_kv_heads=3"],
            "ckpt": ["train.activation_checkpointing=full", "train.micro_batch=8", "log.wandb=true"]}
PANELS = ("Runs", "Loss vs tokens", "Loss vs FLOPs", "Throughput and MFU", "Memory by category", "Plan vs measured",
          "Config differences")
IMAGES = ["loss vs tokens", "loss vs FLOPs", "throughput", "memory by category"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> list[Path]:
    root = tmp_path_factory.mktemp("compare")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")  # no network: W&B keeps the run on disk
    mp.setenv("WANDB_SILENT", "true")
    for name, extra in VARIANTS.items():
        train(apply_overrides(RunConfig(), TINY + extra + [f"data.paths=['{corpus}']"]), out=root / name, quiet=True)
    mp.undo()
    return [root / name for name in VARIANTS]


@pytest.fixture(scope="module")
def page(runs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("page") / "compare.html"
    assert main(["compare", *map(str, runs), "--out", str(out)]) == 0
    return out


def test_page_has_every_panel_and_is_self_contained(page):
    text = page.read_text(encoding="utf-8")
    for panel in PANELS:
        assert f"<h2>{panel}</h2>" in text, panel
    images = re.findall(r'<img alt="([^"]+)" src="([^"]+)"', text)
    assert [alt for alt, _ in images] == IMAGES
    assert all(src.startswith("data:image/png;base64,") for _, src in images)
    assert not re.search(r'(src|href)="(https?:)?//', text)
    for name in VARIANTS:
        assert f"{name}</td>" in text
    # the keys that differ, highlighted where they differ from the first run; a shared key is not listed
    diff_rows = dict(re.findall(r"<tr><td>([a-z_]+\.[a-z_]+)</td>(.*?)</tr>", text))
    assert {"model.d_model", "model.n_heads", "train.micro_batch", "train.activation_checkpointing"} <= set(diff_rows)
    assert "train.seq_len" not in diff_rows and "model.n_layers" not in diff_rows
    assert re.findall(r'<td class="([a-z]*)">', diff_rows["model.d_model"]) == ["", "diff", ""]
    assert re.findall(r'<td class="([a-z]*)">', diff_rows["train.micro_batch"]) == ["", "", "diff"]


def test_terminal_table_and_json(runs, tmp_path, capsys):
    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "c.html")]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in VARIANTS) and "val bits/byte" in out and "MiB" in out
    assert re.search(r"model\.d_model\s+32\s+48 \*\s+32", out)
    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "c.html"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in data["runs"]] == list(VARIANTS)
    base, wide, _ = data["runs"]
    assert wide["params"] > base["params"] and wide["flops"] > base["flops"] and base["tokens"] == wide["tokens"]
    assert all(r["val_bpb"] > 0 and r["peak_memory_bytes"] > 0 for r in data["runs"])
    assert data["config_differs"]["model.d_model"] == [32, 48, 32]
    assert main(["compare", str(runs[0])]) == 2  # one run: a message, no traceback
    assert main(["compare", str(runs[0]), str(tmp_path)]) == 2  # not a run directory


def test_every_panel_renders_in_headless_chromium(page, tmp_path):
    import matplotlib.image
    import numpy as np

    text = page.read_text(encoding="utf-8")
    # After load, a script writes into the title how many images decoded, the page height, and where
    # each panel (section) and image lies on the page, in CSS pixels.
    probe = ("<script>window.addEventListener('load', () => { const box = e => { const r = e.getBoundingClientRect(); "
             "return [Math.round(r.left), Math.round(r.top + scrollY), Math.round(r.width), Math.round(r.height)]; }; "
             "const imgs = [...document.images]; document.title = JSON.stringify({"
             "ok: imgs.filter(i => i.complete && i.naturalWidth > 0).length, n: imgs.length, "
             "height: document.documentElement.scrollHeight, "
             "sections: [...document.querySelectorAll('section')].map(s => [s.querySelector('h2').textContent, "
             "box(s)]), "
             "images: imgs.map(i => [i.alt, box(i)])}); });</script>")
    probed = tmp_path / "probe.html"
    probed.write_text(text.replace("</body>", probe + "</body>"), encoding="utf-8")
    flags = chromium_command(tmp_path / "profile", "--force-device-scale-factor=1", "--window-size=1280,1000")
    dom = subprocess.run(flags + ["--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120).stdout
    title = re.search(r"<title>(.*?)</title>", dom)
    layout = json.loads(html.unescape(title.group(1)))
    assert layout["ok"] == layout["n"] == len(IMAGES)
    assert [name for name, _ in layout["sections"]] == list(PANELS)

    shot = tmp_path / "compare.png"
    height = layout["height"]
    subprocess.run(flags[:-1] + [f"--window-size=1280,{height}", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    pixels = matplotlib.image.imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (height, 1280)
    for name, (x, y, w, h) in layout["sections"] + layout["images"]:
        assert w > 100 and h > 40 and y + h <= height, (name, w, h)
        crop = pixels[y:y + h, x:x + w]
        dark = (crop.mean(axis=2) < 0.5).mean()  # text, lines, bars: a drawn panel, not an empty box
        assert crop.std() > 0.05 and dark > 0.002, (name, float(crop.std()), float(dark))
    for name, (x, y, w, h) in layout["images"]:  # each chart holds colored lines or bars (run colors)
        crop = pixels[y:y + h, x:x + w]
        assert (np.ptp(crop, axis=2) > 0.3).mean() > 0.001, name


def test_wandb_offline_run_holds_the_metrics_stream(runs):
    run_dir = runs[2]
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    record = log.read_bytes()  # W&B's record log: protobuf records whose strings are stored as they are
    assert (run_dir / "wandb" / "trainwise-run-id").read_text().encode() in record
    for text in (b"loss/train", b"loss/val", b"bpb/val", b"activation_checkpointing"):  # tags and config
        assert text in record, text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # every logged value, as its JSON text
        assert json.dumps(r["loss"]).encode() in record
        if "val_bpb" in r:
            assert json.dumps(r["val_bpb"]).encode() in record


def test_wandb_missing_is_a_message_before_any_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ImportError
    cfg = apply_overrides(RunConfig(), TINY + ["log.wandb=true"])
    with pytest.raises(TrainwiseError, match="pip install"):
        train(cfg, out=tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()
