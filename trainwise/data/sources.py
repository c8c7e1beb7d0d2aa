"""Where the text comes from: paths to files, each file's format and encoding decided from its bytes.

    paths ─discover─> Corpus (files with format, compression and encoding; binaries skipped)
          ─trainwise.data.formats─> text pieces

Discovery goes by content, not by name, as `file` and ripgrep do: every regular file under a folder
is sniffed. Compressed files (gzip, zstd, xz, bzip2) are recognised by their magic bytes and sniffed
inside; Parquet and Arrow by theirs; a folder written by Hugging Face `datasets.save_to_disk` by its
state.json. Anything else is text when its first bytes decode as text, else binary: binary files are
skipped and counted (an error only when every file is binary, or when the user named the binary file
itself). Hidden files and folders (.git, .cache, ...) are skipped; symlinks are followed once (a file
reached twice is read once, a loop ends); `include`/`exclude` globs filter the files found in folders.

Encodings: a BOM decides (UTF-8, UTF-16, UTF-32); else UTF-8 when the bytes are UTF-8; else
charset-normalizer's best guess (GB18030, Big5, Shift-JIS, EUC-KR, cp1252, ...), unless
`data.encoding` forces one. The decision is made once per file from its first 64 KB and recorded, so
the report and the token cache key name it.
"""

from __future__ import annotations

import bz2
import codecs
import fnmatch
import glob
import gzip
import hashlib
import io
import json
import lzma
import os
import stat
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from trainwise.config import DataConfig
from trainwise.errors import TrainwiseError

BUILTIN_CORPUS_DESCRIPTION = (
    "the built-in corpus (builtin:docs): the English reference documentation that CPython ships in "
    "pydoc_data.topics (about 80 topics, 0.5-0.7 MB of text, depending on the Python version)"
)
DOCS_CORPUS = "builtin:docs"  # the default corpus by name (an empty data.paths reads the same)
# A second built-in corpus, named as a data path: big enough for a scaling-law sweep, present
# wherever Python is. `trainwise train` keeps the one above as its default; `trainwise scale sweep` takes this.
STDLIB_CORPUS = "builtin:stdlib"
STDLIB_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages"}  # tests and installed packages
STDLIB_SKIPPED_PREFIXES = ("_sysconfigdata", "config-")  # this build's settings (python-config.py): one machine's
STDLIB_CORPUS_DESCRIPTION = (
    f"{STDLIB_CORPUS}: the Python standard library's own source, every .py file under the running Python's "
    "stdlib folder outside its tests, site-packages and build settings (about 12 MB in 730 files on CPython "
    "3.11), in a fixed shuffled order. Code-heavy: Python code with its docstrings and comments; "
    "pydoc_data/topics.py among them holds the reference docs"
)
SNIFF_BYTES = 65536  # the bytes an encoding is decided on
BINARY_BYTES = 8192  # a NUL byte in these makes a file binary (ripgrep's and git's rule)
SKIPPED_DIRS = {"CVS", "__pycache__", "node_modules"}  # besides every hidden (dot) folder
COMPRESSIONS = {  # magic bytes -> name; bzip2's magic includes its block header so that text starting
    b"\x1f\x8b": "gzip",  # "BZh" is not taken for it
    b"\x28\xb5\x2f\xfd": "zstd",
    b"\xfd7zXZ\x00": "xz",
}
TABLE_FORMATS = ("parquet", "arrow")
LINE_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv"}
EXTRAS = {"zstd": ("zstandard", "trainwise[zstd]"), "parquet": ("pyarrow", "trainwise[parquet]"),
          "arrow": ("pyarrow", "trainwise[parquet]")}


@dataclass(frozen=True)
class SourceFile:
    """One file of the corpus and how it is read."""

    path: Path
    format: str  # "text" (one document), "jsonl", "csv", "tsv" (one per line/row), "parquet", "arrow"
    compression: str = ""  # "", "gzip", "zstd", "xz", "bz2"
    encoding: str = ""  # the codec text is decoded with ("" for parquet/arrow)
    decided_by: str = ""  # "bom", "utf-8", "detected", "forced", "" (tables)
    size: int = 0  # bytes on disk

    def describe(self) -> str:
        parts = [self.format] + [p for p in (self.compression, self.encoding) if p]
        return f"{self.path} ({', '.join(parts)})"


@dataclass
class Corpus:
    """What discovery found: the files to read and what it left out."""

    files: list[SourceFile]
    binary: list[tuple[Path, int]] = field(default_factory=list)  # skipped: (path, bytes)
    duplicates: list[Path] = field(default_factory=list)  # reached again through a link or a second path
    broken: list[Path] = field(default_factory=list)  # dangling links, unreadable files
    notes: list[str] = field(default_factory=list)  # e.g. which split of a datasets folder was read

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def encodings(self) -> dict[str, dict[str, int]]:
        """{codec: {"files": n, "bytes": on-disk bytes}} over the text-like files."""
        out: dict[str, dict[str, int]] = {}
        for f in self.files:
            if f.encoding:
                entry = out.setdefault(f.encoding, {"files": 0, "bytes": 0})
                entry["files"] += 1
                entry["bytes"] += f.size
        return out

    def report(self) -> dict:
        """The discovery part of the data report (JSON-ready, bytes in bytes)."""
        return {
            "files": len(self.files),
            "bytes": self.bytes,
            "formats": dict(Counter(f.format + (f"+{f.compression}" if f.compression else "") for f in self.files)),
            "encodings": self.encodings(),
            "binary_skipped": {"files": len(self.binary), "bytes": sum(n for _, n in self.binary),
                               "examples": [str(p) for p, _ in self.binary[:5]]},
            "duplicates_skipped": {"files": len(self.duplicates), "examples": [str(p) for p in self.duplicates[:5]]},
            "unreadable_skipped": {"files": len(self.broken), "examples": [str(p) for p in self.broken[:5]]},
            "notes": list(self.notes),
        }

    def key(self) -> str:
        """Text that changes when any file or any decoding decision changes (for cache keys)."""
        lines = []
        for f in self.files:
            st = f.path.stat()
            lines.append(f"{f.path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{f.format}\0{f.compression}\0{f.encoding}")
        return "\n".join(lines)


def default_corpus(data_cfg: DataConfig) -> bool:
    """Whether data_cfg reads the default built-in corpus: no paths (and no mixture), or builtin:docs alone."""
    return not data_cfg.sources and data_cfg.paths in ([], [DOCS_CORPUS])


def discover(data_cfg: DataConfig) -> Corpus:
    """The corpus data_cfg.paths name, in the order given (each folder and glob sorted), each file once."""
    return _Discovery(data_cfg).run()


def discover_files(paths: list[str], **data_keys) -> list[Path]:
    """The paths of the files `discover` reads (a convenience for callers that need only the names)."""
    return [f.path for f in discover(DataConfig(paths=list(paths), **data_keys)).files]


class _Discovery:
    def __init__(self, data_cfg: DataConfig):
        self.cfg = data_cfg
        self.corpus = Corpus(files=[])
        self.seen_files: set[tuple[int, int]] = set()

    def run(self) -> Corpus:
        for raw in self.cfg.paths:
            path = Path(raw).expanduser()
            if raw.startswith("builtin:"):
                self._builtin(raw)
            elif path.is_dir():
                self._folder(path, raw)
            elif path.is_file():
                self._named_file(path, raw)
            elif any(c in raw for c in "*?["):
                self._glob(raw)
            elif path.is_symlink():
                raise TrainwiseError(f"data path '{raw}' is a link to something that does not exist; fix the link.")
            else:
                raise TrainwiseError(
                    f"data path '{raw}' does not exist; pass existing files, folders or globs "
                    "(e.g. --data 'books/**/*.txt'), or no path for the built-in corpus."
                )
        if not self.corpus.files:
            self._refuse_empty()
        return self.corpus

    def _builtin(self, raw: str) -> None:
        if raw == DOCS_CORPUS:
            raise TrainwiseError(
                f"data path '{DOCS_CORPUS}' (the default corpus) stands alone: give it as the only path, or mix it "
                "with files through [[data.sources]] tables.")
        if raw != STDLIB_CORPUS:
            raise TrainwiseError(
                f"data path '{raw}' names no built-in corpus; there are '{DOCS_CORPUS}' (the default: CPython's "
                f"reference docs, ~0.6 MB) and '{STDLIB_CORPUS}' (the standard library's source, ~12 MB).")
        for path in stdlib_files():
            if self._wanted(path.relative_to(stdlib_root())):
                self._maybe(path)

    def _named_file(self, path: Path, raw: str) -> None:
        sniffed = self._sniff(path)
        if sniffed is None:
            raise TrainwiseError(
                f"'{raw}' is a binary file, not text (its first bytes hold NUL bytes or do not decode in any "
                "text encoding). Remove it from the data paths; to train on a folder that holds binaries "
                "among text files, pass the folder: its binaries are skipped."
            )
        self._add(sniffed)

    def _folder(self, root: Path, raw: str) -> None:
        if self._datasets_folder(root):
            return
        seen_dirs: set[tuple[int, int]] = set()
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            here = Path(dirpath)
            st = here.stat()
            if (st.st_dev, st.st_ino) in seen_dirs:  # a link back up the tree, or a second way in
                dirnames[:] = []
                continue
            seen_dirs.add((st.st_dev, st.st_ino))
            kept = []
            for name in sorted(dirnames):
                if _hidden(name):
                    continue
                if self._datasets_folder(here / name):
                    continue
                kept.append(name)
            dirnames[:] = kept
            for name in sorted(filenames):
                if _hidden(name):
                    continue
                path = here / name
                if self._wanted(path.relative_to(root)):
                    self._maybe(path)

    def _glob(self, raw: str) -> None:
        before = len(self.corpus.files)
        for match in sorted(glob.glob(os.path.expanduser(raw), recursive=True)):
            path = Path(match)
            if path.is_dir():
                self._folder(path, match)
            elif path.is_file():
                self._maybe(path)
        if len(self.corpus.files) == before and not self.corpus.binary:
            raise TrainwiseError(
                f"glob '{raw}' matches no files; check the pattern (use ** for subfolders, and quote it so "
                "the shell does not expand it)."
            )

    def _wanted(self, rel: Path) -> bool:
        text = rel.as_posix()

        def hit(pattern: str) -> bool:
            return fnmatch.fnmatch(text, pattern) or ("/" not in pattern and fnmatch.fnmatch(rel.name, pattern))

        if self.cfg.include and not any(hit(p) for p in self.cfg.include):
            return False
        return not any(hit(p) for p in self.cfg.exclude)

    def _maybe(self, path: Path) -> None:
        """A file found in a folder or glob: skipped (and counted) when binary or unreadable."""
        try:
            if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or device would block or never end
                raise OSError(f"{path} is not a regular file")
            sniffed = self._sniff(path)
        except OSError:
            self.corpus.broken.append(path)
            return
        if sniffed is None:
            self.corpus.binary.append((path, path.stat().st_size))
        elif sniffed is not _DUPLICATE:
            self._add(sniffed)

    def _add(self, sf: SourceFile | object) -> None:
        if isinstance(sf, SourceFile):
            self.corpus.files.append(sf)

    def _sniff(self, path: Path) -> SourceFile | object | None:
        st = path.stat()
        if (st.st_dev, st.st_ino) in self.seen_files:
            self.corpus.duplicates.append(path)
            return _DUPLICATE
        self.seen_files.add((st.st_dev, st.st_ino))
        return sniff(path, self.cfg.encoding, st.st_size)

    def _datasets_folder(self, folder: Path) -> bool:
        """A folder written by `datasets` save_to_disk (one split, or a DatasetDict of splits)."""
        if (folder / "dataset_dict.json").is_file():
            splits = _read_json(folder / "dataset_dict.json").get("splits", [])
            chosen = ["train"] if "train" in splits else splits
            self.corpus.notes.append(f"{folder}: a datasets DatasetDict; read split(s) {', '.join(chosen)} "
                                     f"of {', '.join(splits)}")
            for split in chosen:
                self._datasets_folder(folder / split)
            return True
        state = folder / "state.json"
        if not (state.is_file() and (folder / "dataset_info.json").is_file()):
            return False
        for entry in _read_json(state).get("_data_files", []):
            path = folder / entry["filename"]
            st = path.stat()
            if (st.st_dev, st.st_ino) not in self.seen_files:
                self.seen_files.add((st.st_dev, st.st_ino))
                self._add(SourceFile(path, "arrow", size=st.st_size))
        return True

    def _refuse_empty(self) -> None:
        binary = self.corpus.binary
        if binary:
            names = (", ".join(f"'{p}'" for p, _ in binary[:3])
                     + (f" and {len(binary) - 3} more" if len(binary) > 3 else ""))
            raise TrainwiseError(
                f"the data paths hold no text: all {len(binary)} file(s) found are binary ({names}). Point "
                "data.paths at text (plain text in any encoding, .jsonl, .csv/.tsv, Parquet, Arrow, a "
                "datasets folder, or these compressed with gzip/zstd/xz/bzip2)."
            )
        shown = ", ".join(f"'{p}'" for p in self.cfg.paths[:3])
        filters = " after the include/exclude globs" if self.cfg.include or self.cfg.exclude else ""
        raise TrainwiseError(
            f"the data paths {shown} hold no readable files{filters} (hidden files and folders are skipped). "
            "Point data.paths at folders or files with text, or loosen data.include / data.exclude."
        )


_DUPLICATE = object()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The .py files of the builtin:stdlib corpus, ordered by a hash of their path in the library: a fixed
    shuffle, so that the validation split (the token stream's last share) is a sample of the whole
    library, not its alphabetically last packages (urllib ... zoneinfo, in sorted order)."""
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _hidden(d) and d not in STDLIB_SKIPPED_DIRS
                       and not d.startswith(STDLIB_SKIPPED_PREFIXES)]
        found += [Path(dirpath) / name for name in filenames
                  if name.endswith(".py") and not _hidden(name) and not name.startswith(STDLIB_SKIPPED_PREFIXES)]
    return sorted(found, key=lambda path: hashlib.sha256(path.relative_to(root).as_posix().encode()).hexdigest())


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise TrainwiseError(f"'{path}' of a datasets folder is not readable JSON ({err}); save the dataset "
                             "again with save_to_disk, or point data.paths at its .arrow files.") from None


def _hidden(name: str) -> bool:
    return name.startswith(".") or name in SKIPPED_DIRS


# ---------------------------------------------------------------------------------------------------
# Sniffing one file


def sniff(path: Path, encoding: str = "auto", size: int | None = None) -> SourceFile | None:
    """How to read `path`, decided from its bytes; None when it is binary."""
    size = path.stat().st_size if size is None else size
    with open(path, "rb") as f:
        magic = f.read(8)
    if magic.startswith(b"PAR1"):
        return SourceFile(path, "parquet", size=size)
    if magic.startswith(b"ARROW1") or (magic.startswith(b"\xff\xff\xff\xff") and path.suffix.lower() == ".arrow"):
        return SourceFile(path, "arrow", size=size)
    compression = _compression(magic)
    name = path.name.lower()
    if compression:
        name = name.rsplit(".", 1)[0] if "." in name else name  # notes.jsonl.gz -> notes.jsonl
    fmt = LINE_FORMATS.get(os.path.splitext(name)[1], "text")
    with open_binary(path, compression) as stream:
        head = _read_up_to(stream, SNIFF_BYTES)
    decided = decide_encoding(head, at_end=len(head) < SNIFF_BYTES, forced=encoding)
    if decided is None:
        return None
    return SourceFile(path, fmt, compression, decided[0], decided[1], size)


def _compression(magic: bytes) -> str:
    for prefix, name in COMPRESSIONS.items():
        if magic.startswith(prefix):
            return name
    # bzip2: "BZh", the block size digit, then a block's or the end's magic number
    if magic[:3] == b"BZh" and magic[3:4].isdigit() and magic[4:8] in (b"1AY&", b"\x17rE8"):
        return "bz2"
    return ""


def _read_up_to(stream: BinaryIO, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def decide_encoding(head: bytes, at_end: bool, forced: str = "auto") -> tuple[str, str] | None:
    """(codec, how it was decided) for text whose first bytes are `head`; None for binary.

    A BOM decides; then a forced codec; then NUL bytes mean binary; then UTF-8 when the bytes are
    UTF-8 (a few stray invalid bytes among many valid multi-byte characters still count as UTF-8: they
    are replaced and counted when read); else charset-normalizer's best guess, None if it has none."""
    for bom, codec in ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
                       (codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"),
                       (codecs.BOM_UTF16_BE, "utf-16")):
        if head.startswith(bom):
            return codec, "bom"
    if b"\x00" in head[:BINARY_BYTES]:
        return None
    if forced != "auto":
        return codecs.lookup(forced).name, "forced"
    if not head or _mostly_utf8(head, at_end):
        return "utf-8", "utf-8"
    guess = _detect(head)
    if guess is None:
        return None
    return guess, "detected"


def _mostly_utf8(head: bytes, at_end: bool) -> bool:
    text = head.decode("utf-8", "surrogateescape")
    bad = sum(1 for ch in text if "\udc80" <= ch <= "\udcff")
    if not at_end:  # the sample may end inside a character: its last 1-3 bytes do not count
        tail = text[-3:]
        bad -= sum(1 for ch in tail if "\udc80" <= ch <= "\udcff")
    if bad == 0:
        return True
    multibyte = sum(1 for ch in text if ord(ch) > 0x7F and not "\udc80" <= ch <= "\udcff")
    return multibyte >= 20 * bad  # UTF-8 with a few damaged bytes, not a legacy encoding


def _detect(head: bytes) -> str | None:
    """charset-normalizer's best match for non-UTF-8 bytes. Single-byte code pages are ambiguous (French
    in cp1252 scores as well in cp1257, where è reads č): when cp1252, by far the most common of them
    (WHATWG's default for legacy Western text), decodes within 0.1 of the best chaos score, it is taken.
    Text that only cp1250 or another code page reads well (Czech, Polish) keeps its match."""
    import charset_normalizer

    matches = charset_normalizer.from_bytes(head)
    best = matches.best()
    if best is None:
        return None
    chosen = best.encoding
    if not _multibyte(chosen):
        for m in matches:
            if "cp1252" in (m.encoding, *m.could_be_from_charset) and m.chaos <= best.chaos + 0.1:
                chosen = "cp1252"
    text = head.decode(chosen, "replace")
    controls = sum(1 for ch in text if ord(ch) < 32 and ch not in "\t\n\r\f\v\x1b")
    if controls > 0.05 * max(len(text), 1):  # decodes, but as control characters: binary
        return None
    return codecs.lookup(chosen).name


def _multibyte(codec: str) -> bool:
    """A single-byte code page decodes each of the 128 high bytes into one character."""
    return len(bytes(range(128, 256)).decode(codec, "replace")) != 128


# ---------------------------------------------------------------------------------------------------
# Opening


def open_binary(path: Path, compression: str = "") -> BinaryIO:
    """The file's bytes, decompressed as a stream (never whole in memory)."""
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "bz2":
        return bz2.open(path, "rb")
    if compression == "xz":
        return lzma.open(path, "rb")
    if compression == "zstd":
        zstandard = require("zstd", path)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def require(what: str, path: Path):
    """Import the optional package that reads `what`, or say which `pip install` brings it."""
    module, extra = EXTRAS[what]
    try:
        return __import__(module)
    except ImportError:
        raise TrainwiseError(
            f"reading '{path}' ({what}) needs {module}, which is not installed: "
            f"`pip install {module}` (or `pip install '{extra}'`), or convert the file to plain text or .jsonl."
        ) from None
