"""Fitted laws on disk, one per corpus + tokenizer: `$TRAINWISE_CACHE/scaling/<key>.json`.

A loss in nats per token belongs to one text and one tokenizer, so a fit is keyed the way trainwise.data.corpus
keys its token cache: a hash of the corpus (its files' path, size and mtime, or the built-in corpus's
text), the text field, the chunk size and the tokenizer.json. The file also records the corpus key alone
and the vocab size, so that `trainwise plan` can find a fit without training a tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from trainwise.config import DataConfig
from trainwise.data.corpus import corpus_key, describe
from trainwise.errors import TrainwiseError
from trainwise.files import write_json_atomic
from trainwise.hardware import cache
from trainwise.tokenizer import Tokenizer


def fit_key(data_cfg: DataConfig, tokenizer: Tokenizer) -> str:
    """Same composition as trainwise.data.corpus.prepare_data's cache key."""
    return hashlib.sha256(f"{corpus_key(data_cfg)} {tokenizer.fingerprint()}".encode()).hexdigest()[:32]


def fits_dir(cache_root: str | Path | None = None) -> Path:
    return cache.cache_root(cache_root) / "scaling"


def save_fit(record: dict, data_cfg: DataConfig, tokenizer: Tokenizer, cache_root: str | Path | None = None) -> Path:
    """Write the fit record (law, bootstrap, points, recipe) under its corpus + tokenizer key; the
    record gains the keys that say which corpus and tokenizer it belongs to."""
    record.update({"corpus": describe(data_cfg), "corpus_key": corpus_key(data_cfg),
              "vocab_size": tokenizer.vocab_size, "tokenizer_fingerprint": tokenizer.fingerprint()})
    path = fits_dir(cache_root) / f"{fit_key(data_cfg, tokenizer)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    return path


# What `trainwise scale predict` and `optimal` read from a fit record (scale.fitting), and the fields of its law
# (scale.law.Law's, which this module sits below)
FIT_KEYS = ("law", "bootstrap", "runs", "conventions")
LAW_KEYS = ("E", "A", "B", "alpha", "beta")


def load_fit_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise TrainwiseError(f"fit file '{path}' does not exist; `trainwise scale fit RUN...` writes one "
                             "(its path is printed), or leave --fit out to use the stored fit of the corpus.")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        record, why = None, f"not JSON: {err}"
    else:
        why = _not_a_fit(record)
    if why:
        raise TrainwiseError(f"fit file '{path}' is not a fit record of `trainwise scale fit` ({why}); pass the "
                             "file it printed, or leave --fit out to use the stored fit of the corpus.")
    return record


def _not_a_fit(record) -> str | None:
    """What keeps a JSON value from being read as a fit record, or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if missing := [key for key in FIT_KEYS if key not in record]:
        return f"no {', '.join(missing)}"
    law = record["law"]
    if not (isinstance(law, dict) and all(isinstance(law.get(k), (int, float)) for k in LAW_KEYS)):
        return f"its law is not {{{', '.join(LAW_KEYS)}}} as numbers"
    return None


def stored_fits(cache_root: str | Path | None = None) -> list[tuple[Path, dict]]:
    """Every readable fit record in the store, newest first."""
    root = fits_dir(cache_root)
    found = []
    for path in root.glob("*.json") if root.is_dir() else []:
        try:
            found.append((path.stat().st_mtime, path, json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue
    return [(path, record) for _, path, record in sorted(found, key=lambda t: -t[0])]


def find_fit(data_cfg: DataConfig, vocab_size: int, cache_root: str | Path | None = None) -> tuple[Path, dict] | None:
    """The stored fit for this corpus and vocab size (the newest, if tokenizers differ), or None."""
    key = corpus_key(data_cfg)
    return next(((path, record) for path, record in stored_fits(cache_root)
                 if record.get("corpus_key") == key and record.get("vocab_size") == vocab_size), None)
