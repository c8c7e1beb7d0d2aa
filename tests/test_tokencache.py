"""Tokenizing in shards: byte ranges of large files, several processes, and a killed run that the next
run finishes without redoing the shards it had done."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from trainwise.config import DataConfig
from trainwise.data import tokencache
from trainwise.data.corpus import prepare_data
from trainwise.data.formats import Part, iter_documents, split_points
from trainwise.data.sources import sniff
from trainwise.tokenizer import sanitize

WORDS = "the model reads text and learns to predict what comes next in every line of it".split()


def write_corpus(root, n_files=6, lines=400):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        text = "\n".join(" ".join(rng.choice(WORDS, size=12)) + ("。中文" if j % 7 == 0 else "")
                         for j in range(lines))
        (root / f"doc{i}.txt").write_text(text + "\n", encoding="utf-8")
    records = "".join(json.dumps({"text": " ".join(rng.choice(WORDS, size=20))}) + "\n" for _ in range(500))
    (root / "rows.jsonl").write_text(records, encoding="utf-8")
    return root


def stream(data):
    return np.concatenate([data.train, data.val])


def test_split_points_cut_text_before_a_newline_and_jsonl_after_one(tmp_path):
    root = write_corpus(tmp_path / "c", n_files=1)
    text_file, jsonl_file = sniff(root / "doc0.txt"), sniff(root / "rows.jsonl")
    for f, check in ((text_file, lambda raw, p: raw[p:p + 1] == b"\n" and raw[p - 1:p] not in b" \n"),
                     (jsonl_file, lambda raw, p: raw[p - 1:p] == b"\n")):
        raw = f.path.read_bytes()
        points = split_points(f, 4096)
        assert len(points) >= len(raw) // 4096 - 1 and points == sorted(set(points))
        assert all(check(raw, p) for p in points)
        assert [len(s) for s in tokencache.plan_shards([f], 4096)] == [1] * (len(points) + 1)


def test_shards_and_processes_give_the_tokens_of_one_pass(tmp_path, tok, monkeypatch):
    root = write_corpus(tmp_path / "c")
    cfg = DataConfig(paths=[str(root)])
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path / "one"))
    whole = prepare_data(cfg, tok, seq_len=8, shard_bytes=1 << 30)
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path / "many"))
    shards = tokencache.plan_shards([sniff(p) for p in sorted(root.iterdir())], 4096)
    assert len(shards) > 20
    sharded = prepare_data(DataConfig(paths=[str(root)], workers=2), tok, seq_len=8, shard_bytes=4096)
    assert np.array_equal(stream(whole), stream(sharded))
    assert (whole.stats.documents, whole.stats.bytes) == (sharded.stats.documents, sharded.stats.bytes) == \
        (6 + 500, sum(p.stat().st_size for p in root.iterdir()) - 500 * len('{"text": ""}\n'))
    assert not list((tmp_path / "many" / "data").glob("*.partial"))


CHILD = """
import sys
from trainwise.config import DataConfig
from trainwise.data.corpus import prepare_data
from trainwise.tokenizer import Tokenizer
prepare_data(DataConfig(paths=[sys.argv[1]], workers=1), Tokenizer.load(sys.argv[2]), seq_len=8, shard_bytes=2048)
"""


def test_a_killed_tokenization_resumes_with_the_unfinished_shards_only(tmp_path, tok, monkeypatch):
    root = write_corpus(tmp_path / "c", n_files=12)
    tok.save(tmp_path / "tok.json")
    env = {**os.environ, "TRAINWISE_CACHE": str(tmp_path / "cache"), "TOKENIZERS_PARALLELISM": "false"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(tmp_path / "tok.json")], env=env)
    deadline = time.time() + 120
    markers = []
    while time.time() < deadline and len(markers) < 10 and child.poll() is None:
        markers = list((tmp_path / "cache" / "data").glob("*.partial/shards/*.json"))
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    done_before = len(list((tmp_path / "cache" / "data").glob("*.partial/shards/*.json")))
    assert done_before >= 10, "the child finished or stalled before it could be killed mid-way"

    redone = []
    real = tokencache.tokenize_shard
    monkeypatch.setattr(tokencache, "tokenize_shard", lambda *a, **k: redone.append(a[1]) or real(*a, **k))
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path / "cache"))
    resumed = prepare_data(DataConfig(paths=[str(root)], workers=1), tok, seq_len=8, shard_bytes=2048)
    n_shards = len(tokencache.plan_shards([sniff(p) for p in sorted(root.iterdir())], 2048))
    assert len(redone) == n_shards - done_before and min(redone) >= done_before - 1

    monkeypatch.setattr(tokencache, "tokenize_shard", real)  # the pool below pickles it by name
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path / "fresh"))
    fresh = prepare_data(DataConfig(paths=[str(root)]), tok, seq_len=8, shard_bytes=2048)
    assert np.array_equal(stream(resumed), stream(fresh))


def test_a_part_reads_only_its_byte_range(tmp_path):
    from trainwise.data.formats import Reading, iter_pieces

    path = tmp_path / "a.txt"
    path.write_text("one two\nthree four\nfive\n", encoding="utf-8")
    f = sniff(path)
    cut = split_points(f, 5)[0]
    first = [p for p, _ in iter_pieces([Part(f, 0, cut)], "text", 100, Reading())]
    rest = [(p, end) for p, end in iter_pieces([Part(f, cut, None)], "text", 100, Reading())]
    assert "".join(first) + "".join(p for p, _ in rest) == path.read_text()
    assert rest[-1][1] and first[0] == "one two"


def test_the_cache_and_eval_encode_text_alike(tmp_path, tok, monkeypatch):
    """tokencache.encode_pieces is the one path from text to tokens: the cache's stream is eval's after
    its leading end-of-text token, with the same bytes, characters and documents; each document encodes
    as it does whole (cut into ENCODE_CHARS parts and BATCH_CHARS batches), then one end-of-text token."""
    root = tmp_path / "c"
    root.mkdir()
    words = " ".join(WORDS)
    docs = ["naïve 日本語 😀 e\u0301\n\n\n   \t\n" + words + "\r\n\n",
            (words + " ") * 13_000 + "\n" * 3000 + words,  # more than CHUNK_CHARS and BATCH_CHARS
            "lone \ud800 high, \udc01 low, a pair \U0001f600", "déjà vu\n\nnext paragraph"]
    (root / "a.txt").write_text(docs[0], encoding="utf-8")
    (root / "b.txt").write_text(docs[1], encoding="utf-8")
    (root / "c.jsonl").write_text('{"text": "lone \\ud800 high, \\udc01 low, a pair \\ud83d\\ude00"}\n\n'
                                  '{"text": ""}\n{"text": null}\n' + json.dumps({"text": docs[3]}) + "\n",
                                  encoding="utf-8")
    # Runs longer than ENCODE_CHARS are cut inside (formats.rechunk), so this document may encode unlike
    # its whole text; the cache and eval cut it alike.
    (root / "d.txt").write_text("x" * 40_000 + " " * 20_000 + "end", encoding="utf-8")
    assert len(docs[1]) > tokencache.BATCH_CHARS
    cfg = DataConfig(paths=[str(root)])
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path / "cache"))
    data = prepare_data(cfg, tok, seq_len=8)

    stats = tokencache.ShardStats()
    batches = list(tokencache.encode_pieces(iter_documents(cfg), tok, tok.eot_id, stats, leading_eot=True))
    ids = [i for batch in batches for i in batch]
    assert len(batches) > 2 and ids[0] == tok.eot_id and np.array_equal(ids[1:], stream(data))
    whole = [tok.eot_id] + [i for doc in docs for i in tok.encode(doc) + [tok.eot_id]]
    assert ids[:len(whole)] == whole and ids[-1] == tok.eot_id
    text = [sanitize(doc) for doc in docs] + [(root / "d.txt").read_text()]  # a lone surrogate is U+FFFD
    assert (stats.bytes, stats.chars, stats.documents, stats.tokens) == \
        (sum(len(t.encode("utf-8")) for t in text), sum(len(t) for t in text), 5, len(ids))
    assert (data.stats.bytes, data.stats.chars, data.stats.documents) == (stats.bytes, stats.chars, 5)
