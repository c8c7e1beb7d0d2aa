"""Files written whole or not at all. Each is written to a hidden temporary file beside its target, which
then takes the target's name in one rename: a reader, or a run resumed after a kill, finds the old file or
the new one, never half of one. (Checkpoints, a directory of files, are made the same way one level up, in
runtime/checkpoint.py, with every file fsync'ed.)"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` (this process's own) for the block to write; it takes `path`'s name
    when the block ends, and is removed if the block raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if str(tmp) not in (err.filename, err.filename2):
            raise
        raise type(err)(err.errno, err.strerror, str(path)) from None  # the user's path, not our temporary one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write text (UTF-8) or bytes to `path` whole or not at all."""
    with replacing(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")


def write_json_atomic(path: str | Path, data, indent: int | None = 1) -> None:
    """Write `data` as JSON to `path` whole or not at all."""
    write_atomic(path, json.dumps(data, indent=indent))


def not_a_file(path: Path) -> str:
    """Why `path` cannot be read as a file, for an error message: a folder has its name, or nothing does."""
    return "is a folder, not a file" if path.is_dir() else "does not exist"
