"""`trainwise eval`: loss, perplexity and bits per byte of a trained run on any text, against a hand
computation; training logs val_bpb beside val_loss."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from trainwise.api import load
from trainwise.cli import main
from trainwise.config import RunConfig, apply_overrides
from trainwise.data.bpb import token_byte_lengths
from trainwise.evaluate import evaluate_run
from trainwise.trainer.loop import train

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32",
        "train.seq_len=32", "train.micro_batch=4", "tokenizer.vocab_size=300", "train.eval_every=4",
        "train.eval_steps=2", "train.log_every=2", "train.warmup_steps=2", "train.sample_tokens=8",
        "train.precision=fp32", "train.checkpoint_every=100", "train.max_steps=8"]
DOCS = ["The for statement iterates over the items of any sequence, in order.\n",
        "Strings are immutable sequences of Unicode code points: \u00e9t\u00e9, \u65e5\u672c, \U0001f600.",
        "x" * 70]  # a document longer than two windows


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("eval") / "run"
    train(apply_overrides(RunConfig(), TINY + [f"data.paths=['{corpus}']"]), out=out, quiet=True)
    return out


@pytest.fixture
def held_out(tmp_path) -> list[str]:
    """The three documents as one .txt file and a .jsonl of two records."""
    (tmp_path / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[1:]), encoding="utf-8")
    return [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]


def hand_nats(run_dir: Path) -> tuple[float, int]:
    """EOT doc EOT doc EOT doc EOT, cut into windows of seq_len predicted tokens; summed -ln p in float64."""
    run = load(run_dir, device="cpu")
    tok, T = run.tokenizer, run.config.train.seq_len
    stream = [tok.eot_id]
    for doc in DOCS:
        stream += tok.encode(doc) + [tok.eot_id]
    nats = 0.0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, T):
            window = torch.tensor([stream[start:start + T + 1]])
            logits = run.model(window[:, :-1]).double()  # (1, t, V)
            logp = torch.log_softmax(logits, dim=-1)[0]
            nats -= logp.gather(1, window[0, 1:, None]).sum().item()
    return nats, len(stream) - 1


def test_bpb_equals_a_hand_computation(run_dir, held_out):
    result = evaluate_run(run_dir, held_out, device="cpu")
    nats, n_tokens = hand_nats(run_dir)
    n_bytes = sum(len(d.encode("utf-8")) for d in DOCS)
    assert result.bytes == n_bytes and result.tokens == n_tokens and result.documents == 3
    assert result.nats == pytest.approx(nats, rel=1e-5)
    assert result.loss == pytest.approx(nats / n_tokens, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nats / n_tokens), rel=1e-5)
    assert result.bpb == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    assert result.windows == math.ceil(n_tokens / 32)
    assert evaluate_run(run_dir, held_out, device="cpu") == result  # deterministic


def test_token_byte_lengths_add_up_to_the_text(run_dir, corpus):
    tok = load(run_dir, device="cpu").tokenizer
    lengths = token_byte_lengths(tok)
    assert lengths[tok.eot_id] == 0 and (np.delete(lengths, tok.eot_id) > 0).all()
    for text in DOCS + [corpus.read_text(encoding="utf-8")]:
        assert lengths[tok.encode(text)].sum() == len(text.encode("utf-8"))


def test_training_logs_val_bpb(run_dir):
    from trainwise.data.batches import BatchSampler
    from trainwise.data.corpus import prepare_data

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8] and all("val_bpb" in r for r in evals)
    # the same batches as the loop's evaluation; token_byte_lengths is checked against the text above
    run = load(run_dir, device="cpu")
    cfg, tok = run.config, run.tokenizer
    lengths = token_byte_lengths(tok)
    val = prepare_data(cfg.data, tok, cfg.train.seq_len).val
    sampler = BatchSampler(val, cfg.train.micro_batch, cfg.train.seq_len, seed=cfg.train.seed + 1)
    ys = [sampler.next_batch()[1].numpy() for _ in range(cfg.train.eval_steps)]
    n_bytes, n_targets = sum(int(lengths[y].sum()) for y in ys), sum(y.size for y in ys)
    for r in evals:
        assert r["val_bpb"] == pytest.approx(r["val_loss"] * n_targets / math.log(2) / n_bytes, rel=1e-9)
    assert r["val_bpb"] < r["val_loss"] / math.log(2)  # more than one byte per token


def test_eval_cli_json_and_errors(run_dir, held_out, capsys):
    assert main(["eval", str(run_dir), "--data", *held_out, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"loss", "perplexity", "bpb", "tokens", "bytes", "nats"} <= set(out)
    assert main(["eval", str(run_dir), "--data", *held_out]) == 0
    assert "bits per byte" in capsys.readouterr().out
    assert main(["eval", str(run_dir), "--data", *held_out, "--explain"]) == 0
    explained = capsys.readouterr().out
    assert f"/ {out['bytes']:,} = {out['bpb']:.4f} bits/byte" in explained
    assert main(["eval", str(run_dir), "--data", str(run_dir / "missing.txt")]) == 2
    assert main(["eval", str(run_dir.parent), "--data", *held_out]) == 2  # not a run directory
    assert "error" in capsys.readouterr().err


@pytest.mark.slow
def test_bpb_ranks_vocabularies_as_a_longer_training_does(tmp_path):
    """Vocab 1024 vs 4096 on the same corpus: the order by bpb on held-out text after 60 steps is the
    order after 240 (benchmarks/bench_bpb_vocab.py; a few minutes on 2 cores)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_bpb_vocab.py"), "--short-steps", "60",
                           "--long-steps", "240", "--out", str(tmp_path / "runs"), "--json", str(out)],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["consistent"], proc.stdout
    runs = figures["runs"]
    assert all(r["eval_bytes"] == runs[0]["eval_bytes"] for r in runs)  # the same text for every run
    by_vocab = {r["vocab"]: r for r in runs if r["steps"] == 240}
    assert by_vocab[4096]["bytes_per_token"] > by_vocab[1024]["bytes_per_token"]
