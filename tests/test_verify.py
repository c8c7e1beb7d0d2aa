"""Every train run writes verify.json with errors for FLOPs, memory and step time; verify recomputes it."""

import json

import pytest

from trainwise.cli import main
from trainwise.config import RunConfig, apply_overrides
from trainwise.trainer.loop import train

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32",
        "train.seq_len=32", "train.micro_batch=4", "tokenizer.vocab_size=300", "train.eval_every=0",
        "train.log_every=2", "train.warmup_steps=2", "train.sample_tokens=5", "train.precision=fp32",
        "train.checkpoint_every=0", "train.max_steps=4"]


@pytest.fixture(autouse=True)
def cache(isolated_cache):
    return isolated_cache


def test_train_writes_verify_json(tmp_path, capsys, monkeypatch):
    from pydoc_data.topics import topics

    from trainwise.trainer import report

    monkeypatch.setattr(report, "PROBE_MIN_RUN_S", 0.0)  # the speed probe runs after runs of 30 s; this one too

    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n\n".join(topics[k] for k in sorted(topics))[:30_000], encoding="utf-8")
    out = tmp_path / "run"
    cfg = apply_overrides(RunConfig(), TINY + [f"data.paths=['{corpus}']"])
    train(cfg, out=out, quiet=True)
    v = json.loads((out / "verify.json").read_text())
    for key in ("flops_per_step", "peak_memory_bytes", "step_time_s", "mfu"):
        assert set(v[key]) == {"predicted", "measured", "error"}
    assert set(v["memory_bytes"]) == {"params", "grads", "optimizer", "activations"}
    assert abs(v["flops_per_step"]["error"]) < 0.01
    assert abs(v["memory_bytes"]["params"]["error"]) < 0.01
    assert abs(v["peak_memory_bytes"]["error"]) < 0.10
    assert v["step_time_s"]["error"] is not None and v["device"] and v["notes"]
    # the calibration's reference steps timed again after the run: the machine's speed beside the error
    speed = v["machine_speed"]
    assert speed["error"] == pytest.approx(speed["measured"] / speed["predicted"] - 1)
    assert len(speed["per_reference_s"]) == 5 and all(t > 0 for t in speed["per_reference_s"])
    assert speed["per_reference_s"][3] > speed["per_reference_s"][0]  # the d_model 192 step does more than d 16
    assert main(["verify", str(out)]) == 0
    table = capsys.readouterr().out
    assert "FLOPs / step" in table and "MiB" in table and "%" in table
    assert "machine speed: the calibration's reference steps" in table  # kept by `trainwise verify`
