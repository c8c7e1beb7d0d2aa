"""Fixtures shared by the test files: a small real corpus and a private trainwise cache."""

import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from trainwise.hardware.cache import cache_root
from trainwise.measure.calibrate import calibrate

# Under pytest-xdist (README's test command) each worker holds one core: one thread for its matmuls and for
# the processes it starts, so the workers and the torchrun ranks they launch share one calibration.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

SHARED_CALIBRATION = "TRAINWISE_TEST_CALIBRATION"  # the folder holding the workers' calibration
CALIBRATION_FILES = ("calibration.json", "kernels.json")

# Property tests draw the same examples on every run: the suite is deterministic, as CI needs.
settings.register_profile("trainwise", derandomize=True, deadline=None)
settings.load_profile("trainwise")


def pytest_configure(config):
    """With workers (pytest-xdist), the controller measures the one-thread calibration once, before any worker
    starts: measured by the first worker that needs it, it would time its matmuls beside the other workers'
    tests, be flagged busy, and be measured again by each run that found it so. Each worker's cache starts
    with a copy (private_cache)."""
    workers = config.getoption("numprocesses", None) or 0
    if hasattr(config, "workerinput") or workers < 2 or config.getoption("collectonly"):
        return
    folder = tempfile.mkdtemp(prefix="trainwise-calibration-")
    before = os.environ.get("TRAINWISE_CACHE")
    os.environ["TRAINWISE_CACHE"] = folder
    try:
        calibrate("cpu", threads=1)
    finally:
        if before is None:
            del os.environ["TRAINWISE_CACHE"]
        else:
            os.environ["TRAINWISE_CACHE"] = before
    os.environ[SHARED_CALIBRATION] = folder


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and SHARED_CALIBRATION in os.environ:
        shutil.rmtree(os.environ.pop(SHARED_CALIBRATION), ignore_errors=True)


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
    path = tmp_path_factory.getbasetemp() / "cache"
    os.environ["TRAINWISE_CACHE"] = str(path)
    shared = os.environ.get(SHARED_CALIBRATION)
    if shared:
        path.mkdir(parents=True, exist_ok=True)
        for name in CALIBRATION_FILES:
            if (Path(shared) / name).is_file():
                shutil.copy(Path(shared) / name, path / name)
    yield
    if old is None:
        os.environ.pop("TRAINWISE_CACHE", None)
    else:
        os.environ["TRAINWISE_CACHE"] = old


@pytest.fixture(scope="session")
def calibrated(private_cache) -> Path:
    """This machine's calibration in the session's cache (measured once, ~35 s, or copied from the
    controller's: pytest_configure), for the tests that isolate their token caches (isolated_cache): they
    need no calibration of their own."""
    calibrate("cpu")
    return cache_root()


@pytest.fixture
def isolated_cache(tmp_path_factory, monkeypatch, calibrated) -> Path:
    """A private TRAINWISE_CACHE for one test (tokenizers and token shards start empty), holding a copy
    of the session's calibration and kernel table; outside tmp_path, which tests read as a corpus."""
    path = tmp_path_factory.mktemp("cache")
    for name in CALIBRATION_FILES:
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
