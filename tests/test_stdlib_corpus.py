"""The built-in corpora by name (issue 31): builtin:stdlib, the standard library's source for scaling sweeps,
and builtin:docs, the default corpus. The suite reads the whole stdlib corpus's file list but tokenizes
only a slice of it."""

from __future__ import annotations

import hashlib

import pytest

from trainwise.config import DataConfig
from trainwise.data.corpus import corpus_key, describe, prepare_data, prepare_tokenizer
from trainwise.data.formats import iter_texts
from trainwise.data.sources import (
    DOCS_CORPUS,
    STDLIB_CORPUS,
    STDLIB_CORPUS_DESCRIPTION,
    STDLIB_SKIPPED_DIRS,
    discover,
    stdlib_root,
)
from trainwise.errors import TrainwiseError


def test_stdlib_corpus_is_the_librarys_own_source_without_tests_in_a_fixed_shuffle():
    files = discover(DataConfig(paths=[STDLIB_CORPUS])).files
    rel = [f.path.relative_to(stdlib_root()).as_posix() for f in files]
    assert len(rel) > 300 and all(r.endswith(".py") for r in rel)
    assert {"json/decoder.py", "pydoc_data/topics.py", "argparse.py"} <= set(rel)  # code, and the reference docs
    assert not [r for r in rel if set(r.split("/")[:-1]) & STDLIB_SKIPPED_DIRS]  # no tests, no site-packages
    assert not [r for r in rel if r.startswith(("_sysconfigdata", "config-"))]  # one machine's build
    assert rel == sorted(rel, key=lambda r: hashlib.sha256(r.encode()).hexdigest())
    assert len({r.split("/")[0] for r in rel[-len(rel) // 20:]}) > 10  # the validation end samples the library
    assert sum(f.size for f in files) > 5_000_000 and {f.encoding for f in files} == {"utf-8"}
    assert describe(DataConfig(paths=[STDLIB_CORPUS])) == STDLIB_CORPUS_DESCRIPTION
    assert "Code-heavy" in STDLIB_CORPUS_DESCRIPTION


def test_a_slice_of_the_stdlib_corpus_tokenizes_like_any_folder():
    """data.include narrows builtin:stdlib like a folder; the slice trains a tokenizer and caches its tokens."""
    cfg = DataConfig(paths=[STDLIB_CORPUS], include=["json/*.py"])
    files = discover(cfg).files
    assert sorted(f.path.name for f in files) == ["__init__.py", "decoder.py", "encoder.py", "scanner.py", "tool.py"]
    data = prepare_data(cfg, prepare_tokenizer(cfg, 300), seq_len=32)
    assert data.stats.files == 5 and data.stats.bytes == sum(f.size for f in files)
    assert len(data.train) + len(data.val) == data.stats.tokens > 10_000


def test_builtin_docs_names_the_default_corpus_and_builtin_names_are_checked():
    named = DataConfig(paths=[DOCS_CORPUS])
    assert corpus_key(named) == corpus_key(DataConfig())  # one token cache, one stored fit
    assert describe(named) == describe(DataConfig()) and DOCS_CORPUS in describe(named)
    assert next(iter_texts(named)) == next(iter_texts(DataConfig()))
    with pytest.raises(TrainwiseError, match="stands alone"):
        discover(DataConfig(paths=[DOCS_CORPUS, "notes.txt"]))
    with pytest.raises(TrainwiseError, match="names no built-in corpus; there are 'builtin:docs'"):
        discover(DataConfig(paths=["builtin:books"]))


def test_the_sweep_and_the_scale_commands_default_to_the_stdlib_corpus(capsys):
    from trainwise.cli import main
    from trainwise.scale.sweep import SWEEP_DATA, sweep_base

    assert SWEEP_DATA == [STDLIB_CORPUS] and sweep_base([]).data.paths == [STDLIB_CORPUS]
    assert sweep_base(['data.paths=["a.txt"]']).data.paths == ["a.txt"]
    assert DataConfig().paths == []  # `trainwise train` keeps the default corpus
    assert main(["scale", "predict", "--model", "trainwise-small", "--tokens", "1e6", "--vocab-size", "777"]) == 2
    assert "no scaling-law fit is stored for this corpus" in capsys.readouterr().err
