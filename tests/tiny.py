"""A tiny model and run that train in a fraction of a second per step, for end-to-end tests."""

from pathlib import Path

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32",
        "train.seq_len=32", "tokenizer.vocab_size=300", "train.log_every=1", "train.warmup_steps=2",
        "train.sample_tokens=8", "train.precision=fp32"]


def set_args(corpus: Path, *overrides: str) -> list[str]:
    """`--set k=v` arguments for the CLI: the tiny run on `corpus`, then `overrides`."""
    return [a for kv in [*TINY, f"data.paths=['{corpus}']", *overrides] for a in ("--set", kv)]
