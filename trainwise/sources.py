"""Where the text comes from: paths to files, files to text pieces.

    paths ─discover_files─> files ─iter_texts─> text pieces (whole documents or parts of long ones)

Sources: .txt and .md (one file = one document), .jsonl (one document per line, in the field
`DataConfig.text_field`), .parquet (one document per row, same field), directories (recursive, hidden
entries skipped) and globs. An explicitly named file with another suffix is read as plain text. With no
paths the built-in corpus is used (see BUILTIN_CORPUS_DESCRIPTION).

Files are read in chunks of about `chunk_chars` characters cut at whitespace (so a 1 GB single-line file
is fine); a .jsonl line is parsed whole, since a JSON value cannot be parsed in parts. Bytes that are not
UTF-8 become U+FFFD and are counted.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from trainwise.config import DataConfig
from trainwise.errors import TrainwiseError

BUILTIN_CORPUS_DESCRIPTION = (
    "the built-in corpus: the English reference documentation that CPython ships in "
    "pydoc_data.topics (about 80 topics, 0.5-0.7 MB of text, depending on the Python version)"
)
TEXT_SUFFIXES = (".txt", ".md")
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
CHUNK_CHARS = 1_000_000  # long documents are read and cut into pieces of about this size
SNIFF_BYTES = 8192
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # how the 'surrogateescape' decoder marks a bad byte


def discover_files(paths: list[str]) -> list[Path]:
    """Expand files, directories (recursively) and globs into a de-duplicated list of corpus files, in
    the order given, each directory or glob in sorted order; refuse missing paths, directories and
    globs without supported files, and binary files."""
    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            found[path] = None
        elif path.is_dir():
            files = _supported_under(path)
            if not files:
                raise TrainwiseError(
                    f"directory '{raw}' contains no supported text files ({_suffix_list()}); point "
                    "data.paths at a directory with text files, or at the files themselves."
                )
            found.update(dict.fromkeys(files))
        elif any(c in raw for c in "*?["):
            files = []
            for match in sorted(glob.glob(os.path.expanduser(raw), recursive=True)):
                match_path = Path(match)
                if match_path.is_dir():
                    files += _supported_under(match_path)
                elif match_path.suffix.lower() in SUPPORTED_SUFFIXES:
                    files.append(match_path)
            if not files:
                raise TrainwiseError(
                    f"glob '{raw}' matches no supported text files ({_suffix_list()}); check the pattern "
                    "(use ** for subdirectories, and quote it so the shell does not expand it)."
                )
            found.update(dict.fromkeys(files))
        else:
            raise TrainwiseError(
                f"data path '{raw}' does not exist; pass existing files, directories or globs "
                "(e.g. --data 'books/**/*.txt'), or no path for the built-in corpus."
            )
    for path in found:
        if path.suffix.lower() != ".parquet":
            _refuse_binary(path)
    return list(found)


def _supported_under(directory: Path) -> list[Path]:
    files = []
    for path in directory.rglob("*"):
        hidden = any(part.startswith(".") for part in path.relative_to(directory).parts)
        if not hidden and path.is_file() and path.suffix.lower() in SUPPORTED_SUFFIXES:
            files.append(path)
    return sorted(files)


def _suffix_list() -> str:
    return ", ".join(SUPPORTED_SUFFIXES)


def _refuse_binary(path: Path) -> None:
    """NUL bytes, or more than 30% bytes that are neither text nor UTF-8, in the first 8 KB."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if not head:
        return
    text = head.decode("utf-8", "replace")
    odd = sum(1 for ch in text if ch == "\ufffd" or (ord(ch) < 32 and ch not in "\t\n\r\f\v\b\x1b"))
    has_nul = b"\x00" in head
    if has_nul or odd > 0.3 * len(text):
        what = "NUL bytes" if has_nul else "mostly non-text bytes"
        raise TrainwiseError(
            f"'{path}' looks like a binary file, not text (its first 8 KB hold {what}). Remove it from the data "
            f"paths, or pass only text files ({_suffix_list()})."
        )


# ---------------------------------------------------------------------------------------------------
# Reading text


@dataclass
class Reading:
    """Counters filled in while reading."""

    bytes_read: int = 0  # input bytes consumed, for the progress bar
    invalid_utf8: int = 0  # bytes that were not valid UTF-8, each replaced by U+FFFD


def iter_texts(data_cfg: DataConfig, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """The corpus as text pieces of at most about `chunk_chars` characters: whole documents, or
    consecutive parts of a long one. The built-in corpus when data_cfg.paths is empty."""
    files = discover_files(data_cfg.paths) if data_cfg.paths else None
    for piece, _ in iter_pieces(files, data_cfg.text_field, chunk_chars, Reading()):
        yield piece


def iter_pieces(files: list[Path] | None, text_field: str, chunk_chars: int,
                 reading: Reading) -> Iterator[tuple[str, bool]]:
    """(piece, is_last_piece_of_its_document) over the whole corpus; empty documents yield nothing."""
    if files is None:
        for text in builtin_texts():
            yield from _document(text, chunk_chars)
            reading.bytes_read += len(text.encode("utf-8"))
        return
    for path in files:
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _read_jsonl(path, text_field, chunk_chars, reading)
        elif suffix == ".parquet":
            yield from _read_parquet(path, text_field, chunk_chars, reading)
        else:
            yield from mark_last(rechunk(_read_chunks(path, chunk_chars, reading), chunk_chars))


def builtin_texts() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def _read_chunks(path: Path, chunk_chars: int, reading: Reading) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")  # keeps split characters whole
    with open(path, "rb") as f:
        while raw := f.read(chunk_chars):
            reading.bytes_read += len(raw)
            yield _replace_invalid(decoder.decode(raw), reading)
        yield _replace_invalid(decoder.decode(b"", final=True), reading)


def _replace_invalid(text: str, reading: Reading) -> str:
    text, n = _ESCAPED_BYTE.subn("\ufffd", text)
    reading.invalid_utf8 += n
    return text


def _read_jsonl(path: Path, text_field: str, chunk_chars: int, reading: Reading) -> Iterator[tuple[str, bool]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            reading.bytes_read += len(raw)
            line = _replace_invalid(raw.decode("utf-8", "surrogateescape"), reading)
            if not line.strip():
                continue
            where = f"'{path}' line {lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise TrainwiseError(
                    f"{where} is not valid JSON ({err.msg} at column {err.colno}); each line of a .jsonl "
                    "file must be one JSON object. Fix or remove that line."
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else []
                raise TrainwiseError(
                    f"{where} has no '{text_field}' field (it has {keys or 'no fields'}); every line needs "
                    f"one, or set data.text_field to the field that holds the text."
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise TrainwiseError(
                    f"{where}: field '{text_field}' is {type(text).__name__}, not a string; point "
                    "data.text_field at the field that holds the text."
                )
            yield from _document(text, chunk_chars)


def _read_parquet(path: Path, text_field: str, chunk_chars: int, reading: Reading) -> Iterator[tuple[str, bool]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TrainwiseError(
            f"reading '{path}' needs pyarrow, which is not installed: `pip install pyarrow` (or "
            "trainwise[parquet]), or convert the file to .jsonl."
        ) from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a bad file
        raise TrainwiseError(f"'{path}' is not a readable Parquet file ({err}); remove it or re-export it.") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise TrainwiseError(
            f"'{path}' has no column '{text_field}' (its columns: {columns}); set data.text_field to "
            "the column that holds the text."
        )
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise TrainwiseError(
                    f"'{path}' row {row}: column '{text_field}' holds {type(text).__name__}, not a string; "
                    "drop such rows or set data.text_field to a string column."
                )
            yield from _document(text, chunk_chars)
    reading.bytes_read += path.stat().st_size


def _document(text: str, chunk_chars: int) -> Iterator[tuple[str, bool]]:
    return mark_last(rechunk([text], chunk_chars))


def rechunk(parts: Iterable[str], chunk_chars: int) -> Iterator[str]:
    """Re-cut a stream of strings into pieces of at most chunk_chars, cutting where a run of
    whitespace starts. No pre-token of GPT-2's pattern runs from a non-space into a space, and a run
    of spaces is split the same way wherever it starts, so the pieces encode exactly as the whole
    text would."""
    buf = ""
    for part in parts:
        buf += part
        start = 0
        while len(buf) - start >= chunk_chars:
            cut = _cut_point(buf, start, start + chunk_chars)
            yield buf[start:cut]
            start = cut
        buf = buf[start:]
    if buf:
        yield buf


def _cut_point(buf: str, start: int, end: int) -> int:
    cut = max(buf.rfind(ws, start + 1, end) for ws in " \n\t")
    if cut <= start:
        return end  # no whitespace at all: cut anyway
    run_start = cut
    while run_start > start + 1 and buf[run_start - 1].isspace():
        run_start -= 1
    return run_start if run_start > start + 1 else cut  # a run filling the window: cut inside it


def mark_last(items: Iterator[str]) -> Iterator[tuple[str, bool]]:
    previous = None
    for item in items:
        if previous is not None:
            yield previous, False
        previous = item
    if previous is not None:
        yield previous, True


# ---------------------------------------------------------------------------------------------------
# Cache keys
