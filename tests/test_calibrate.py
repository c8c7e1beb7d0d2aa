"""The measured CPU peak behind every MFU: a measurement taken while other work holds the CPU is flagged."""

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from trainwise.measure.calibrate import BUSY_SHARE, RETRY_BUSY_S, busy_note, calibrate


@contextmanager
def busy_cpu():
    """One spinning process per usable core: the matmul threads get about half of the wall time."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    time.sleep(0.3)  # let them start spinning
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path))
    return tmp_path / "calibration.json"


def test_a_peak_measured_on_a_busy_cpu_is_flagged_and_measured_again_later(cache):
    with busy_cpu():
        busy = calibrate("cpu")
    assert busy["busy"] and busy["cpu_share"] < BUSY_SHARE
    assert "too low" in busy_note(busy) and "trainwise hardware --calibrate" in busy_note(busy)
    assert calibrate("cpu") == busy  # cached: a never-quiet machine does not pay the measurement every run
    entries = json.loads(cache.read_text())
    for entry in entries.values():
        entry["measured_unix"] -= RETRY_BUSY_S + 1
    cache.write_text(json.dumps(entries))
    again = calibrate("cpu")  # an hour on, the busy entry is measured again
    assert again["measured_unix"] > busy["measured_unix"]


def test_a_busy_measurement_never_replaces_a_quiet_one(cache):
    quiet = calibrate("cpu")
    if quiet.get("busy"):
        pytest.skip("this machine is busy now: no quiet measurement to protect")
    assert busy_note(quiet) == "" and quiet["cpu_share"] >= BUSY_SHARE
    with busy_cpu():
        busy = calibrate("cpu", refresh=True)  # `trainwise hardware --calibrate` on a busy machine
    assert busy["busy"]
    assert calibrate("cpu") == quiet
