"""`trainwise data`: the report of a corpus, in text and JSON, from the real files."""

import json

import pytest

from trainwise.cli import main
from trainwise.config import DataConfig
from trainwise.data.corpus import prepare_data
from trainwise.tokenizer import Tokenizer

ZH = "训练语言模型需要大量的文本数据。我们先把文本切分成词元，然后用神经网络预测下一个词元。\n" * 20
EN = "The model learns to predict the next token, one step of gradient descent at a time.\n" * 30


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path / "cache"))


def test_data_report_counts_files_encodings_and_tokens(tmp_path, tok, capsys):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "zh").write_bytes(ZH.encode("gb18030"))
    (root / "en.txt").write_text(EN, encoding="utf-8")
    (root / "blob").write_bytes(bytes(range(256)))
    tok.save(tmp_path / "tok.json")
    assert main(["data", str(root), "--tokenizer", str(tmp_path / "tok.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    disc = report["discovery"]
    assert disc["encodings"] == {"gb18030": {"files": 1, "bytes": len(ZH.encode("gb18030"))},
                                 "utf-8": {"files": 1, "bytes": len(EN)}}
    assert disc["binary_skipped"]["files"] == 1 and disc["binary_skipped"]["bytes"] == 256
    data = prepare_data(DataConfig(paths=[str(root)]), tok, seq_len=1)
    assert data.cache_hit  # `trainwise data` filled the cache `trainwise train` reads
    assert report["tokens"] == data.stats.tokens
    assert report["chars"] == len(ZH) + len(EN) and report["text_bytes"] == len(ZH.encode()) + len(EN)
    assert report["chars_per_token"] == pytest.approx(report["chars"] / report["tokens"])
    top = report["top_tokens"][0]
    assert top["count"] == max(int((data.train == i).sum() + (data.val == i).sum()) for i in range(tok.vocab_size))

    assert main(["data", str(root), "--tokenizer", str(tmp_path / "tok.json")]) == 0
    text = capsys.readouterr().out
    assert "encoding gb18030: 1 file(s)" in text and "skipped binary: 1 file(s), 256 bytes" in text


def test_data_report_of_a_mixture_config(tmp_path, tok, capsys):
    (tmp_path / "en.txt").write_text(EN, encoding="utf-8")
    (tmp_path / "zh.txt").write_text(ZH, encoding="utf-8")
    (tmp_path / "mix.toml").write_text(
        f"[[data.sources]]\npath = '{tmp_path / 'en.txt'}'\nweight = 3\nname = 'en'\n"
        f"[[data.sources]]\npath = '{tmp_path / 'zh.txt'}'\nweight = 1\nname = 'zh'\n", encoding="utf-8")
    tok.save(tmp_path / "tok.json")
    assert main(["data", "--config", str(tmp_path / "mix.toml"), "--tokenizer", str(tmp_path / "tok.json"),
                 "--json"]) == 0
    sources = {s["name"]: s for s in json.loads(capsys.readouterr().out)["sources"]}
    assert sources["en"]["share_sampled"] == 0.75 and sources["zh"]["share_sampled"] == 0.25
    assert sources["en"]["tokens"] == len(Tokenizer.encode(tok, EN)) + 1


def test_data_report_errors_are_one_paragraph(tmp_path, capsys):
    assert main(["data", str(tmp_path / "missing")]) == 2
    err = " ".join(capsys.readouterr().err.split())  # wrapped at 100 columns wherever the path puts the breaks
    assert "does not exist" in err and "Traceback" not in err
