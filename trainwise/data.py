"""The corpus, from files on disk to batches of token windows.

    paths ─sources─> text pieces ─prepare_data─> train/val token memmaps
    train tokens ─BatchSampler─> (x, y) batches;  unigram_loss(data): the no-context baseline

Which files and formats are read, and how, is trainwise.sources. Nothing holds the whole corpus in
memory: the text pieces are encoded in batches on all cores, and the tokens are appended to one flat
file that is then memory-mapped. Documents are separated by the end-of-text token, appended after each
one (nanoGPT's OpenWebText preparation does the same).

Tokenized corpora are cached under `resolve_cache_root()/data/<key>/`, keyed by a hash of the input files
(path, size, mtime), the text field, the chunk size and the tokenizer.json; the train/validation split
is just an offset into the cached file, so changing val_fraction reuses the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from tqdm import tqdm

from trainwise.config import DataConfig
from trainwise.errors import TrainwiseError
from trainwise.sources import (BUILTIN_CORPUS_DESCRIPTION, CHUNK_CHARS, Reading, builtin_texts, discover_files,
                               iter_pieces, mark_last, rechunk)
from trainwise.tokenizer import Tokenizer

# Each encode_batch call gets about BATCH_CHARS of text in pieces of about ENCODE_CHARS: enough pieces
# to keep many cores busy, while HF's Encoding objects (~300 bytes per token) stay near 100 MB.
ENCODE_CHARS = 16_384
BATCH_CHARS = 1_000_000
MAX_TOKENIZER_TRAIN_CHARS = 100_000_000  # BPE merges are learned on at most this much text
CACHE_FORMAT = 1


def resolve_cache_root(root: str | Path | None = None) -> Path:
    """The cache directory: `root` if given, else $TRAINWISE_CACHE, else ~/.cache/trainwise."""
    if root is None:
        root = os.environ.get("TRAINWISE_CACHE") or Path.home() / ".cache" / "trainwise"
    return Path(root).expanduser()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the file when every token id fits (ids 0..65535), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


# ---------------------------------------------------------------------------------------------------
# Finding and checking files


def _corpus_key(files: list[Path] | None, text_field: str, chunk_chars: int) -> str:
    h = hashlib.sha256(f"format={CACHE_FORMAT} field={text_field} chunk={chunk_chars}\n".encode())
    if files is None:
        for text in builtin_texts():  # ~0.5 MB: hashing the contents is cheap and exact
            h.update(text.encode("utf-8"))
    else:
        for path in files:
            st = path.stat()
            h.update(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _describe(data_cfg: DataConfig) -> str:
    if not data_cfg.paths:
        return BUILTIN_CORPUS_DESCRIPTION
    shown = ", ".join(f"'{p}'" for p in data_cfg.paths[:3])
    return "data.paths " + shown + (f" and {len(data_cfg.paths) - 3} more" if len(data_cfg.paths) > 3 else "")


def prepare_tokenizer(data_cfg: DataConfig, vocab_size: int, cache_root: str | Path | None = None,
                      max_train_chars: int = MAX_TOKENIZER_TRAIN_CHARS) -> Tokenizer:
    """Train a tokenizer on (the first max_train_chars characters of) the corpus, or load the one
    trained before on the same corpus, vocab size and tokenizers version."""
    files = discover_files(data_cfg.paths) if data_cfg.paths else None
    key = hashlib.sha256(
        f"{_corpus_key(files, data_cfg.text_field, CHUNK_CHARS)} vocab={vocab_size} "
        f"max={max_train_chars} tokenizers={tokenizers.__version__}".encode()
    ).hexdigest()
    path = resolve_cache_root(cache_root) / "tokenizers" / f"{key[:32]}.json"
    if path.is_file():
        return Tokenizer.load(path)

    def pieces(bar: tqdm) -> Iterator[str]:
        for piece, _ in iter_pieces(files, data_cfg.text_field, CHUNK_CHARS, Reading()):
            yield piece
            bar.update(len(piece))
            if bar.n >= max_train_chars:
                return

    with tqdm(desc="training tokenizer", unit="char", unit_scale=True, delay=1.0, file=sys.stderr) as bar:
        tok = Tokenizer.train(pieces(bar), vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(path)
    return tok


# ---------------------------------------------------------------------------------------------------
# Tokenizing into a memory-mapped file


@dataclass
class DataStats:
    files: int  # 0 for the built-in corpus
    documents: int
    bytes: int  # UTF-8 bytes of text encoded
    tokens: int  # including one end-of-text token per document
    invalid_utf8: int  # input bytes that were not UTF-8, replaced by U+FFFD
    seconds: float  # time the tokenization took (when the cache entry was made)


@dataclass
class TokenData:
    train: np.memmap  # the first (1 - val_fraction) of the token stream
    val: np.memmap  # the rest
    stats: DataStats
    path: Path  # the cache entry: tokens.bin and meta.json
    vocab_size: int
    eot_id: int
    cache_hit: bool  # True when the tokens came from an earlier run


def prepare_data(data_cfg: DataConfig, tokenizer: Tokenizer, seq_len: int,
                 cache_root: str | Path | None = None, chunk_chars: int = CHUNK_CHARS) -> TokenData:
    """Tokenize the corpus once (or reuse the cache) and split it into train and validation tokens,
    each long enough for at least one sequence of seq_len + 1 tokens."""
    data_cfg.validate()
    files = discover_files(data_cfg.paths) if data_cfg.paths else None
    key = hashlib.sha256(
        f"{_corpus_key(files, data_cfg.text_field, chunk_chars)} {tokenizer.fingerprint()}".encode()
    ).hexdigest()
    entry = resolve_cache_root(cache_root) / "data" / key[:32]
    cache_hit = (entry / "meta.json").is_file()
    if not cache_hit:
        _build_entry(entry, files, data_cfg, tokenizer, chunk_chars)
    meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    stats = DataStats(**meta["stats"])
    dtype = np.dtype(meta["dtype"])
    n_tokens = stats.tokens
    n_val = int(n_tokens * data_cfg.val_fraction)
    n_train = n_tokens - n_val
    if min(n_train, n_val) < seq_len + 1:
        longest = min(n_train, n_val) - 1
        fix = f"Use a smaller train.seq_len (at most {longest}), a different data.val_fraction, or more text." \
            if longest >= 1 else "Add more text (or raise data.val_fraction)."
        raise TrainwiseError(
            f"the corpus ({_describe(data_cfg)}) has {n_tokens:,} tokens: {n_train:,} for training and "
            f"{n_val:,} for validation (data.val_fraction = {data_cfg.val_fraction}), but each split needs "
            f"at least seq_len + 1 = {seq_len + 1} tokens for one sequence. {fix}"
        )
    bin_path = entry / "tokens.bin"
    train = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_train,))
    val = np.memmap(bin_path, dtype=dtype, mode="r", offset=n_train * dtype.itemsize, shape=(n_val,))
    return TokenData(train, val, stats, entry, meta["vocab_size"], meta["eot_id"], cache_hit)


def _build_entry(entry: Path, files: list[Path] | None, data_cfg: DataConfig, tokenizer: Tokenizer,
                 chunk_chars: int) -> None:
    """Tokenize into a temporary directory beside `entry`, then rename it: a crash leaves no half
    entry, and of two processes racing, one wins and the other's copy is dropped."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    try:
        stats = _tokenize(files, data_cfg, tokenizer, tmp / "tokens.bin", chunk_chars)
        meta = {
            "format": CACHE_FORMAT,
            "dtype": token_dtype(tokenizer.vocab_size).name,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "sources": [str(p) for p in files] if files is not None else ["builtin:pydoc_data.topics"],
            "stats": asdict(stats),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        try:
            os.rename(tmp, entry)
        except OSError:  # another process made the same entry meanwhile
            if not (entry / "meta.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _tokenize(files: list[Path] | None, data_cfg: DataConfig, tokenizer: Tokenizer, out_path: Path,
              chunk_chars: int) -> DataStats:
    start = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    reading = Reading()
    stats = DataStats(files=len(files or []), documents=0, bytes=0, tokens=0, invalid_utf8=0, seconds=0.0)
    if files is None:
        total = sum(len(t.encode("utf-8")) for t in builtin_texts())
    else:
        total = sum(p.stat().st_size for p in files)
    batch: list[str] = []
    ends: list[bool] = []

    def flush() -> None:
        ids: list[int] = []
        for piece_ids, end in zip(tokenizer.encode_batch(batch), ends):
            ids += piece_ids
            if end:
                ids.append(tokenizer.eot_id)
        np.asarray(ids, dtype=dtype).tofile(out)
        stats.tokens += len(ids)
        stats.documents += sum(ends)
        bar.update(reading.bytes_read - bar.n)
        batch.clear()
        ends.clear()

    with open(out_path, "wb") as out, tqdm(total=total, desc="tokenizing", unit="B", unit_scale=True,
                                            delay=1.0, file=sys.stderr) as bar:
        size = 0
        for piece, end in iter_pieces(files, data_cfg.text_field, chunk_chars, reading):
            stats.bytes += len(piece.encode("utf-8", "surrogatepass"))
            for part, last in mark_last(rechunk([piece], ENCODE_CHARS)):
                batch.append(part)
                ends.append(end and last)
                size += len(part)
                if size >= BATCH_CHARS:
                    flush()
                    size = 0
        if batch:
            flush()
    if stats.tokens == 0:
        raise TrainwiseError(
            f"the corpus ({_describe(data_cfg)}) contains no text: its {stats.files} file(s) are empty or "
            "hold only empty records. Add files with text, or check data.text_field."
        )
    stats.invalid_utf8 = reading.invalid_utf8
    stats.seconds = time.perf_counter() - start
    return stats


# ---------------------------------------------------------------------------------------------------
# Batches


class BatchSampler:
    """Random windows of seq_len + 1 tokens (nanoGPT's get_batch), reproducible and resumable.

    Each call draws the offsets of a whole global batch (micro_batch * world_size windows) from one
    PCG64 generator seeded with `seed`, and keeps rank's slice of them. So all ranks draw the same
    numbers, use disjoint parts of every global batch, and one process with micro_batch * world_size
    sees exactly what the world_size processes see together.
    """

    def __init__(self, tokens: np.ndarray, micro_batch: int, seq_len: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        if micro_batch < 1 or seq_len < 1:
            raise TrainwiseError(f"micro_batch = {micro_batch} and seq_len = {seq_len} must be positive.")
        if not 0 <= rank < world_size:
            raise TrainwiseError(f"rank = {rank} must be in [0, world_size = {world_size}).")
        if len(tokens) < seq_len + 1:
            raise TrainwiseError(
                f"the token split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1} needed for "
                "one sequence; use a smaller train.seq_len or more text."
            )
        self.tokens = tokens
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.batches_drawn = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: int64 tensors of shape (micro_batch, seq_len); y[i, t] = x[i, t + 1] in the stream."""
        # The last valid offset is len - seq_len - 1, so that y's window ends inside the tokens.
        offsets = self.rng.integers(0, len(self.tokens) - self.seq_len, size=self.micro_batch * self.world_size)
        self.batches_drawn += 1
        mine = offsets[self.rank * self.micro_batch:(self.rank + 1) * self.micro_batch]
        windows = np.stack([self.tokens[o:o + self.seq_len + 1] for o in mine]).astype(np.int64)  # (B, T+1)
        x = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
        y = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
        return x, y

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable: the generator state plus what must match on restore."""
        return {
            "rng": self.rng.bit_generator.state,
            "batches_drawn": self.batches_drawn,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.micro_batch * self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seq_len"] != self.seq_len or state["global_batch"] != self.micro_batch * self.world_size:
            raise TrainwiseError(
                f"the saved data sampler drew batches of {state['global_batch']} x {state['seq_len']} tokens "
                f"but this run draws {self.micro_batch * self.world_size} x {self.seq_len}; resume with the "
                "same train.seq_len and micro_batch x number of processes."
            )
        self.rng.bit_generator.state = state["rng"]
        self.batches_drawn = state["batches_drawn"]


def unigram_loss(data: TokenData) -> float:
    """Cross-entropy in nats per token of a unigram model fitted on the train split (add-one
    smoothing) and evaluated on the validation split: the loss a model that ignores context reaches.

        p(v) = (count_train(v) + 1) / (N_train + V),   loss = -sum_v count_val(v) log p(v) / N_val
    """
    train_counts = _bincount(data.train, data.vocab_size).astype(np.float64) + 1.0
    log_p = np.log(train_counts) - np.log(train_counts.sum())
    val_counts = _bincount(data.val, data.vocab_size)
    return float(-(val_counts * log_p).sum() / val_counts.sum())


def _bincount(tokens: np.ndarray, vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), chunk):  # in chunks: the memmap may not fit in memory
        counts += np.bincount(tokens[start:start + chunk], minlength=vocab_size)
    return counts
