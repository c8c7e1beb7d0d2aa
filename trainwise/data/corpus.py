"""The corpus, from files on disk to batches of token windows.

    paths ─sources.discover─> files ─tokencache (shards, all cores)─> train/val token memmaps
    train tokens ─batches.BatchSampler─> (x, y) batches;  unigram_loss(data): the no-context baseline

Which files are read, and how (formats, encodings, binaries skipped), is trainwise.data.sources and
trainwise.data.formats; tokenizing into the cache, in parallel and resumably, is trainwise.data.tokencache.
Documents are separated by the end-of-text token, appended after each one (nanoGPT's OpenWebText
preparation does the same).

Tokenized corpora are cached under `$TRAINWISE_CACHE/data/<key>/` (trainwise.hardware.cache.cache_root), keyed by a hash
of the input files (path, size, mtime), the decisions made reading them (format, compression, encoding), the text field,
the chunk size and the tokenizer.json; the train/validation split is just an offset into the cached file, so changing
val_fraction reuses the cache.

A mixture (`[[data.sources]]`, each with paths and a weight) is tokenized source by source, each into
its own cache entry, split into train and validation each, and sampled in proportion to the weights.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tokenizers
from tqdm import tqdm

from trainwise.config import DataConfig
from trainwise.data import tokencache
from trainwise.data.batches import Mixture
from trainwise.data.formats import CHUNK_CHARS, Reading, builtin_texts, iter_pieces
from trainwise.data.sources import (
    BUILTIN_CORPUS_DESCRIPTION,
    STDLIB_CORPUS,
    STDLIB_CORPUS_DESCRIPTION,
    Corpus,
    default_corpus,
    discover,
)
from trainwise.errors import TrainwiseError
from trainwise.hardware import cache
from trainwise.tokenizer import Tokenizer

MAX_TOKENIZER_TRAIN_BYTES = 100_000_000  # BPE merges are learned on a seeded sample of at most this much
TOKENIZER_SAMPLE_UNIT_BYTES = 1_000_000  # the sample is drawn in pieces (files or byte ranges) of this size
CACHE_FORMAT = 3


# ---------------------------------------------------------------------------------------------------
# The corpus and its keys


def corpus_of(data_cfg: DataConfig) -> Corpus | None:
    """The files of data_cfg (every source's, for a mixture); None for the built-in corpus."""
    if data_cfg.sources:
        merged = Corpus(files=[])
        for source in data_cfg.source_configs():
            found = discover(source)
            for name in ("files", "binary", "duplicates", "broken", "notes"):
                getattr(merged, name).extend(getattr(found, name))
        return merged
    return None if default_corpus(data_cfg) else discover(data_cfg)


def _corpus_key(corpus: Corpus | None, text_field: str, chunk_chars: int) -> str:
    h = hashlib.sha256(f"format={CACHE_FORMAT} field={text_field} chunk={chunk_chars}\n".encode())
    if corpus is None:
        for text in builtin_texts():  # ~0.5 MB: hashing the contents is cheap and exact
            h.update(text.encode("utf-8"))
    else:
        h.update(corpus.key().encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def corpus_key(data_cfg: DataConfig, chunk_chars: int = CHUNK_CHARS) -> str:
    """A hash of what data_cfg reads and how (files, decoding decisions, text field, chunk size): the
    token cache's key before the tokenizer is added, and the key of the scaling-law fits."""
    return _corpus_key(corpus_of(data_cfg), data_cfg.text_field, chunk_chars)


def describe(data_cfg: DataConfig) -> str:
    if data_cfg.sources:
        return f"the mixture of {len(data_cfg.sources)} data.sources"
    if default_corpus(data_cfg):
        return BUILTIN_CORPUS_DESCRIPTION
    if data_cfg.paths == [STDLIB_CORPUS]:
        return STDLIB_CORPUS_DESCRIPTION
    shown = ", ".join(f"'{p}'" for p in data_cfg.paths[:3])
    return "data.paths " + shown + (f" and {len(data_cfg.paths) - 3} more" if len(data_cfg.paths) > 3 else "")


def prepare_tokenizer(data_cfg: DataConfig, vocab_size: int, cache_root: str | Path | None = None,
                      max_train_bytes: int = MAX_TOKENIZER_TRAIN_BYTES, say=None) -> Tokenizer:
    """Train a tokenizer on the corpus (on a seeded sample of about max_train_bytes of it when it is
    larger), or load the one trained before on the same corpus, vocab size and tokenizers version."""
    corpus = corpus_of(data_cfg)
    key = hashlib.sha256(
        f"{_corpus_key(corpus, data_cfg.text_field, CHUNK_CHARS)} vocab={vocab_size} "
        f"max={max_train_bytes} tokenizers={tokenizers.__version__}".encode()
    ).hexdigest()
    path = cache.cache_root(cache_root) / "tokenizers" / f"{key[:32]}.json"
    if path.is_file():
        return Tokenizer.load(path)
    if corpus is None:
        texts: Iterator[str] = builtin_texts()
    else:
        units = tokencache.plan_shards(corpus.files, TOKENIZER_SAMPLE_UNIT_BYTES)
        if corpus.bytes > max_train_bytes:
            units = _seeded_sample(units, max_train_bytes)
            if say is not None:
                say(f"tokenizer: the corpus is {corpus.bytes / 1e6:,.0f} MB (10^6 bytes); BPE merges are learned "
                    f"on a seeded sample of {sum(_unit_bytes(u) for u in units) / 1e6:,.0f} MB in "
                    f"{len(units):,} pieces (at most {max_train_bytes / 1e6:,.0f} MB)")
        parts = [part for unit in units for part in unit]
        texts = (piece for piece, _ in iter_pieces(parts, data_cfg.text_field, CHUNK_CHARS, Reading()))

    def counted(bar: tqdm) -> Iterator[str]:
        for piece in texts:
            yield piece
            bar.update(len(piece))

    with tqdm(desc="training tokenizer", unit="char", unit_scale=True, delay=1.0, file=sys.stderr) as bar:
        tok = Tokenizer.train(counted(bar), vocab_size)
        if bar.n == 0:  # no merge learned: the bytes alone, which a corpus with text would not give
            raise TrainwiseError(f"{describe(data_cfg)}: {tokencache.NO_TEXT}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(path)
    return tok


def _unit_bytes(unit) -> int:
    return sum((p.end if p.end is not None else p.file.size) - p.start for p in unit)


def _seeded_sample(units: list, budget: int) -> list:
    """Units drawn in a seeded random order until about `budget` bytes, then put back in corpus order."""
    order = np.random.Generator(np.random.PCG64(0)).permutation(len(units))
    chosen, size = [], 0
    for i in order:
        if size >= budget:
            break
        chosen.append(int(i))
        size += _unit_bytes(units[i])
    return [units[i] for i in sorted(chosen)]


# ---------------------------------------------------------------------------------------------------
# Tokenizing into a memory-mapped file


@dataclass
class DataStats:
    files: int  # 0 for the built-in corpus
    documents: int
    bytes: int  # UTF-8 bytes of text encoded
    tokens: int  # including one end-of-text token per document
    replaced_bytes: int  # input bytes that did not decode, replaced by U+FFFD
    seconds: float  # time the tokenization took (when the cache entry was made)
    chars: int = 0  # characters (code points) of text encoded
    report: dict = field(default_factory=dict)  # what discovery found: formats, encodings, skipped files


@dataclass
class TokenData:
    train: np.ndarray | Mixture  # the first (1 - val_fraction) of the token stream (of each source)
    val: np.ndarray | Mixture  # the rest
    stats: DataStats  # summed over the sources of a mixture
    path: Path  # the cache entry: tokens.bin and meta.json (the first source's, for a mixture)
    vocab_size: int
    eot_id: int
    cache_hit: bool  # True when the tokens came from an earlier run
    sources: list[dict] = field(default_factory=list)  # per source of a mixture: name, weight, tokens, ...


def prepare_data(data_cfg: DataConfig, tokenizer: Tokenizer, seq_len: int,
                 cache_root: str | Path | None = None, chunk_chars: int = CHUNK_CHARS,
                 shard_bytes: int = tokencache.SHARD_BYTES) -> TokenData:
    """Tokenize the corpus once (or reuse the cache) and split it into train and validation tokens,
    each long enough for at least one sequence of seq_len + 1 tokens."""
    data_cfg.validate()
    if data_cfg.sources:
        return _prepare_mixture(data_cfg, tokenizer, seq_len, cache_root, chunk_chars, shard_bytes)
    corpus = corpus_of(data_cfg)
    key = hashlib.sha256(
        f"{_corpus_key(corpus, data_cfg.text_field, chunk_chars)} {tokenizer.fingerprint()} "
        f"eot={tokenizer.eot_id}".encode()
    ).hexdigest()
    entry = cache.cache_root(cache_root) / "data" / key[:32]
    cache_hit = (entry / "meta.json").is_file()
    if not cache_hit:
        files = corpus.files if corpus is not None else None
        try:
            tokencache.build(entry, tokencache.plan_shards(files, shard_bytes), tokenizer.to_json(), tokenizer.eot_id,
                             tokenizer.vocab_size, data_cfg.text_field, chunk_chars, data_cfg.workers,
                             meta={"format": CACHE_FORMAT, "files": len(files or []),
                                   "report": corpus.report() if corpus is not None else {},
                                   "sources": [str(f.path) for f in files] if files is not None
                                   else ["builtin:pydoc_data.topics"]})
        except TrainwiseError as err:
            raise TrainwiseError(f"{describe(data_cfg)}: {err}") from None
    meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    stats = DataStats(files=meta["files"], report=meta["report"], **meta["stats"])
    dtype = np.dtype(meta["dtype"])
    n_tokens = stats.tokens
    n_val = int(n_tokens * data_cfg.val_fraction)
    n_train = n_tokens - n_val
    if min(n_train, n_val) < seq_len + 1:
        longest = min(n_train, n_val) - 1
        fix = f"Use a smaller train.seq_len (at most {longest}), a different data.val_fraction, or more text." \
            if longest >= 1 else "Add more text (or raise data.val_fraction)."
        raise TrainwiseError(
            f"the corpus ({describe(data_cfg)}) has {n_tokens:,} tokens: {n_train:,} for training and "
            f"{n_val:,} for validation (data.val_fraction = {data_cfg.val_fraction}), but each split needs "
            f"at least seq_len + 1 = {seq_len + 1} tokens for one sequence. {fix}"
        )
    bin_path = entry / "tokens.bin"
    train = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_train,))
    val = np.memmap(bin_path, dtype=dtype, mode="r", offset=n_train * dtype.itemsize, shape=(n_val,))
    return TokenData(train, val, stats, entry, meta["vocab_size"], meta["eot_id"], cache_hit)


def _prepare_mixture(data_cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, cache_root, chunk_chars: int,
                     shard_bytes: int) -> TokenData:
    parts = []
    for source in data_cfg.source_configs():
        try:
            parts.append(prepare_data(source, tokenizer, seq_len, cache_root, chunk_chars, shard_bytes))
        except TrainwiseError as err:
            raise TrainwiseError(f"data.sources '{source.name}': {err}") from None
    configs = data_cfg.source_configs()
    names = [s.name for s in configs]
    weights = [s.weight for s in configs]
    total = DataStats(0, 0, 0, 0, 0, 0.0, report={"sources": {}})
    for name, p in zip(names, parts):
        for key in ("files", "documents", "bytes", "chars", "tokens", "replaced_bytes", "seconds"):
            setattr(total, key, getattr(total, key) + getattr(p.stats, key))
        total.report["sources"][name] = p.stats.report
    first = parts[0]
    return TokenData(Mixture([p.train for p in parts], weights, names), Mixture([p.val for p in parts], weights, names),
                     total, first.path, first.vocab_size, first.eot_id, all(p.cache_hit for p in parts),
                     sources=[{"name": n, "weight": w, "tokens": p.stats.tokens, "bytes": p.stats.bytes}
                              for n, w, p in zip(names, weights, parts)])


def summary_lines(data: TokenData) -> list[str]:
    """What the data report says beyond the token counts: encodings, skipped files, replaced bytes,
    mixture shares. Empty for a plain UTF-8 corpus with nothing skipped."""
    lines = []
    reports = data.stats.report.get("sources", {"": data.stats.report}) if data.sources else {"": data.stats.report}
    for name, report in reports.items():
        prefix = f"data ({name}): " if name else "data: "
        encodings = report.get("encodings", {})
        if set(encodings) - {"utf-8"}:
            lines.append(prefix + "decoded " + ", ".join(
                f"{codec}: {e['files']} file(s), {e['bytes']:,} bytes" for codec, e in sorted(encodings.items())))
        for kind in ("binary_skipped", "duplicates_skipped", "unreadable_skipped"):
            skipped = report.get(kind, {})
            if skipped.get("files"):
                extra = f", {skipped['bytes']:,} bytes" if "bytes" in skipped else ""
                lines.append(prefix + f"skipped {skipped['files']} {kind.split('_')[0]} file(s){extra}: "
                             + ", ".join(skipped["examples"]) + (" ..." if skipped["files"] > 5 else ""))
        lines += [prefix + note for note in report.get("notes", [])]
    if data.stats.replaced_bytes:
        lines.append(f"data: {data.stats.replaced_bytes:,} input bytes did not decode and were replaced by U+FFFD")
    if data.sources:
        lines.append("data: mixture " + ", ".join(
            f"{s['name']} weight {s['weight']:g} ({s['tokens']:,} tokens)" for s in data.sources))
    return lines


def unigram_loss(data: TokenData) -> float:
    """Cross-entropy in nats per token of a unigram model fitted on the train split (add-one
    smoothing) and evaluated on the validation split: the loss a model that ignores context reaches.

        p(v) = (count_train(v) + 1) / (N_train + V),   loss = -sum_v count_val(v) log p(v) / N_val
    """
    train_counts = _weighted_counts(data.train, data.vocab_size) + 1.0
    log_p = np.log(train_counts) - np.log(train_counts.sum())
    val_counts = _weighted_counts(data.val, data.vocab_size)
    return float(-(val_counts * log_p).sum() / val_counts.sum())


def _weighted_counts(tokens: np.ndarray | Mixture, vocab_size: int) -> np.ndarray:
    """Token counts; for a mixture, each source's counts scaled to its share of the sampled tokens."""
    if not isinstance(tokens, Mixture):
        return _bincount(tokens, vocab_size).astype(np.float64)
    return sum(_bincount(s, vocab_size) * (w * len(tokens) / len(s)) for s, w in zip(tokens.streams, tokens.weights))


def _bincount(tokens: np.ndarray, vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), chunk):  # in chunks: the memmap may not fit in memory
        counts += np.bincount(tokens[start:start + chunk], minlength=vocab_size)
    return counts
