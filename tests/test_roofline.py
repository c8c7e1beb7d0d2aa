"""Roofline: operators with FLOPs and bytes, a readable log-log PNG."""

from trainwise.config import ModelConfig
from trainwise.measure.roofline import plot_roofline, roofline_ops, roofline_table


def test_roofline_ops_and_plot(tmp_path):
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16)
    points = roofline_ops(cfg, 2, 16)
    classes = {p.cls for p in points}
    assert {"matmul", "attention", "norm", "activation", "softmax/cross-entropy", "optimizer"} <= classes
    table = roofline_table(points, 1e10, 1e10)
    assert "ridge point" in table and "compute" in table and "memory" in table
    path = tmp_path / "roof.png"
    plot_roofline(points, 1e11, 1e10, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_roofline_measure_cpu(tmp_path):
    """--measure: a real profiled step of a tiny model, each op's achieved FLOP/s beside its bound."""
    import json
    import math

    import pytest

    from trainwise.errors import TrainwiseError
    from trainwise.measure.calibrate import calibrate
    from trainwise.measure.roofline import check_measurable, measure_ops, measured_json, measured_table

    cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
    points = roofline_ops(cfg, 2, 128)
    cal = calibrate("cpu")
    peak, bw = cal["peak_flops"]["fp32"], cal["bandwidth_bytes_per_s"]
    check_measurable(cfg, 2, 128, points, peak, bw)
    measured = measure_ops(cfg, 2, 128, points)
    by_name = {m.point.name: m for m in measured}
    assert "aten.mm" in by_name and any("attention" in n for n in by_name)
    for m in measured:
        assert m.point.flops > 0 and m.time_s > 0 and m.calls > 0
        assert math.isfinite(m.achieved()) and m.achieved() > 0
        assert 0 < m.attainable(peak, bw) <= peak
    mm = by_name["aten.mm"]
    assert mm.point.flops == next(p.flops for p in points if p.name == "aten.mm")  # the counter's FLOPs
    assert mm.achieved() < 1.5 * peak
    table = measured_table(measured, peak, bw)
    assert "achieved FLOP/s" in table and "% bound" in table and "aten.mm" in table
    rows = json.loads(json.dumps(measured_json(measured, peak, bw)))
    assert {r["op"] for r in rows} == set(by_name) and all(r["time_s"] > 0 for r in rows)
    path = tmp_path / "measured.png"
    plot_roofline(points, peak, bw, str(path), measured=measured)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000

    big = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, max_seq_len=2048)
    with pytest.raises(TrainwiseError, match="parameters"):
        check_measurable(big, 1, 2048, [], peak, bw)


def test_the_command_takes_its_sequences_as_plan_does(capsys):
    """--seq-len and --micro-batch not positive: one error naming the flag; a --seq-len past the model's
    context: the model configured to take it, as `trainwise plan` plans it."""
    import json

    from trainwise.cli import main

    base = ["roofline", "--model", "trainwise-small", "--gpu", "h100-sxm"]
    for flag, value in (("--seq-len", "-8"), ("--seq-len", "0"), ("--micro-batch", "0")):
        assert main([*base, flag, value]) == 2
        assert f"{flag} = {value} must be positive" in capsys.readouterr().err
    assert main([*base, "--seq-len", "128", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert main([*base, "--seq-len", "1024", "--json"]) == 0  # past trainwise-small's 256 positions
    long = json.loads(capsys.readouterr().out)
    assert sum(op["flops"] for op in long["ops"]) > 8 * sum(op["flops"] for op in short["ops"])  # attention: more


def test_a_plot_path_that_cannot_be_written_names_the_path_and_the_fix(tmp_path, capsys):
    """The operating system's refusal, with the user's path (not the temporary file written beside it) and what
    to do about it; nothing left behind."""
    from trainwise.cli import main

    base = ["roofline", "--model", "trainwise-small", "--gpu", "h100-sxm", "--plot"]
    (tmp_path / "taken.png").mkdir()
    for path, fix in ((tmp_path / "nowhere" / "roof.png", "Give a path that exists"),
                      (tmp_path / "taken.png", "A folder has that name: give the path of a file")):
        assert main([*base, str(path)]) == 2
        assert f"({path}). {fix}" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["taken.png"] and not any((tmp_path / "taken.png").iterdir())
