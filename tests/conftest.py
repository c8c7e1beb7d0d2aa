"""Fixtures shared by the test files: a small real corpus and a private trainwise cache."""

import gc
import os
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run: the suite is deterministic, as CI needs.
settings.register_profile("trainwise", derandomize=True, deadline=None)
settings.load_profile("trainwise")


@pytest.fixture(scope="module", autouse=True)
def earlier_objects_frozen():
    """What the files before this one left alive (imported modules, session fixtures: most of the process's
    objects) goes to the collector's permanent generation while this file runs (gc.freeze), so each
    collection a run makes walks only this file's objects: the peak meter collects and scans the heap at a
    run's start and before its measured step, which in one long pytest process walk ever more objects. The
    meter leaves those objects out either way (foreign to the run, already resident)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Tokenizers, token shards and the calibrated peak go to a per-session directory, never ~/.cache."""
    old = os.environ.get("TRAINWISE_CACHE")
    os.environ["TRAINWISE_CACHE"] = str(tmp_path_factory.getbasetemp() / "cache")
    yield
    if old is None:
        os.environ.pop("TRAINWISE_CACHE", None)
    else:
        os.environ["TRAINWISE_CACHE"] = old


@pytest.fixture(scope="session")
def calibrated(private_cache) -> Path:
    """This machine's calibration in the session's cache (measured once, ~25 s), for the tests that
    isolate their token caches (isolated_cache): they need no calibration of their own."""
    from trainwise.hardware.cache import cache_root
    from trainwise.measure.calibrate import calibrate

    calibrate("cpu")
    return cache_root()


@pytest.fixture
def isolated_cache(tmp_path_factory, monkeypatch, calibrated) -> Path:
    """A private TRAINWISE_CACHE for one test (tokenizers and token shards start empty), holding a copy
    of the session's calibration and kernel table; outside tmp_path, which tests read as a corpus."""
    import shutil

    path = tmp_path_factory.mktemp("cache")
    for name in ("calibration.json", "kernels.json"):
        if (calibrated / name).is_file():
            shutil.copy(calibrated / name, path / name)
    monkeypatch.setenv("TRAINWISE_CACHE", str(path))
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """About 60 KB of real English text (CPython's reference docs), as a plain .txt file."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n\n".join(topics[k] for k in sorted(topics))[:60_000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tok():
    """A 512-token BPE trained on the built-in corpus (shared by the data tests)."""
    from pydoc_data.topics import topics

    from trainwise.tokenizer import Tokenizer

    return Tokenizer.train([topics[k] for k in sorted(topics)], 512)
