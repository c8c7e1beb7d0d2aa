"""Tokenizing a corpus larger than memory: peak RSS, MB/s at 1 and 2 processes, and a killed run resumed.

    python benchmarks/data_scale.py [--gb 2.0] [--subset-mb 256] [--dir /tmp/tw-data-scale]

1. Generates a corpus of --gb GB (10^9 bytes) of UTF-8 text in files of 128 MB (lines of words with some
   Chinese, shuffled per file), unless it is there already.
2. Trains the tokenizer (the corpus exceeds the tokenizer's budget: a seeded sample, as `train` does).
3. Tokenizes a --subset-mb MB subset with 1 process, then 2, --rounds times (interleaved, each in a
   fresh cache), printing MB/s side by side.
4. With --uninterrupted, tokenizes the whole corpus with all cores, printing wall time, MB/s and the
   peak RSS of the main process and of the largest worker; else estimates its time from step 3.
5. Tokenizes the whole corpus, kills it (SIGKILL, main process and workers) at a seeded random point,
   reruns it, and prints how much of the work was done twice (shards that had been started before the
   kill; time lost = killed run + rerun - uninterrupted run) and the rerun's peak RSS.
Every figure is printed with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

FILE_BYTES = 128 * 10**6

CHILD = """
import json, resource, sys, time
from trainwise.config import DataConfig
from trainwise.data.corpus import prepare_data
from trainwise.tokenizer import Tokenizer
paths, tok, workers = json.loads(sys.argv[1]), Tokenizer.load(sys.argv[2]), int(sys.argv[3])
start = time.perf_counter()
data = prepare_data(DataConfig(paths=paths, workers=workers), tok, seq_len=256)
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": data.stats.tokens, "bytes": data.stats.bytes,
                  "main_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""




from trainwise.hardware.cache import cpu_model

def generate(root: Path, total_bytes: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(1, 10))) for _ in range(20_000)]
    words += ["训练", "语言", "模型", "数据", "文本", "预测", "损失", "梯度"] * 50
    lines = []
    size = 0
    while size < 16 * 10**6:  # a 16 MB block of distinct lines, shuffled into each file
        line = " ".join(words[i] for i in rng.integers(0, len(words), size=rng.integers(5, 30))) + "\n"
        lines.append(line)
        size += len(line.encode())
    files = []
    for i in range(-(-total_bytes // FILE_BYTES)):
        path = root / f"part-{i:03d}.txt"
        files.append(path)
        if path.is_file() and path.stat().st_size >= FILE_BYTES:
            continue
        with open(path, "w", encoding="utf-8") as f:
            written = 0
            order = np.random.default_rng(i + 1)
            while written < FILE_BYTES:
                block = "".join(lines[j] for j in order.permutation(len(lines)))
                f.write(block)
                written += len(block.encode())
    return files


def run_child(paths: list[Path], tok: Path, workers: int, cache: Path) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "TRAINWISE_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps([str(p) for p in paths]), str(tok), str(workers)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--subset-mb", type=int, default=256)
    ap.add_argument("--dir", default="/tmp/tw-data-scale")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved 1- and 2-process rounds on the subset")
    ap.add_argument("--uninterrupted", action="store_true", help="also time one uninterrupted full pass")
    args = ap.parse_args()
    root = Path(args.dir)
    print(f"CPU: {cpu_model()}; load average {open('/proc/loadavg').read().split()[:3]}")
    start = time.perf_counter()
    files = generate(root / "corpus", int(args.gb * 1e9))
    total = sum(p.stat().st_size for p in files)
    print(f"corpus: {len(files)} files, {total / 1e9:.2f} GB (10^9 bytes), generated/found in "
          f"{time.perf_counter() - start:.0f} s")

    from trainwise.config import DataConfig
    from trainwise.data.corpus import prepare_tokenizer

    os.environ["TRAINWISE_CACHE"] = str(root / "tok-cache")
    start = time.perf_counter()
    tok = prepare_tokenizer(DataConfig(paths=[str(root / "corpus")]), 4096, say=print)
    tok_path = root / "tokenizer.json"
    tok.save(tok_path)
    print(f"tokenizer: {tok.vocab_size} tokens in {time.perf_counter() - start:.0f} s")

    subset = []
    for p in files:
        if sum(q.stat().st_size for q in subset) >= args.subset_mb * 10**6:
            break
        subset.append(p)
    subset_mb = sum(p.stat().st_size for p in subset) / 1e6
    rates = {1: [], 2: []}
    for workers in (1, 2) * args.rounds:
        r = run_child(subset, tok_path, workers, root / "cache-subset")
        rates[workers].append(subset_mb / r["seconds"])
        print(f"subset {subset_mb:.0f} MB, {workers} process(es): {r['seconds']:.1f} s, "
              f"{subset_mb / r['seconds']:.1f} MB/s, main RSS {r['main_rss_mib']:.0f} MiB, "
              f"largest worker RSS {r['worker_rss_mib']:.0f} MiB", flush=True)
    one, two = np.median(rates[1]), np.median(rates[2])
    print(f"MB/s (median of {args.rounds}): 1 process {one:.2f}, 2 processes {two:.2f} ({two / one:.2f}x)", flush=True)

    if args.uninterrupted:
        full = run_child(files, tok_path, 0, root / "cache-full")
        full_s = full["seconds"]
        print(f"full corpus, all cores: {full_s:.0f} s, {total / 1e6 / full_s:.1f} MB/s, {full['tokens']:,} tokens; "
              f"peak RSS main {full['main_rss_mib']:.0f} MiB, largest worker {full['worker_rss_mib']:.0f} MiB "
              "(budget 1024 MiB)", flush=True)
    else:  # one pass fewer: the uninterrupted time is estimated from the subset's 2-process rate
        full_s = total / 1e6 / two
        print(f"full corpus, all cores: estimated {full_s:.0f} s from the subset's rate (--uninterrupted measures it)")

    cache = root / "cache-killed"
    shutil.rmtree(cache, ignore_errors=True)
    kill_at = random.Random(0).uniform(0.2, 0.8) * full_s
    env = {**os.environ, "TRAINWISE_CACHE": str(cache)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps([str(p) for p in files]), str(tok_path), "0"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(kill_at)
    os.killpg(child.pid, signal.SIGKILL)  # the main process and its workers, as a scheduler's kill does
    child.wait()
    markers = list(cache.glob("data/*.partial/shards/*.json"))
    started = list(cache.glob("data/*.partial/shards/*.bin.tmp"))
    env_run = subprocess.run([sys.executable, "-c", CHILD, json.dumps([str(p) for p in files]), str(tok_path), "0"],
                             env=env, capture_output=True, text=True, check=True)
    rerun = json.loads(env_run.stdout.strip().splitlines()[-1])
    from trainwise.data.sources import sniff
    from trainwise.data.tokencache import plan_shards

    n_shards = len(plan_shards([sniff(p) for p in files]))
    lost = kill_at + rerun["seconds"] - full_s
    print(f"killed after {kill_at:.0f} s with {len(markers)} of {n_shards} shards done and {len(started)} in "
          f"progress; the rerun tokenized {n_shards - len(markers)} shards in {rerun['seconds']:.0f} s: "
          f"redone {len(started)} shard(s) = {len(started) / n_shards:.1%} of the work; time lost "
          f"{lost:.0f} s = {lost / full_s:.1%} of an uninterrupted run")
    print(f"the rerun: {rerun['tokens']:,} tokens, {rerun['bytes']:,} bytes of text; peak RSS main "
          f"{rerun['main_rss_mib']:.0f} MiB, largest worker {rerun['worker_rss_mib']:.0f} MiB (budget 1024 MiB)")


if __name__ == "__main__":
    main()
