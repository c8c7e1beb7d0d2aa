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

    from trainwise.trainer import accounting as report

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
    # a verify.json that is not the trainer's: one error naming the file, exit 2, the file left as it was
    (out / "verify.json").write_text("{'not': json}")
    assert main(["verify", str(out)]) == 2
    assert "is not the verify.json `trainwise train` writes" in " ".join(capsys.readouterr().err.split())
    assert (out / "verify.json").read_text() == "{'not': json}"
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.toml").write_bytes((out / "config.toml").read_bytes())
    for where, said in ((tmp_path / "none", "is not a run directory (no such folder)"),
                        (unfinished, "holds a run without verify.json, which `trainwise train` writes at the end")):
        assert main(["verify", str(where)]) == 2
        assert said in " ".join(capsys.readouterr().err.split())
    # sampling settings out of range: refused before the checkpoint loads, every one named
    bad = ["--temperature", "nan", "--top-k", "-3", "--top-p", "1.5", "--seed", str(10**30)]
    assert main(["sample", str(out), *bad]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert all(f"{flag}) = {value} must be" in err for flag, value in (("--temperature", "nan"), ("--top-k", "-3"),
                                                                         ("--top-p", "1.5"), ("--seed", 10**30)))
    # the speed probe at the start: the prediction for the machine as probed, an entry of the same form
    probed = v["step_time_probed_s"]
    assert probed["measured"] == v["step_time_s"]["measured"] and len(probed["probe"]["now_s"]) == 5
    assert probed["error"] == pytest.approx(probed["measured"] / probed["predicted"] - 1)
    assert "as probed" in table and "speed probe" in table  # "speed probes at the start and the end" if it moved
    start = json.loads((out / "plan.json").read_text())["time"]["probe"]  # the plan's: the start probe
    if probed["probe"]["at"] == start["at"]:  # the start reading stood
        assert start["step_seconds"] == pytest.approx(probed["predicted"])
    else:  # read more than PROBE_WARN away at the start, nearer the calibration at the end: the end's counts
        assert probed["probe"]["readings"][0] == pytest.approx(start["ratio"])
        assert abs(probed["probe"]["ratio"] - 1) < abs(start["ratio"] - 1)


def test_a_machine_far_from_its_calibration_is_said_so_with_both_predictions(tmp_path, capsys, cache):
    """The calibration's reference steps recorded four times as fast as this machine runs them: the speed probe
    finds the machine about 4x slower, and the plan before the run and the closing table give the prediction for
    the machine as probed beside the calibrated one, with both errors. The reference steps are timed here,
    just before the run, and quartered: the session's calibration may be minutes old, and this machine's speed
    moves by a fifth within minutes (halved, a probe once read 1.28: the run's probes 1.56x faster than this
    timing, so the assertions below keep a margin of more than that)."""
    from pydoc_data.topics import topics

    import torch

    from trainwise.measure.reference import reference_speed

    now = reference_speed(torch.device("cpu"))
    entries = json.loads((cache / "calibration.json").read_text())
    for entry in entries.values():
        if "profile" in entry:
            entry["profile"]["probe_baseline_s"] = [t / 4 for t in now]
            entry.pop("busy", None)  # a quiet one: a busy calibration would be measured again in the run, probes too
    (cache / "calibration.json").write_text(json.dumps(entries))
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n\n".join(topics[k] for k in sorted(topics))[:30_000], encoding="utf-8")
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), *[a for kv in TINY + [f"data.paths=['{corpus}']"] for a in ("--set", kv)]]
    assert main(argv) == 0
    text = capsys.readouterr().out
    v = json.loads((out / "verify.json").read_text())
    probe = v["step_time_probed_s"]["probe"]
    assert probe["ratio"] > 1.5  # this machine against a calibration four times its speed
    assert len(probe["readings"]) == 2 and min(probe["readings"]) > 1.5  # at the start and, to confirm, the end
    assert "speed probes at the start and the end read" in text
    assert v["step_time_probed_s"]["predicted"] > 1.3 * v["step_time_s"]["predicted"]
    warning = "more than 15% away from its calibration"
    assert text.count(warning) == 2  # the plan before the run and the closing table
    assert "as probed" in text
    assert json.loads((cache / "calibration.json").read_text())  # the probe is kept with the calibration
    last = [e["last_probe"] for e in json.loads((cache / "calibration.json").read_text()).values() if "last_probe" in e]
    assert last and last[0]["ratio"] == pytest.approx(probe["readings"][-1])  # the last one taken: at the end


def test_a_slow_start_that_the_end_does_not_confirm_leaves_the_calibrated_prediction():
    """The closing table's probe line: slow by 20% at the start and at the end, the probed prediction is the
    one to read; slow at the start only (a VM's slow spell), the end's reading counts and the calibrated
    prediction stands, and the line says why."""
    from trainwise.cost.steptime import StepTime, probed_seconds, settled_probe
    from trainwise.verify.verify import probe_line

    step = StepTime(seconds=1.0, compute_s=0.8, overhead_s=0.2, comm_s=0.0, ops=[], source="calibrated",
                    compiled=False)

    def reading(ratio: float, at: str) -> dict:
        return {"ratio": ratio, "overhead_ratio": ratio, "kernel_ratio": ratio, "at": at}

    start = reading(1.2, "start")
    for end, moved in ((reading(1.22, "end"), True), (reading(1.03, "end"), False)):
        settled = settled_probe(start, end)
        seconds = probed_seconds(step, settled)
        text = probe_line({**settled, "step_seconds": seconds}, step.seconds)
        assert "speed probes at the start and the end read +20.0%" in text
        if moved:
            assert seconds == pytest.approx(1.2) and "read the probed prediction" in text
        else:
            assert seconds == 1.0 and "the calibrated speed stands" in text and "probed prediction (" not in text
