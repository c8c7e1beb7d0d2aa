"""benchmarks/gpu_check.py runs end to end on a CPU (its smoke test) and reports what it promises."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32",
        "train.seq_len=32", "train.micro_batch=4", "tokenizer.vocab_size=300", "train.eval_every=0",
        "train.eval_steps=2", "train.sample_tokens=5"]


def test_gpu_check_smoke_on_cpu(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--steps", "5",
           "--no-compile", "--json", str(out)]
    for item in TINY:
        cmd += ["--set", item]
    env = dict(os.environ)  # the session's cache (conftest): its CPU calibration is measured once per session
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < 60, f"took {elapsed:.1f} s"  # incl. the session's one CPU calibration (~15-25 s quiet)
    for label in ("tokens/s", "MFU", "peak memory", "SDPA backend", "precision", "AdamW", "step-time model"):
        assert label in proc.stdout, label
    assert "fp16             skipped" in proc.stdout and "compile          skipped" in proc.stdout
    r = json.loads(out.read_text())
    main = r["main"]
    # log_every 1: the first row is start-up, the last step ran under the peak meter (verify.steady_step_time)
    assert main["steps"] == 5 and main["steady_rows"] == 3
    assert main["tokens_per_s"] > 0 and 0 < main["mfu"] < 1
    assert main["precision"] in ("fp32", "bf16") and main["verify_peak_memory_bytes"] > 0
    assert "cuda_max_allocated_bytes" not in main  # CPU: memory comes from verify.json
    assert r["optimizer"] == "fused"  # trainwise's AdamW is fused on CPU too (train/optim.py)
    assert main["step_time_predicted_s"] > 0 and main["time_source"] == "calibrated"  # this CPU's calibration
    assert r["sdpa"]["backend"] in ("flash", "efficient", "cudnn", "math")
    assert r["compile"] == {"skipped": "--no-compile"} and "skipped" in r["fp16"]
    assert not list(tmp_path.glob("runs*")), "runs must go to a temporary folder, not the working directory"
