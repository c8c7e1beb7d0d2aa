"""A corpus tokenized once into one flat file of token ids: in shards, in parallel, resumable.

    files ─plan_shards─> shards (groups of small files, byte ranges of large ones, ~SHARD_BYTES each)
          ─one process per core─> <entry>.partial/shards/NNNNN.bin + NNNNN.json (written last: "done")
          ─concatenate in order─> tokens.bin + meta.json, then <entry>.partial is renamed to <entry>

Each worker streams its shard (pieces of ~1 MB of text, encoded and appended), so peak memory is
one encode batch per process whatever the corpus size. A run that is killed leaves its finished
shards behind; the next run with the same cache key redoes only the others. The shards are the same
however many processes run, so the tokens do not depend on the number of cores.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm import tqdm

from trainwise.data.formats import (
    CHUNK_CHARS,
    Part,
    Reading,
    builtin_texts,
    iter_pieces,
    mark_last,
    rechunk,
    split_points,
    splittable,
)
from trainwise.data.sources import SourceFile
from trainwise.errors import TrainwiseError
from trainwise.files import write_json_atomic
from trainwise.tokenizer import Tokenizer, sanitize

SHARD_BYTES = 32 * 2**20  # a unit of work (and of redone work after a kill)
# Each encode_batch call gets about BATCH_CHARS of text in parts of about ENCODE_CHARS (cut by
# formats.rechunk, so they encode as the whole text does): enough parts to keep many cores busy, while
# HF's Encoding objects (~300 bytes per token) stay near 100 MB.
ENCODE_CHARS = 16_384
BATCH_CHARS = 1_000_000
NO_TEXT = ("the corpus contains no text: its files are empty or hold only empty records. Add files with text, or "
           "check data.text_field.")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the file when every token id fits (ids 0..65535), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclass
class ShardStats:
    documents: int = 0
    bytes: int = 0  # UTF-8 bytes of the text encoded
    chars: int = 0  # characters (code points) of the text encoded
    tokens: int = 0  # including one end-of-text token per document
    replaced_bytes: int = 0  # input bytes that did not decode, replaced by U+FFFD

    def add(self, other: ShardStats) -> None:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)


def encode_pieces(pieces: Iterable[tuple[str, bool]], tokenizer: Tokenizer, eot_id: int, stats: ShardStats,
                  leading_eot: bool = False) -> Iterator[list[int]]:
    """The token ids of (piece, ends_a_document) pairs (formats.iter_pieces, formats.iter_documents):
    each document's tokens followed by eot_id, one list per encode batch. The one path from text to
    tokens, for the token cache and for `trainwise eval` alike.

    Each piece is sanitized (tokenizer.sanitize) before its UTF-8 bytes and characters are counted into
    `stats` (with its documents and the ids yielded) and it is encoded. leading_eot: first yield one
    eot_id, so that the first document too is predicted after an end-of-text token, as every later one
    is (trainwise.evaluate scores text so); the cache's stream has none, it starts with the first
    document's tokens."""
    if leading_eot:
        stats.tokens += 1
        yield [eot_id]
    batch: list[str] = []
    ends: list[bool] = []

    def flush() -> list[int]:
        ids: list[int] = []
        for part_ids, end in zip(tokenizer.encode_batch(batch), ends):
            ids += part_ids
            if end:
                ids.append(eot_id)
        stats.tokens += len(ids)
        batch.clear()
        ends.clear()
        return ids

    size = 0
    for piece, end in pieces:
        text = sanitize(piece)
        stats.bytes += len(text.encode("utf-8"))
        stats.chars += len(text)
        stats.documents += end
        for part, last in mark_last(rechunk([text], ENCODE_CHARS)):
            batch.append(part)
            ends.append(end and last)
            size += len(part)
            if size >= BATCH_CHARS:
                yield flush()
                size = 0
    if batch:
        yield flush()


def plan_shards(files: list[SourceFile] | None, shard_bytes: int = SHARD_BYTES) -> list[list[Part]]:
    """Consecutive files grouped into shards of about shard_bytes; a larger file that can be read in
    byte ranges (formats.splittable) becomes one shard per range. [[]] is the built-in corpus."""
    if files is None:
        return [[]]
    shards: list[list[Part]] = []
    current: list[Part] = []
    size = 0
    for f in files:
        if f.size > shard_bytes and splittable(f):
            if current:
                shards.append(current)
                current, size = [], 0
            cuts = [0] + split_points(f, shard_bytes) + [f.size]
            shards += [[Part(f, a, None if b == f.size else b)] for a, b in zip(cuts, cuts[1:])]
            continue
        current.append(Part(f))
        size += f.size
        if size >= shard_bytes:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    return shards


def build(entry: Path, shards: list[list[Part]], tokenizer_json: str, eot_id: int, vocab_size: int,
          text_field: str, chunk_chars: int = CHUNK_CHARS, workers: int = 0, meta: dict | None = None) -> None:
    """Tokenize `shards` into entry/tokens.bin and entry/meta.json (stats, dtype, vocab, eot and `meta`),
    resuming from whatever a killed run left in <entry>.partial. One process at a time per entry."""
    locks = entry.parent.parent / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process with the same corpus waits, then finds it done
        if (entry / "meta.json").is_file():
            return
        partial = entry.parent / f"{entry.name}.partial"
        _prepare_partial(partial, len(shards), tokenizer_json)
        start = time.perf_counter()
        stats = _run_shards(partial, shards, eot_id, vocab_size, text_field, chunk_chars, workers)
        if stats.tokens == 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise TrainwiseError(NO_TEXT)
        with open(partial / "tokens.bin", "wb") as out:
            for i in range(len(shards)):
                with open(_shard_bin(partial, i), "rb") as src:
                    shutil.copyfileobj(src, out, 16 * 2**20)
        done = {**(meta or {}), "dtype": token_dtype(vocab_size).name, "vocab_size": vocab_size, "eot_id": eot_id,
                "stats": {**asdict(stats), "seconds": time.perf_counter() - start}}
        (partial / "meta.json").write_text(json.dumps(done, indent=1), encoding="utf-8")
        shutil.rmtree(partial / "shards")
        (partial / "tokenizer.json").unlink()
        os.rename(partial, entry)


def _prepare_partial(partial: Path, n_shards: int, tokenizer_json: str) -> None:
    plan = partial / "plan.json"
    if plan.is_file() and json.loads(plan.read_text(encoding="utf-8")).get("shards") != n_shards:
        shutil.rmtree(partial)  # another shard plan (a changed SHARD_BYTES): start over
    (partial / "shards").mkdir(parents=True, exist_ok=True)
    (partial / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    plan.write_text(json.dumps({"shards": n_shards}), encoding="utf-8")


def _shard_bin(partial: Path, i: int) -> Path:
    return partial / "shards" / f"{i:05d}.bin"


def _finished(partial: Path, i: int, itemsize: int) -> ShardStats | None:
    marker = partial / "shards" / f"{i:05d}.json"
    if not marker.is_file():
        return None
    stats = ShardStats(**json.loads(marker.read_text(encoding="utf-8")))
    binary = _shard_bin(partial, i)
    return stats if binary.is_file() and binary.stat().st_size == stats.tokens * itemsize else None


def _run_shards(partial: Path, shards: list[list[Part]], eot_id: int, vocab_size: int, text_field: str,
                chunk_chars: int, workers: int) -> ShardStats:
    itemsize = token_dtype(vocab_size).itemsize
    total = ShardStats()
    pending = []
    for i in range(len(shards)):
        done = _finished(partial, i, itemsize)
        if done is None:
            pending.append(i)
        else:
            total.add(done)
    sizes = [sum(_part_bytes(p) for p in shard) for shard in shards]
    jobs = [(partial, i, shards[i], eot_id, vocab_size, text_field, chunk_chars) for i in pending]
    workers = min(workers or available_cores(), len(jobs))
    with tqdm(total=sum(sizes), initial=sum(sizes) - sum(sizes[i] for i in pending), desc="tokenizing",
              unit="B", unit_scale=True, delay=1.0, file=sys.stderr) as bar:
        if workers <= 1:  # in this process; HF's encode_batch still uses every core
            for job in jobs:
                total.add(tokenize_shard(*job, progress=lambda n: bar.update(n)))
        else:
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_worker_init) as pool:
                futures = {pool.submit(tokenize_shard, *job): job[1] for job in jobs}
                for future in as_completed(futures):
                    total.add(future.result())
                    bar.update(sizes[futures[future]])
    return total


def _worker_init() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _part_bytes(part: Part) -> int:
    return (part.end if part.end is not None else part.file.size) - part.start


def tokenize_shard(partial: Path, index: int, parts: list[Part], eot_id: int, vocab_size: int, text_field: str,
                   chunk_chars: int, progress: Callable[[int], None] | None = None) -> ShardStats:
    """Encode one shard into shards/NNNNN.bin (temporary name, then renamed), then write NNNNN.json."""
    tokenizer = Tokenizer.load(partial / "tokenizer.json")
    dtype = token_dtype(vocab_size)
    reading = Reading()
    stats = ShardStats()
    if parts:
        pieces = iter_pieces(parts, text_field, chunk_chars, reading)
    else:
        pieces = (p for text in builtin_texts() for p in mark_last(rechunk([text], chunk_chars)))
    reported = 0
    tmp = _shard_bin(partial, index).with_suffix(".bin.tmp")
    with open(tmp, "wb") as out:
        for ids in encode_pieces(pieces, tokenizer, eot_id, stats):
            np.asarray(ids, dtype=dtype).tofile(out)
            if progress is not None:
                progress(reading.bytes_read - reported)
                reported = reading.bytes_read
    stats.replaced_bytes = reading.replaced_bytes
    os.replace(tmp, _shard_bin(partial, index))
    marker = partial / "shards" / f"{index:05d}.json"
    write_json_atomic(marker, asdict(stats), indent=None)
    return stats
