"""Real text as users bring it: legacy encodings, binaries among text, files without extensions, links
and loops, compressed files, CSV/TSV, Parquet, Arrow and `datasets` folders, nested JSON fields. Every
file here is written by the test, in the encoding or format it stands for."""

import bz2
import gzip
import json
import lzma
import os
import sys

import numpy as np
import pytest

from trainwise.config import DataConfig, RunConfig, apply_overrides
from trainwise.data.corpus import prepare_data, summary_lines
from trainwise.data.formats import iter_texts
from trainwise.data.sources import discover, sniff
from trainwise.errors import TrainwiseError
from trainwise.tokenizer import Tokenizer

ZH = "训练语言模型需要大量的文本数据。我们先把文本切分成词元，然后用神经网络预测下一个词元。梯度下降会慢慢降低损失。\n"
ZH_T = ("訓練語言模型需要大量的文本資料。我們先把文本切分成詞元，然後用神經網路預測下一個詞元。"
        "梯度下降會慢慢降低損失。\n")
JA = "言語モデルを訓練するには、たくさんの文章が必要です。まず文章をトークンに分けて、次のトークンを予測します。\n"
KO = "언어 모델을 훈련하려면 많은 텍스트가 필요합니다. 먼저 텍스트를 토큰으로 나누고 다음 토큰을 예측합니다.\n"
FR = "Le modèle apprend à prédire le mot suivant. « Très bien », dit l’élève — c’était déjà l’été; “voilà”.\n"
EN = "The model learns to predict the next token, one step of gradient descent at a time.\n"

LEGACY = {  # file name: (text, codec it is written in)
    "zh_gb18030.txt": (ZH * 4, "gb18030"),
    "zh_big5.txt": (ZH_T * 4, "big5"),
    "ja_shift_jis.txt": (JA * 4, "shift_jis"),
    "ko_euc_kr.txt": (KO * 4, "euc_kr"),
    "fr_cp1252.txt": (FR * 4, "cp1252"),
    "en_utf16.txt": (EN * 4, "utf-16"),  # with a BOM, as Python and Windows Notepad write it
    "fr_utf8_bom.txt": (FR * 4, "utf-8-sig"),
}


@pytest.fixture(autouse=True)
def cache_in_tmp(isolated_cache):
    return isolated_cache


def make_mixed_folder(root):
    """Every kind of file this module is about, in one folder; returns {relative name: text}."""
    expected = {}
    for name, (text, codec) in LEGACY.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text.encode(codec))
        expected[name] = text
    (root / "utf8" / "plain").mkdir(parents=True)
    (root / "utf8" / "plain" / "README").write_text(EN * 3, encoding="utf-8")  # no extension
    expected["utf8/plain/README"] = EN * 3
    (root / "utf8" / "mail_0001").write_text("From: a\n\n" + ZH, encoding="utf-8")  # split/mail-dump style
    expected["utf8/mail_0001"] = "From: a\n\n" + ZH
    (root / "bin").mkdir()
    (root / "bin" / "weights.pt").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
    (root / "bin" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(100))
    (root / "utf8" / "loop").symlink_to(root, target_is_directory=True)  # a loop back to the top
    (root / "zz_again.txt").symlink_to(root / "fr_cp1252.txt")  # the same file twice
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    return expected


def test_legacy_encodings_are_detected_and_decode_exactly(tmp_path):
    expected = make_mixed_folder(tmp_path)
    corpus = discover(DataConfig(paths=[str(tmp_path)]))
    by_name = {f.path.relative_to(tmp_path).as_posix(): f for f in corpus.files}
    assert sorted(by_name) == sorted(expected)  # no binaries, no .git, the link's file once, the loop ended
    assert {p.name for p, _ in corpus.binary} == {"weights.pt", "image.png"}
    assert [p.name for p in corpus.duplicates] == ["zz_again.txt"]  # reached second, read once
    for name, (text, codec) in LEGACY.items():
        f = by_name[name]
        assert f.path.read_bytes().decode(f.encoding) == text, (name, f.encoding)
    assert by_name["en_utf16.txt"].decided_by == "bom" and by_name["zh_gb18030.txt"].decided_by == "detected"
    texts = list(iter_texts(DataConfig(paths=[str(tmp_path)])))
    assert sorted(texts) == sorted(expected.values())


def train_and_decode(corpus, tmp_path, *extra):
    """Train a tiny run on `corpus`; the run's tokenized documents, decoded with its tokenizer."""
    from trainwise.trainer.loop import train

    cfg = apply_overrides(RunConfig(), [
        f"data.paths=['{corpus}']", "data.val_fraction=0.2", "tokenizer.vocab_size=300",
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "train.seq_len=32", "train.micro_batch=2",
        "train.max_steps=2", "train.eval_every=0", "train.warmup_steps=0", "train.compile=false", *extra])
    result = train(cfg, out=tmp_path / "run", quiet=True)
    assert np.isfinite(result.train_loss)
    tok = Tokenizer.load(tmp_path / "run" / "tokenizer.json")
    data = prepare_data(cfg.data, tok, seq_len=32)
    assert data.cache_hit
    stream = np.concatenate([data.train, data.val]).tolist()
    docs, start = [], 0
    for i, t in enumerate(stream):
        if t == tok.eot_id:
            docs.append(tok.decode(stream[start:i]))
            start = i + 1
    return data, docs


def test_mixed_folder_trains_and_round_trips_through_the_runs_tokenizer(tmp_path):
    expected = make_mixed_folder(tmp_path / "corpus")
    data, docs = train_and_decode(tmp_path / "corpus", tmp_path)
    assert sorted(docs) == sorted(expected.values())  # every file decoded and tokenized exactly
    report = data.stats.report
    assert report["encodings"]["utf-16"] == {"files": 1, "bytes": len(LEGACY["en_utf16.txt"][0].encode("utf-16"))}
    assert report["binary_skipped"]["files"] == 2
    lines = "\n".join(summary_lines(data))
    assert "gb18030: 1 file(s)" in lines and "skipped 2 binary file(s)" in lines


def test_forced_encoding_and_cache_key_follow_the_decision(tmp_path, tok):
    path = tmp_path / "a.txt"
    path.write_bytes((ZH * 4).encode("gb18030"))
    auto = prepare_data(DataConfig(paths=[str(path)], val_fraction=0.3), tok, seq_len=4)
    forced = prepare_data(DataConfig(paths=[str(path)], val_fraction=0.3, encoding="latin-1"), tok, seq_len=4)
    assert auto.path != forced.path  # another decoding, another cache entry
    assert forced.stats.report["encodings"] == {"iso8859-1": {"files": 1, "bytes": path.stat().st_size}}
    with pytest.raises(TrainwiseError, match="data.encoding = 'klingon'.*gb18030"):
        DataConfig(encoding="klingon").validate()
    # a codec that refuses the whole file (UTF-16 without its byte-order mark): one error naming file and codec
    with pytest.raises(TrainwiseError, match=r"a.txt' cannot be read as utf-16 \(UTF-16 stream does not start"):
        prepare_data(DataConfig(paths=[str(path)], val_fraction=0.3, encoding="utf-16"), tok, seq_len=4)


def test_damaged_utf8_stays_utf8_and_counts_the_damage(tmp_path, tok):
    good = (ZH + EN) * 40
    raw = bytearray(good.encode("utf-8"))
    raw[100:101] = b"\xff"  # one stray byte in ~11 KB of UTF-8 (it breaks one character)
    path = tmp_path / "damaged.txt"
    path.write_bytes(bytes(raw))
    assert sniff(path).encoding == "utf-8"
    data = prepare_data(DataConfig(paths=[str(path)], val_fraction=0.2), tok, seq_len=4)
    assert 1 <= data.stats.replaced_bytes <= 3


@pytest.mark.parametrize("suffix, opener", [(".gz", gzip.open), (".bz2", bz2.open), (".xz", lzma.open), (".zst", None)])
def test_compressed_files_are_streamed(tmp_path, suffix, opener):
    text = (EN + ZH) * 50
    records = "".join(json.dumps({"meta": {"body": line}}, ensure_ascii=False) + "\n" for line in text.splitlines())
    for name, payload in (("plain.txt", text), ("rows.jsonl", records)):
        path = tmp_path / (name + suffix)
        if opener is None:
            import zstandard
            path.write_bytes(zstandard.ZstdCompressor().compress(payload.encode("gb18030")))
        else:
            with opener(path, "wb") as f:
                f.write(payload.encode("gb18030"))  # compressed *and* in a legacy encoding
    corpus = discover(DataConfig(paths=[str(tmp_path)]))
    assert [(f.format, f.encoding) for f in corpus.files] == [("text", "gb18030"), ("jsonl", "gb18030")]
    texts = list(iter_texts(DataConfig(paths=[str(tmp_path)], text_field="meta.body")))
    assert texts[0] == text and texts[1:] == text.splitlines()


def test_csv_tsv_and_nested_jsonl_fields(tmp_path):
    (tmp_path / "a.csv").write_text('id,text\n1,"first, with a comma"\n2,"two\nlines"\n3,\n', encoding="utf-8")
    (tmp_path / "b.tsv").write_bytes("text\tn\n한국어 문장\t1\n".encode("euc_kr"))
    assert list(iter_texts(DataConfig(paths=[str(tmp_path)]))) == ["first, with a comma", "two\nlines", "한국어 문장"]
    (tmp_path / "c.jsonl").write_text('{"turns": [{"text": "hi"}, {"text": "there"}]}\n', encoding="utf-8")
    assert list(iter_texts(DataConfig(paths=[str(tmp_path / "c.jsonl")], text_field="turns.1.text"))) == ["there"]
    with pytest.raises(TrainwiseError, match="a.csv' has no column 'body'.*'id', 'text'"):
        list(iter_texts(DataConfig(paths=[str(tmp_path / "a.csv")], text_field="body")))
    with pytest.raises(TrainwiseError, match="c.jsonl' line 1 has no 'turns.5.text' field"):
        list(iter_texts(DataConfig(paths=[str(tmp_path / "c.jsonl")], text_field="turns.5.text")))


def test_parquet_arrow_and_a_datasets_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [ZH, JA, KO, FR]
    pq.write_table(pa.table({"text": rows[:2]}), tmp_path / "shard-0")  # no extension: found by its magic bytes
    with pa.OSFile(str(tmp_path / "shard-1.arrow"), "wb") as sink:  # the Arrow IPC file format
        with pa.ipc.new_file(sink, pa.schema([("doc", pa.struct([("body", pa.string())]))])) as writer:
            writer.write_table(pa.table({"doc": [{"body": r} for r in rows[2:]]}))
    assert list(iter_texts(DataConfig(paths=[str(tmp_path / "shard-0")]))) == rows[:2]
    assert list(iter_texts(DataConfig(paths=[str(tmp_path / "shard-1.arrow")], text_field="doc.body"))) == rows[2:]

    import datasets
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows}),
                               "test": datasets.Dataset.from_dict({"text": ["held out"]})})
    dd.save_to_disk(str(tmp_path / "hf"))
    corpus = discover(DataConfig(paths=[str(tmp_path / "hf")]))
    assert {f.format for f in corpus.files} == {"arrow"} and "split(s) train of" in corpus.notes[0]
    assert list(iter_texts(DataConfig(paths=[str(tmp_path / "hf")]))) == rows


def test_missing_extra_names_the_pip_install(tmp_path, monkeypatch):
    path = tmp_path / "x.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(20))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(TrainwiseError, match="needs zstandard, which is not installed: `pip install zstandard`"):
        discover(DataConfig(paths=[str(path)]))


def test_only_binaries_is_a_clear_error(tmp_path):
    (tmp_path / "a.bin").write_bytes(bytes(range(256)))
    with pytest.raises(TrainwiseError, match="hold no text: all 1 file.*binary"):
        discover(DataConfig(paths=[str(tmp_path)]))
    os.symlink(tmp_path / "missing", tmp_path / "dangling")
    with pytest.raises(TrainwiseError, match="a link to something that does not exist"):
        discover(DataConfig(paths=[str(tmp_path / "dangling")]))


def test_fifo_in_a_folder_is_skipped_not_waited_on(tmp_path):
    (tmp_path / "a.txt").write_text(EN, encoding="utf-8")
    os.mkfifo(tmp_path / "pipe")
    corpus = discover(DataConfig(paths=[str(tmp_path)]))
    assert [f.path.name for f in corpus.files] == ["a.txt"] and [p.name for p in corpus.broken] == ["pipe"]


def test_compressed_and_table_formats_train_and_round_trip(tmp_path):
    """Each compression, Parquet, Arrow and a save_to_disk folder in one corpus: a run trains on it and
    every document comes back from the run's tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import zstandard
    import datasets
    root = tmp_path / "corpus"
    root.mkdir()
    texts = {"gz": EN * 3, "bz2": FR * 3, "xz": KO * 3, "zst": JA * 3}
    for (suffix, text), opener in zip(texts.items(), (gzip.open, bz2.open, lzma.open, None)):
        payload = text.encode("gb18030" if suffix == "gz" else "utf-8")
        if opener is None:
            (root / f"doc.{suffix}").write_bytes(zstandard.ZstdCompressor().compress(payload))
        else:
            with opener(root / f"doc.{suffix}", "wb") as f:
                f.write(payload)
    rows = [ZH, ZH_T, EN + KO]
    pq.write_table(pa.table({"text": rows[:1]}), root / "rows.parquet")
    with (pa.OSFile(str(root / "rows.arrow"), "wb") as sink,
          pa.ipc.new_file(sink, pa.schema([("text", pa.string())])) as w):
        w.write_table(pa.table({"text": rows[1:2]}))
    datasets.Dataset.from_dict({"text": rows[2:]}).save_to_disk(str(root / "hf"))
    data, docs = train_and_decode(root, tmp_path)
    assert sorted(docs) == sorted([*texts.values(), *rows])
    assert data.stats.report["formats"] == {"text+gzip": 1, "text+bz2": 1, "text+xz": 1, "text+zstd": 1,
                                            "parquet": 1, "arrow": 2}
