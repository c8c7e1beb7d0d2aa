"""Corpus discovery and reading, tokenizing into the cache, the batch sampler, the unigram baseline."""

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

from trainwise.config import DataConfig
from trainwise.data.batches import BatchSampler
from trainwise.data.corpus import prepare_data, prepare_tokenizer, unigram_loss
from trainwise.data.formats import iter_texts, rechunk
from trainwise.data.sources import BUILTIN_CORPUS_DESCRIPTION, discover, discover_files
from trainwise.data.tokencache import token_dtype
from trainwise.errors import TrainwiseError
from trainwise.hardware.cache import cache_root
from trainwise.tokenizer import EOT, Tokenizer


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    """No test may write to ~/.cache."""
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path / "cache"))


def write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def words(n, seed=0):
    rng = np.random.default_rng(seed)
    vocab = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "中文", "😀"]
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), n))


def full_stream(data):
    return np.concatenate([data.train, data.val])


# ---------------------------------------------------------------------------------------------------
# Discovery


def test_discover_dirs_globs_and_files(tmp_path):
    a = write(tmp_path / "corpus" / "a.txt", "alpha")
    b = write(tmp_path / "corpus" / "sub" / "b.md", "beta")
    write(tmp_path / "corpus" / ".git" / "c.txt", "hidden")
    notes = write(tmp_path / "corpus" / "notes.py", "print()")
    d = write(tmp_path / "other" / "d.jsonl", '{"text": "delta"}\n')
    assert discover_files([str(tmp_path / "corpus")]) == [a, notes, b]  # by content: any text file
    assert discover_files([str(tmp_path / "corpus")], exclude=["*.py"]) == [a, b]
    assert discover_files([str(tmp_path / "corpus")], include=["sub/*"]) == [b]
    assert discover_files([str(tmp_path / "**" / "*.jsonl")]) == [d]
    assert discover_files([str(a), str(tmp_path / "corpus")]) == [a, notes, b]  # de-duplicated, order kept


@pytest.mark.parametrize("make, needle", [
    (lambda p: str(p / "missing.txt"), "missing.txt"),
    (lambda p: str(write(p / "empty" / "x.bin", b"\x00x").parent), "all 1 file(s) found are binary"),
    (lambda p: str(p / "nothing" / "*.txt"), "*.txt"),
    (lambda p: str(write(p / "img.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")), "img.txt"),
    (lambda p: str(write(p / "noise.txt", bytes(range(1, 32)) * 50 + b"\xff\xfe" * 300)), "noise.txt"),
])
def test_bad_paths_are_refused_by_name(tmp_path, make, needle):
    with pytest.raises(TrainwiseError, match=None) as err:
        discover_files([make(tmp_path)])
    assert needle in str(err.value)


def test_binary_file_among_text_files_is_skipped_and_counted(tmp_path):
    good = write(tmp_path / "d" / "good.txt", "fine text")
    model = write(tmp_path / "d" / "model.txt", b"\x00\x01\x02weights")
    corpus = discover(DataConfig(paths=[str(tmp_path / "d")]))
    assert [f.path for f in corpus.files] == [good]
    assert corpus.binary == [(model, 10)]
    assert corpus.report()["binary_skipped"] == {"files": 1, "bytes": 10, "examples": [str(model)]}
    with pytest.raises(TrainwiseError, match="model.txt' is a binary file"):  # named by the user: an error
        discover_files([str(model)])


# ---------------------------------------------------------------------------------------------------
# Reading


def test_builtin_corpus_in_sorted_topic_order():
    from pydoc_data.topics import topics

    assert "pydoc_data" in BUILTIN_CORPUS_DESCRIPTION
    assert list(iter_texts(DataConfig())) == [topics[k] for k in sorted(topics) if topics[k]]


def test_jsonl_with_custom_text_field(tmp_path):
    write(tmp_path / "d.jsonl", '{"body": "first"}\n\n{"body": "second", "id": 2}\n')
    assert list(iter_texts(DataConfig(paths=[str(tmp_path / "d.jsonl")], text_field="body"))) == ["first", "second"]


@pytest.mark.parametrize("line, needle", [
    ('{"text": "ok"}\n{"body": "x"}\n', "line 2 has no 'text' field"),
    ('{"text": "ok"}\n{"text": "x"\n', "line 2 is not valid JSON"),
    ('{"text": 3}\n', "line 1: field 'text' is int"),
    ('["text"]\n', "line 1 has no 'text' field"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, line, needle):
    path = write(tmp_path / "bad.jsonl", line)
    with pytest.raises(TrainwiseError) as err:
        list(iter_texts(DataConfig(paths=[str(path)])))
    assert "bad.jsonl" in str(err.value) and needle in str(err.value)


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": ["row one", "row two 中文"], "n": [1, 2]}), path)
    assert list(iter_texts(DataConfig(paths=[str(path)], text_field="content"))) == ["row one", "row two 中文"]
    with pytest.raises(TrainwiseError, match="d.parquet.*no column 'text'.*content"):
        list(iter_texts(DataConfig(paths=[str(path)])))


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    path = write(tmp_path / "d.parquet", b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(TrainwiseError, match="d.parquet.*needs pyarrow.*pip install pyarrow"):
        list(iter_texts(DataConfig(paths=[str(path)])))


def test_long_line_is_read_in_whitespace_cut_chunks(tmp_path):
    text = words(250_000)  # about 1 MB on a single line
    path = write(tmp_path / "line.txt", text)
    assert path.stat().st_size > 1_000_000
    pieces = list(iter_texts(DataConfig(paths=[str(path)]), chunk_chars=10_000))
    assert len(pieces) > 80 and max(map(len, pieces)) <= 10_000
    assert "".join(pieces) == text
    assert all(p.startswith(" ") for p in pieces[1:])  # cut just before a space


def test_rechunk_cuts_where_whitespace_starts():
    assert list(rechunk(["x" * 25], 10)) == ["x" * 10, "x" * 10, "x" * 5]
    assert list(rechunk(["ab", "c d", "ef"], 3)) == ["abc", " de", "f"]
    assert list(rechunk(["one two  \n three"], 12)) == ["one two", "  \n three"]
    assert list(rechunk([" " * 30], 10)) == [" " * 9, " " * 9, " " * 9, " " * 3]


def test_invalid_utf8_is_replaced_and_counted(tmp_path, tok):
    # 3 bad bytes; the 3-byte character 中 straddles chunk borders with chunk_chars=4. So short a file is
    # as likely a legacy code page as damaged UTF-8: the encoding is forced.
    path = write(tmp_path / "bad.txt", b"ab\xffcd \xe4\xb8\xad\xfe\xfe ok")
    cfg = DataConfig(paths=[str(path)], val_fraction=0.3, encoding="utf-8")
    assert "".join(iter_texts(cfg, chunk_chars=4)) == "ab\ufffdcd 中\ufffd\ufffd ok"
    data = prepare_data(cfg, tok, seq_len=1, chunk_chars=4)
    assert data.stats.replaced_bytes == 3


# ---------------------------------------------------------------------------------------------------
# Tokenizing and caching


def test_prepare_data_tokens_split_and_eot(tmp_path, tok):
    docs = [words(3000, seed=1), words(2000, seed=2)]
    cfg = DataConfig(paths=[str(write(tmp_path / "a.txt", docs[0])), str(write(tmp_path / "b.md", docs[1]))],
                     val_fraction=0.1)
    data = prepare_data(cfg, tok, seq_len=32)
    stream = full_stream(data)
    assert data.train.dtype == np.uint16 and isinstance(data.train, np.memmap)
    assert len(data.val) == int(len(stream) * 0.1) and len(data.train) + len(data.val) == data.stats.tokens
    assert tok.decode(stream.tolist()) == docs[0] + EOT + docs[1] + EOT
    s = data.stats
    assert (s.files, s.documents, s.replaced_bytes) == (2, 2, 0)
    assert s.bytes == sum(len(d.encode()) for d in docs)
    assert data.eot_id == tok.eot_id and data.vocab_size == tok.vocab_size


def test_small_chunks_give_the_same_tokens(tmp_path, tok):
    rng = np.random.default_rng(5)
    seps = rng.choice([" ", "  ", "   ", "\n", "\n\n", " \n", "\t"], size=20_000, p=[.7, .05, .05, .1, .05, .03, .02])
    text = "".join(w + sep for w, sep in zip(words(20_000).split(" "), seps))
    cfg = DataConfig(paths=[str(write(tmp_path / "a.txt", text))])
    data = prepare_data(cfg, tok, seq_len=8, chunk_chars=1000)
    assert tok.decode(full_stream(data).tolist()) == text + EOT
    # Cutting just before a space does not change how GPT-2's pre-tokenizer splits the text.
    assert full_stream(data).tolist() == tok.encode(text) + [tok.eot_id]


def test_token_dtype_choice(tmp_path, tok):
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    big = Tokenizer.load(_saved(tok, tmp_path))
    big.vocab_size = 70_000  # pretend: only the file's dtype depends on it
    text = words(500)
    cfg = DataConfig(paths=[str(write(tmp_path / "a.txt", text))])
    data = prepare_data(cfg, big, seq_len=8, cache_root=tmp_path / "other_cache")
    assert data.train.dtype == np.uint32
    assert full_stream(data).tolist() == tok.encode(text) + [tok.eot_id]


def _saved(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    return path


def test_cache_hit_then_miss_when_a_file_changes(tmp_path, tok):
    path = write(tmp_path / "a.txt", words(2000))
    cfg = DataConfig(paths=[str(path)])
    first = prepare_data(cfg, tok, seq_len=16)
    assert not first.cache_hit and str(first.path).startswith(str(cache_root()))
    mtime = os.stat(first.path / "tokens.bin").st_mtime_ns
    second = prepare_data(cfg, tok, seq_len=16)
    assert second.cache_hit and second.path == first.path and second.stats == first.stats
    assert os.stat(first.path / "tokens.bin").st_mtime_ns == mtime
    # A different val_fraction reuses the tokens: the split is only an offset.
    other = prepare_data(DataConfig(paths=[str(path)], val_fraction=0.2), tok, seq_len=16)
    assert other.cache_hit and len(other.val) > len(first.val)

    write(path, words(2000, seed=9) + " changed")
    third = prepare_data(cfg, tok, seq_len=16)
    assert not third.cache_hit and third.path != first.path
    assert not [p for p in third.path.parent.iterdir() if p.name.startswith(".tmp")]


def test_corpus_too_small_for_one_sequence(tmp_path, tok):
    cfg = DataConfig(paths=[str(write(tmp_path / "short.txt", words(100)))])
    with pytest.raises(TrainwiseError) as err:
        prepare_data(cfg, tok, seq_len=512)
    message = str(err.value)
    assert "short.txt" in message and "seq_len + 1 = 513" in message and "smaller train.seq_len" in message


def test_empty_corpus_is_refused_and_leaves_no_cache_entry(tmp_path, tok):
    write(tmp_path / "d" / "a.txt", "")
    write(tmp_path / "d" / "b.jsonl", '{"text": ""}\n')
    cfg = DataConfig(paths=[str(tmp_path / "d")])
    with pytest.raises(TrainwiseError, match="contains no text"):
        prepare_data(cfg, tok, seq_len=8)
    assert list((cache_root() / "data").iterdir()) == []


def test_a_tokenizer_is_not_trained_on_a_corpus_without_text(tmp_path, capsys):
    """`tokenizer train` on empty files was a tokenizer of the 257 byte tokens, saved and cached as if trained."""
    from trainwise.cli import main

    write(tmp_path / "d" / "a.txt", "")
    write(tmp_path / "d" / "b.jsonl", '{"text": ""}\n')
    with pytest.raises(TrainwiseError, match="contains no text"):
        prepare_tokenizer(DataConfig(paths=[str(tmp_path / "d")]), 300)
    assert not (cache_root() / "tokenizers").exists() or list((cache_root() / "tokenizers").iterdir()) == []
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--data", str(tmp_path / "d" / "a.txt"), "--out", str(out)]) == 2
    assert "contains no text" in capsys.readouterr().err and not out.exists()


def test_prepare_tokenizer_is_cached_and_deterministic(tmp_path):
    cfg = DataConfig(paths=[str(write(tmp_path / "a.txt", words(5000)))])
    first = prepare_tokenizer(cfg, 300)
    cached = list((cache_root() / "tokenizers").iterdir())
    assert len(cached) == 1
    again = prepare_tokenizer(cfg, 300)
    assert again.fingerprint() == first.fingerprint() == Tokenizer.train(iter_texts(cfg), 300).fingerprint()
    assert first.vocab_size <= 300


def test_builtin_corpus_end_to_end(tok):
    data = prepare_data(DataConfig(), tok, seq_len=64)
    assert data.stats.files == 0 and data.stats.documents >= 70 and data.stats.bytes > 400_000
    assert unigram_loss(data) < math.log(tok.vocab_size)


# ---------------------------------------------------------------------------------------------------
# Sampling and the unigram baseline


def test_sampler_windows_are_slices_and_y_is_x_shifted():
    tokens = np.arange(1000, dtype=np.uint16)
    sampler = BatchSampler(tokens, micro_batch=4, seq_len=16, seed=3)
    expected_offsets = np.random.Generator(np.random.PCG64(3)).integers(0, 1000 - 16, size=4)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    for row, offset in enumerate(expected_offsets):
        assert x[row].tolist() == tokens[offset:offset + 16].tolist()
        assert y[row].tolist() == tokens[offset + 1:offset + 17].tolist()


def test_sampler_on_a_memmap_covers_the_ends(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(20, dtype=np.uint16).tofile(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    sampler = BatchSampler(tokens, micro_batch=64, seq_len=19, seed=0)  # only one window fits
    x, y = sampler.next_batch()
    assert (x == torch.arange(19)).all() and (y == x + 1).all()


def test_sampler_state_round_trip():
    tokens = np.arange(5000, dtype=np.uint16)
    sampler = BatchSampler(tokens, micro_batch=3, seq_len=8, seed=7)
    for _ in range(3):
        sampler.next_batch()
    state = json.loads(json.dumps(sampler.state_dict()))
    after = [sampler.next_batch() for _ in range(4)]
    restored = BatchSampler(tokens, micro_batch=3, seq_len=8, seed=999)
    restored.load_state_dict(state)
    assert restored.batches_drawn == 3
    for (x, y), (rx, ry) in zip(after, [restored.next_batch() for _ in range(4)]):
        assert (x == rx).all() and (y == ry).all()
    with pytest.raises(TrainwiseError, match="same train.seq_len"):
        BatchSampler(tokens, micro_batch=3, seq_len=16, seed=7).load_state_dict(state)


def test_ranks_take_disjoint_slices_of_the_global_batch():
    tokens = np.arange(100_000, dtype=np.uint32)
    world = [BatchSampler(tokens, micro_batch=2, seq_len=5, seed=1, rank=r, world_size=3) for r in range(3)]
    single = BatchSampler(tokens, micro_batch=6, seq_len=5, seed=1)
    for _ in range(3):
        xs = [s.next_batch()[0] for s in world]
        together = torch.cat(xs)
        assert (together == single.next_batch()[0]).all()
        starts = [set(x[:, 0].tolist()) for x in xs]
        assert not (starts[0] & starts[1] or starts[0] & starts[2] or starts[1] & starts[2])


def test_sampler_refuses_bad_arguments():
    with pytest.raises(TrainwiseError, match="10 tokens.*seq_len \\+ 1 = 11"):
        BatchSampler(np.arange(10), micro_batch=1, seq_len=10, seed=0)
    with pytest.raises(TrainwiseError, match="rank = 2"):
        BatchSampler(np.arange(100), micro_batch=1, seq_len=4, seed=0, rank=2, world_size=2)


def test_unigram_loss_matches_hand_computation(tmp_path, tok):
    cfg = DataConfig(paths=[str(write(tmp_path / "a.txt", words(3000)))], val_fraction=0.2)
    data = prepare_data(cfg, tok, seq_len=8)
    counts = np.bincount(np.asarray(data.train), minlength=tok.vocab_size) + 1
    p = counts / counts.sum()
    expected = -np.mean(np.log(p[np.asarray(data.val)]))
    assert unigram_loss(data) == pytest.approx(expected, rel=1e-9)
