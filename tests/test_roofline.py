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
