"""Reading the corpus's files (trainwise.data.sources decided how) into text pieces.

    Part (a file, or a byte range of a large one) ─iter_pieces─> (piece, ends_a_document) ...

Plain text is one document per file; .jsonl one per line, from `DataConfig.text_field`, which may be
a path into nested records ("meta.body", "turns.0.text"); .csv/.tsv one per row, from the column of
that name; Parquet, Arrow and `datasets` folders one per row, from the column (then the path inside
it). Everything is streamed: text is decoded in chunks of about `chunk_chars` characters cut at
whitespace, so a 1 GB single-line file is fine; a .jsonl line is parsed whole, since a JSON value
cannot be parsed in parts. Bytes that do not decode become U+FFFD and are counted (Reading).

A large uncompressed plain-text or .jsonl file in an ASCII-compatible encoding is read as byte ranges
(`split_points`), so that several processes can tokenize it and an interrupted run redoes only the
ranges it had not finished. A text range starts where a run of whitespace starts, before a newline,
so the pieces tokenize as the whole file does (see rechunk).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from trainwise.data.sources import SourceFile, default_corpus, discover, open_binary, require
from trainwise.errors import TrainwiseError

CHUNK_CHARS = 1_000_000  # long documents are read and cut into pieces of about this size
SPLITTABLE = {"utf-8", "utf-8-sig", "ascii", "gb18030", "gbk", "gb2312", "big5", "big5hkscs", "cp950",
              "shift_jis", "cp932", "euc_jp", "euc_kr", "cp949"}  # a 0x0A byte is always a newline in these
_replaced = [0]  # bytes replaced so far in this process, by the "trainwise-count" error handler


def _count_and_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    _replaced[0] += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("trainwise-count", _count_and_replace)


@dataclass
class Reading:
    """Counters filled in while reading."""

    bytes_read: int = 0  # on-disk bytes consumed, for the progress bar
    replaced_bytes: int = 0  # input bytes that did not decode, replaced by U+FFFD


@dataclass(frozen=True)
class Part:
    """A file, or the byte range [start, end) of one (end None = to the end of the file)."""

    file: SourceFile
    start: int = 0
    end: int | None = None

    @property
    def reaches_end(self) -> bool:
        return self.end is None or self.end >= self.file.size


def splittable(f: SourceFile) -> bool:
    """Whether `f` can be read in byte ranges: uncompressed text or .jsonl in an encoding where a 0x0A
    byte is always a newline (UTF-8, the CJK multi-byte encodings, single-byte code pages)."""
    if f.format not in ("text", "jsonl") or f.compression:
        return False
    codec = codecs.lookup(f.encoding).name
    return codec in SPLITTABLE or len(bytes(range(128, 256)).decode(codec, "replace")) == 128


def split_points(f: SourceFile, target_bytes: int) -> list[int]:
    """Byte offsets (after 0) where `f` can be cut into ranges of about target_bytes: before a newline
    that follows a non-whitespace byte for text (a run of whitespace starts there), after a newline
    for .jsonl."""
    points = []
    with open(f.path, "rb") as fh:
        at = target_bytes
        while at < f.size:
            fh.seek(at - 1)
            window = fh.read(1 << 20)
            cut = _cut_in(window, f.format)
            while cut is None and window and at < f.size:  # no cut in this window: look further
                at += len(window) - 1
                fh.seek(at - 1)
                window = fh.read(1 << 20)
                cut = _cut_in(window, f.format)
            if cut is None:
                break
            point = at - 1 + cut
            if point >= f.size:
                break
            points.append(point)
            at = point + target_bytes
    return points


def _cut_in(window: bytes, fmt: str) -> int | None:
    """Offset in window (>= 1) of a cut, or None."""
    start = 0
    while (nl := window.find(b"\n", start + 1)) != -1:
        if fmt == "jsonl":
            return nl + 1
        if window[nl - 1:nl] not in b" \t\r\n\x0b\x0c":
            return nl
        start = nl
    return None


def iter_pieces(parts: Iterable[Part], text_field: str, chunk_chars: int,
                reading: Reading) -> Iterator[tuple[str, bool]]:
    """(piece, is_last_piece_of_its_document) over the parts; empty documents yield nothing."""
    for part in parts:
        f = part.file
        before = _replaced[0]
        try:  # undecodable bytes are counted and replaced ("trainwise-count"); a codec can refuse the whole stream
            if f.format == "text":
                pieces = mark_last(rechunk(_text_chunks(part, chunk_chars, reading), chunk_chars))
                yield from ((p, last and part.reaches_end) for p, last in pieces)
            elif f.format == "jsonl":
                yield from _jsonl(part, text_field, chunk_chars)
            elif f.format in ("csv", "tsv"):
                yield from _csv(f, text_field, chunk_chars)
            else:
                yield from _table(f, text_field, chunk_chars)
        except UnicodeError as err:
            raise TrainwiseError(f"'{f.path}' cannot be read as {f.encoding} ({err}); give its encoding "
                                 "(data.encoding, `trainwise data --encoding`), or auto to detect it.") from None
        reading.replaced_bytes += _replaced[0] - before
        if f.format != "text":
            reading.bytes_read += (part.end if part.end is not None else f.size) - part.start


def _decoder(part: Part):
    codec = part.file.encoding
    if part.start > 0 and codec == "utf-8-sig":
        codec = "utf-8"  # the BOM is at the start of the file only
    return codecs.getincrementaldecoder(codec)("trainwise-count")


def _text_chunks(part: Part, chunk_chars: int, reading: Reading) -> Iterator[str]:
    decoder = _decoder(part)  # incremental: a character split between two reads stays whole
    left = None if part.end is None else part.end - part.start
    with open_binary(part.file.path, part.file.compression) as stream:
        if part.start:
            stream.seek(part.start)
        while left is None or left > 0:
            raw = stream.read(chunk_chars if left is None else min(chunk_chars, left))
            if not raw:
                break
            if left is not None:
                left -= len(raw)
            if not part.file.compression:
                reading.bytes_read += len(raw)
            yield decoder.decode(raw)
        yield decoder.decode(b"", final=True)
    if part.file.compression:
        reading.bytes_read += part.file.size


def _lines(part: Part) -> Iterator[tuple[str, str]]:
    """(where, line) of a line-based file: "'path' line N", or "'path' byte B" in a later byte range
    (read as bytes: a 0x0A byte is a newline in every splittable encoding)."""
    path, codec = part.file.path, part.file.encoding
    with open_binary(path, part.file.compression) as stream:
        if part.start == 0 and part.end is None:
            text = io.TextIOWrapper(stream, encoding=codec, errors="trainwise-count")
            for number, line in enumerate(text, start=1):
                yield f"'{path}' line {number}", line
            return
        codec = "utf-8" if codec == "utf-8-sig" and part.start else codec
        stream.seek(part.start)
        at, end = part.start, part.file.size if part.end is None else part.end
        for raw in stream:
            if at >= end:
                break
            yield f"'{path}' byte {at}", raw.decode(codec, "trainwise-count")
            at += len(raw)


def _jsonl(part: Part, text_field: str, chunk_chars: int) -> Iterator[tuple[str, bool]]:
    for where, line in _lines(part):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise TrainwiseError(
                f"{where} is not valid JSON ({err.msg} at column {err.colno}); each line of a .jsonl file "
                "must be one JSON object. Fix or remove that line."
            ) from None
        text = field_text(record, text_field, where)
        if text:
            yield from _document(text, chunk_chars)


def _csv(f: SourceFile, text_field: str, chunk_chars: int) -> Iterator[tuple[str, bool]]:
    csv.field_size_limit(sys.maxsize)  # a document can be long
    with open_binary(f.path, f.compression) as stream:
        text = io.TextIOWrapper(stream, encoding=f.encoding, errors="trainwise-count", newline="")
        reader = csv.reader(text, delimiter="\t" if f.format == "tsv" else ",")
        header = next(reader, None)
        if header is None:
            return
        if text_field not in header:
            raise TrainwiseError(
                f"'{f.path}' has no column '{text_field}' (its header: {header[:20]}); set data.text_field to "
                "the column that holds the text."
            )
        column = header.index(text_field)
        for row in reader:
            if column < len(row) and row[column]:
                yield from _document(row[column], chunk_chars)


def _table(f: SourceFile, text_field: str, chunk_chars: int) -> Iterator[tuple[str, bool]]:
    """Parquet and Arrow (file or stream format, as `datasets` writes it), in record batches."""
    require(f.format, f.path)
    names, _ = _open_table(f)
    column, rest = (text_field, "") if text_field in names else text_field.partition(".")[::2]
    if column not in names:
        raise TrainwiseError(
            f"'{f.path}' has no column '{column}' (its columns: {names}); set data.text_field to the column "
            "that holds the text (a nested field as column.key)."
        )
    row = 0
    for batch in _open_table(f, column)[1]:
        for value in batch.column(0).to_pylist():
            row += 1
            text = field_text(value, rest, f"'{f.path}' row {row} (column '{column}')") if rest else \
                _as_text(value, f"'{f.path}' row {row}: column '{column}'")
            if text:
                yield from _document(text, chunk_chars)


def _open_table(f: SourceFile, column: str | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if f.format == "parquet":
            table = pq.ParquetFile(f.path)
            names = table.schema_arrow.names
            batches = table.iter_batches(batch_size=1024, columns=[column]) if column else None
            return names, batches
        source = pa.memory_map(str(f.path))
        try:
            reader = pa.ipc.open_file(source)
            names = reader.schema.names
            batches = (reader.get_batch(i).select([column]) for i in range(reader.num_record_batches)) \
                if column else None
        except pa.ArrowInvalid:
            reader = pa.ipc.open_stream(pa.memory_map(str(f.path)))
            names = reader.schema.names
            batches = (b.select([column]) for b in reader) if column else None
        return names, batches
    except (pa.ArrowInvalid, OSError) as err:
        raise TrainwiseError(f"'{f.path}' is not a readable {f.format} file ({err}); remove it or re-export it.") \
            from None


def field_text(record, path: str, where: str) -> str:
    """record[path], where path may lead into nested objects and lists ("meta.body", "turns.0.text");
    a key that itself holds dots is taken first. None (a null field) is an empty document."""
    if isinstance(record, dict) and path in record:
        return _as_text(record[path], f"{where}: field '{path}'")
    value = record
    for key in path.split("."):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            keys = sorted(record) if isinstance(record, dict) else []
            raise TrainwiseError(
                f"{where} has no '{path}' field (it has {keys or 'no fields'}); every record needs one, or set "
                "data.text_field to the field that holds the text (a nested one as a.b or a.0.b)."
            )
    return _as_text(value, f"{where}: field '{path}'")


def _as_text(value, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TrainwiseError(
            f"{where} is {type(value).__name__}, not a string; point data.text_field at the field that holds "
            "the text."
        )
    return value


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


def builtin_texts() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def iter_documents(data_cfg, chunk_chars: int = CHUNK_CHARS) -> Iterator[tuple[str, bool]]:
    """The corpus of data_cfg (every source of a mixture, in order) as (piece, ends_a_document): whole
    documents, or consecutive parts of at most about chunk_chars characters of a long one. The
    built-in corpus when there are no paths."""
    for cfg in data_cfg.source_configs() if data_cfg.sources else [data_cfg]:
        if default_corpus(cfg):
            for text in builtin_texts():
                yield from _document(text, chunk_chars)
            continue
        parts = [Part(f) for f in discover(cfg).files]
        yield from iter_pieces(parts, cfg.text_field, chunk_chars, Reading())


def iter_texts(data_cfg, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """The pieces of iter_documents, without the document ends."""
    return (piece for piece, _ in iter_documents(data_cfg, chunk_chars))
