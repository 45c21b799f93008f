"""Reading files with errors that name them, and writing files so no reader ever sees half of one."""
from __future__ import annotations

import os
import threading
from pathlib import Path

from train.data.errors import DatasetError


def inside(folder: Path, name: str) -> bool:
    """Whether `folder / name` stays inside `folder` as written (no absolute path, no climbing out
    with '..'). Lexical, not resolved: a dataset may keep its images behind a symlink."""
    return os.path.normpath(folder / name).startswith(os.path.join(os.path.normpath(folder), ""))


def read_bytes(path: Path, error: type[DatasetError]) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise error(path, f"cannot read: {e.strerror or e}") from None


def read_text(path: Path, error: type[DatasetError]) -> str:
    try:
        return read_bytes(path, error).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(path, f"not UTF-8 text (byte {e.start}); is it a binary file?") from None


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to a unique temporary name beside `path`, then rename it into place.

    Several threads or processes may write the same path at once (ranks filling one image cache):
    each rename is atomic, so the file is always one whole copy.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
