"""The measured CPU peak behind every MFU and every predicted step time: a measurement taken while other
work holds the CPU is flagged; one taken on a quiet machine never is, however many threads our own
matmuls use."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from trainwise.cli import main
from trainwise.hardware.cache import busy_note, cached_link, calibration_note, link_key
from trainwise.measure import calibrate as calibrate_module
from trainwise.measure.calibrate import BUSY_OTHERS, calibrate, measure_peak
from trainwise.measure.load import cpu_busy_jiffies, others_share


@contextmanager
def busy_cpu():
    """One spinning process per usable core: other work holding about half of the machine."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    time.sleep(0.3)  # let them start spinning
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


# Whether a reading counts as busy is BUSY_OTHERS's call, read by calibrate at each use. The caching tests
# set it instead of hoping for a quiet (or a busy) machine, so both branches run on any machine, with real
# measurements: a share of the cores is never below 0, nor infinite.
EVERYTHING_BUSY, NOTHING_BUSY = -1.0, math.inf


def as_cached(entry: dict) -> dict:
    """An entry as calibration.json holds it (JSON has lists where a fresh result may hold tuples)."""
    return json.loads(json.dumps(entry))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path))
    return tmp_path / "calibration.json"


def test_a_gloo_link_without_ddp_as_its_steps_ran_it_is_measured_again(cache):
    """A link entry of an older trainwise (collectives alone, or FSDP2's strategies without ddp's) reads as none,
    so that the next torchrun CPU run measures it again with every strategy's fit."""
    link = {"link": [1e-4, 1e9], "world": 2, "backend": "gloo"}
    fsdp = {"link": [2e-3, 4e8], "rows": []}
    for strategies, found in (({}, False), ({"zero2": fsdp, "fsdp": fsdp}, False),
                              ({"ddp": fsdp, "zero2": fsdp, "fsdp": fsdp}, True)):
        entry = {**link, "strategies": strategies} if strategies else link
        cache.write_text(json.dumps({link_key("gloo", 2): entry}))
        assert (cached_link("gloo", 2) == entry) is found and (cached_link("gloo", 2) is None) is not found


def test_others_share_counts_other_processes_only():
    # all CPUs' busy time went 100 -> 104 s, ours 1 -> 4 s, over 2 s on 2 cores:
    # others = ((104 - 100) - (4 - 1)) / (2 x 2) = 0.25
    assert others_share((100.0, 1.0), (104.0, 4.0), 2.0, cores=2) == pytest.approx(0.25)
    # we used everything there was: nobody else
    assert others_share((100.0, 1.0), (104.0, 5.0), 2.0, cores=2) == 0.0


def test_the_busy_test_fires_with_spinning_processes():
    """Measured on one thread, as a torchrun rank measures (its peak round the shortest: calibrate.peak_sizes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with busy_cpu():
            busy = measure_peak(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert busy["busy"] and busy["others_share"] > BUSY_OTHERS
    assert "too low" in busy_note(busy) and "trainwise hardware --calibrate" in busy_note(busy)


def test_the_busy_test_leaves_our_own_threads_out_even_with_one_thread():
    """The old test read our own threads' share of the wall time, so a matmul that ran on one of two
    threads tripped it on a quiet machine; the new one reads what other processes used. Checked against
    /proc/stat and our own CPU time read just outside measure_peak's window, whatever else runs: the
    counters only grow, so its reading is at most the cores' busy time less ours around it (plus what the
    few calls between the two windows can add), while our thread, were it counted, would add its whole
    share on top; other processes' load is in both readings and cannot hide it. Busy is exactly a reading
    above BUSY_OTHERS, so on a quiet machine (nothing around) it stays off."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before, ours, wall = cpu_busy_jiffies(), time.process_time(), time.perf_counter()
        reading = measure_peak(torch.device("cpu"), bandwidth=1.0)  # the bandwidth is not read here
        busy_s, ours, wall = cpu_busy_jiffies()[0] - before[0], time.process_time() - ours, time.perf_counter() - wall
    finally:
        torch.set_num_threads(threads)
    cores = os.cpu_count()
    gap = 0.05  # s: the calls between our readings and measure_peak's own, a scheduler slice included
    around = (max(busy_s - ours, 0.0) + gap) / ((wall - gap) * cores)
    assert ours > 4 * gap  # our matmul thread ran: counted as another process it would add ours / (wall x cores)
    assert reading["others_share"] <= around
    assert bool(reading.get("busy")) == (reading["others_share"] > BUSY_OTHERS)
    assert (busy_note(reading) == "") == (not reading.get("busy"))


@pytest.mark.slow
def test_a_busy_calibration_is_cached_measured_again_when_quiet_and_never_replaces_a_quiet_one(cache, monkeypatch):
    monkeypatch.setattr(calibrate_module, "_found_busy", {})
    monkeypatch.setattr(calibrate_module, "BUSY_OTHERS", EVERYTHING_BUSY)
    busy = calibrate("cpu")  # the first calibration of this cache, on a machine that stays busy
    assert busy["busy"] and "profile" in busy
    assert calibrate("cpu") == as_cached(busy)  # cached: a never-quiet machine does not pay the measurement every run
    assert "too low" in calibration_note(busy)
    calibrate_module._found_busy.clear()
    monkeypatch.setattr(calibrate_module, "BUSY_OTHERS", NOTHING_BUSY)
    again = calibrate("cpu")  # the machine is quiet now: the busy entry is measured again at once
    assert again["measured_unix"] > busy["measured_unix"] and not again.get("busy")
    monkeypatch.setattr(calibrate_module, "BUSY_OTHERS", EVERYTHING_BUSY)
    refreshed = calibrate("cpu", refresh=True)  # `trainwise hardware --calibrate` on a busy machine
    assert refreshed["busy"] and as_cached(refreshed["profile"]) == as_cached(again["profile"])
    assert calibrate("cpu") == as_cached(again)


def test_a_day_old_calibration_is_flagged_while_busy_and_measured_again_when_quiet(cache, calibrated, monkeypatch,
                                                                                   capsys):
    """Over a day old: every line that uses it says so while the machine is busy (`plan --gpu cpu` among
    them, with when it was taken); on a quiet machine calibrate() takes the measuring path (the one the
    session's calibration took; measured again for real under -m slow, by the busy-then-quiet test). (The
    session's calibration, copied here, is the one that ages; nothing is measured until the machine is quiet.)"""
    monkeypatch.setattr(calibrate_module, "_found_busy", {})
    monkeypatch.setattr(calibrate_module, "BUSY_OTHERS", EVERYTHING_BUSY)
    for name in ("calibration.json", "kernels.json"):
        if (calibrated / name).is_file():
            shutil.copy(calibrated / name, cache.parent / name)
    entries = json.loads(cache.read_text())
    first = calibrate("cpu")
    assert first == entries[first["machine"]]  # the session's, taken as it is (quiet or not)
    for entry in entries.values():
        if "measured_unix" in entry:  # a device's (a link's, when a torchrun test ran first, has none)
            entry["measured_unix"] -= 2 * 86400
    cache.write_text(json.dumps(entries))
    old = calibrate("cpu")
    assert old["measured_unix"] < first["measured_unix"] and "days ago" in calibration_note(old)
    assert main(["plan", "--model", "trainwise-small", "--tokens", "1e6", "--gpu", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "calibrated" in out and first["measured_at"] in out and "2.0 days ago" in out
    assert "last speed probe" in out
    calibrate_module._found_busy.clear()
    monkeypatch.setattr(calibrate_module, "BUSY_OTHERS", NOTHING_BUSY)
    measured = []
    monkeypatch.setattr(calibrate_module, "_measure_and_cache",
                        lambda device, path, key, stale: measured.append((key, stale)) or {**stale, "measured_unix": 0})
    calibrate("cpu")
    assert measured == [(first["machine"], old)]  # the stale entry handed to the measurement it is kept beside


def test_the_eager_overhead_is_the_slope_between_the_overhead_bound_references():
    """measure.reference.overhead_fit: two references' (calls, step - kernels) solved exactly, and when the
    smaller one's kernels, priced one by one, come to more than its step (a fresh EPYC calibration: 1.21 ms of
    kernels in a 1.06 ms step), the per-call cost is still the slope between them, the per-step cost 0."""
    from trainwise.measure.reference import overhead_fit

    per_step, per_op = overhead_fit([(109, 1.286e-3), (484, 4.046e-3)])
    assert per_op == pytest.approx(7.36e-6) and per_step == pytest.approx(1.286e-3 - 109 * 7.36e-6)
    per_step, per_op = overhead_fit([(484, 7.441e-3 - 5.876e-3), (109, 1.058e-3 - 1.205e-3)])
    assert per_op == pytest.approx((7.441e-3 - 5.876e-3 + 0.147e-3) / 375) and per_step == 0.0


def test_the_optimizer_update_is_timed_with_its_operands_in_memory():
    """In a step the backward has evicted the gradients, parameters and states since the last update; the
    optimizer fit overwrites more than the largest cache before each timed update (on a Xeon whose 480 MiB
    cache held the fit's sets whole, the hot timing read 2-5x fast)."""
    from trainwise.measure.kernels import evicting_write, last_level_cache_bytes, optimizer_fit

    llc = last_level_cache_bytes()
    assert llc >= 1 << 20  # sysfs reads on Linux (a 64 MiB guess elsewhere)
    written = evicting_write(torch.device("cpu"))()
    assert written.numel() * written.element_size() >= min(llc, 1 << 30) and bool((written == 1).all())
    per_tensor, per_param = optimizer_fit(torch.device("cpu"), reps=2)
    assert per_tensor >= 0 and per_param > 0 and per_tensor + 1e6 * per_param < 1.0
