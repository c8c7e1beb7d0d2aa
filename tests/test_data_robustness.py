"""Data robustness at scale: many tiny files, a huge single-line file in bounded memory, and a corpus
too small for one sequence refused by the CLI. (Invalid UTF-8, NUL bytes and a 1 MB line are in
test_data.py.)"""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from trainwise.config import DataConfig
from trainwise.data.corpus import prepare_data
from trainwise.data.sources import discover_files

# Peak RSS a 16 MB and a 64 MB single-line file add on top of the imports: ~90-105 MiB each (tokenizer
# batches of ~1M characters, HF Encoding objects, the id list); 300 MB leaves room for allocator noise.
RSS_BUDGET_MIB = 300


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("n_files", [10_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_many_tiny_files_are_one_document_each(tmp_path, tok, n_files):
    """Measured on 2 shared cores: 10,000 files take 0.6-1.5 s to create and ~4 s in all; 100,000 take
    5-28 s to create (file-system load) and 24-53 s in all, hence slow."""
    root = tmp_path / "many"
    start = time.perf_counter()
    for i in range(n_files):
        sub = root / f"{i // 1000:03d}"
        if i % 1000 == 0:
            sub.mkdir(parents=True)
        with open(sub / f"{i:06d}.txt", "w", encoding="utf-8") as f:
            f.write(f"doc {i} ok")
    print(f"created {n_files:,} files in {time.perf_counter() - start:.1f} s")
    cfg = DataConfig(paths=[str(root)])
    files = discover_files(cfg.paths)
    assert len(files) == n_files

    data = prepare_data(cfg, tok, seq_len=8)
    assert not data.cache_hit
    assert data.stats.files == data.stats.documents == n_files
    stream = np.concatenate([data.train, data.val])
    assert int((stream == tok.eot_id).sum()) == n_files  # one end-of-text per file, none lost or merged
    texts = [f"doc {i} ok" for i in range(n_files)]  # sorted paths = numeric order here
    assert data.stats.tokens == sum(len(ids) for ids in tok.encode_batch(texts)) + n_files
    first = stream[: int(np.argmax(stream == tok.eot_id))].tolist()
    assert tok.decode(first) == "doc 0 ok"
    assert prepare_data(cfg, tok, seq_len=8).cache_hit


CHILD = """
import json, sys
from trainwise.config import DataConfig
from trainwise.data.corpus import prepare_data
from trainwise.tokenizer import Tokenizer

def hwm_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024

tok = Tokenizer.load(sys.argv[2])
baseline = hwm_mib()
data = prepare_data(DataConfig(paths=[sys.argv[1]]), tok, seq_len=64)
print(json.dumps({"baseline_mib": baseline, "peak_mib": hwm_mib(), "stats": data.stats.__dict__}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("size_mb", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_single_line_file_is_prepared_in_bounded_memory(tmp_path, tok, size_mb):
    """Measured (2 shared cores): 16 MB: +86 to +103 MiB over a 224-237 MiB baseline, ~5 s;
    64 MB: +94 to +104 MiB, ~16 s. The peak does not grow with the file: it is streamed."""
    chunk = ("the cat sat on a mat and the dog ran far 中文 " * 1000).encode("utf-8")  # no newline anywhere
    path = tmp_path / "one_line.txt"
    with open(path, "wb") as f:
        for _ in range(-(-size_mb * 2**20 // len(chunk))):
            f.write(chunk)
    tok_path = tmp_path / "tok.json"
    tok.save(tok_path)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(tok_path)], capture_output=True, text=True,
                          env={**os.environ, "TRAINWISE_CACHE": str(tmp_path / "cache")}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = result["peak_mib"] - result["baseline_mib"]
    print(f"{size_mb} MB single line: baseline {result['baseline_mib']:.0f} MiB, peak {result['peak_mib']:.0f} MiB "
          f"(+{grew:.0f})")
    assert grew < RSS_BUDGET_MIB
    stats = result["stats"]
    assert stats["documents"] == 1 and stats["replaced_bytes"] == 0
    assert stats["bytes"] == path.stat().st_size


def test_corpus_smaller_than_one_sequence_exits_2_and_writes_no_run(tmp_path):
    (tmp_path / "tiny.txt").write_text("a few words of text, far fewer than one sequence of 256 tokens.\n")
    env = {**os.environ, "TRAINWISE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "trainwise", "train", "--data", "tiny.txt"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    counts = re.search(r"'tiny.txt'\) has (\d+) tokens: (\d+) for training and (\d+) for validation", message)
    assert counts, message
    total, n_train, n_val = map(int, counts.groups())
    assert 0 < total == n_train + n_val < 257 and "seq_len + 1 = 257" in message
    assert not (tmp_path / "runs").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "tiny.txt"]
