"""The PLY container: header parsing, element data (memory-mapped when binary) and atomic output files."""
from __future__ import annotations

import itertools
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.leftovers import remove_leftovers

MAX_HEADER_BYTES = 1 << 20  # a header is a few kB; more means this is not a PLY

_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1",
    "short": "i2", "int16": "i2", "ushort": "u2", "uint16": "u2",
    "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}  # fmt: skip
_FORMATS = {"ascii": "=", "binary_little_endian": "<", "binary_big_endian": ">"}


class PlyWarning(UserWarning):
    """A PLY file that is read, but not all of it (more rows than its header declares)."""


class PlyError(ValueError):
    """A PLY file that cannot be read as asked; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class PlyElement:
    name: str
    count: int
    properties: tuple[tuple[str, str], ...]  # (name, numpy type code) of scalar properties
    has_lists: bool  # a list property: rows have no fixed size

    def dtype(self, byte_order: str) -> np.dtype:
        return np.dtype([(name, byte_order + code) for name, code in self.properties])

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.properties)


@dataclass(frozen=True)
class PlyHeader:
    path: Path
    format: str  # "ascii", "binary_little_endian" or "binary_big_endian"
    elements: tuple[PlyElement, ...]
    data_offset: int  # bytes before the body

    def element(self, name: str) -> PlyElement | None:
        return next((e for e in self.elements if e.name == name), None)


def read_header(path: str | os.PathLike) -> PlyHeader:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(MAX_HEADER_BYTES)
    except OSError as e:
        raise PlyError(path, f"cannot read ({e.strerror or e})") from None
    if not head.startswith(b"ply"):
        raise PlyError(path, "not a PLY file (it does not start with 'ply')")
    end = head.find(b"end_header")
    if end < 0:
        raise PlyError(path, "PLY header has no 'end_header' line (truncated or not a PLY)")
    line_end = head.find(b"\n", end)
    if line_end < 0:
        raise PlyError(path, "PLY file ends right after its header")
    lines = head[:end].decode("ascii", errors="replace").splitlines()[1:]
    fmt, elements = None, []
    for number, line in enumerate(lines, start=2):
        words = line.split()
        if not words or words[0] in ("comment", "obj_info"):
            continue
        try:
            if words[0] == "format":
                if words[1] not in _FORMATS:
                    raise ValueError(f"unknown format {words[1]!r}")
                fmt = words[1]
            elif words[0] == "element":
                elements.append(PlyElement(words[1], _count(words[2]), (), False))
            elif words[0] == "property":
                if not elements:
                    raise ValueError("property before any element")
                e = elements[-1]
                if words[1] == "list":
                    _type_code(words[2]), _type_code(words[3])
                    elements[-1] = PlyElement(e.name, e.count, e.properties, True)
                else:
                    if words[2] in e.names:
                        raise ValueError(f"property {words[2]!r} is declared twice in element '{e.name}'")
                    prop = (words[2], _type_code(words[1]))
                    elements[-1] = PlyElement(e.name, e.count, e.properties + (prop,), e.has_lists)
            else:
                raise ValueError(f"unknown keyword {words[0]!r}")
        except (IndexError, ValueError) as err:
            detail = err if isinstance(err, ValueError) else "too few words"
            raise PlyError(path, f"header line {number} {line.strip()!r}: {detail}") from None
    if fmt is None:
        raise PlyError(path, "PLY header has no 'format' line")
    header = PlyHeader(path, fmt, tuple(elements), line_end + 1)
    if fmt != "ascii" and not any(e.has_lists for e in elements):
        end = header.data_offset + sum(e.count * e.dtype("<").itemsize for e in elements)
        extra = path.stat().st_size - end
        if extra > 0:
            _warn_unread(path, f"{extra} bytes after the rows its header declares")
    return header


def _warn_unread(path: Path, what: str) -> None:
    # stacklevel: the tool that opened the file, not this module
    warnings.warn(f"{path}: the file holds {what}; they are ignored (is the header's element count "
                  "too small?)", PlyWarning, stacklevel=4)


def _count(text: str) -> int:
    count = int(text)
    if count < 0:
        raise ValueError("negative element count")
    return count


def _type_code(name: str) -> str:
    if name not in _TYPES:
        raise ValueError(f"unknown property type {name!r}")
    return _TYPES[name]


def element_data(header: PlyHeader, name: str) -> np.ndarray:
    """Rows of one element as a structured array: memory-mapped for binary files, parsed for ASCII."""
    path = header.path
    target = header.element(name)
    if target is None:
        raise PlyError(path, f"no '{name}' element in the PLY header")
    if target.has_lists:
        raise PlyError(path, f"element '{name}' has list properties, which are not supported")
    if header.format == "ascii":
        return _ascii_rows(header, target)
    order = _FORMATS[header.format]
    offset = header.data_offset
    for e in header.elements:
        if e is target:
            break
        if e.has_lists:
            raise PlyError(path, f"element '{e.name}' with list properties precedes '{name}'; not supported")
        offset += e.count * e.dtype(order).itemsize
    dtype = target.dtype(order)
    need = offset + target.count * dtype.itemsize
    size = path.stat().st_size
    if size < need:
        problem = f"element '{name}' needs {need - offset} bytes of data, the file ends {need - size} bytes early"
        raise PlyError(path, f"truncated: {problem}")
    if target.count == 0 or dtype.itemsize == 0:
        return np.zeros(target.count, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(target.count,))


def _ascii_rows(header: PlyHeader, target: PlyElement) -> np.ndarray:
    skip = sum(e.count for e in header.elements[: header.elements.index(target)])
    last = target is header.elements[-1]
    with open(header.path, "rb") as f:
        f.seek(header.data_offset)
        # Stops at the end of the file, whatever the header declares (a count of 10^12 is one line).
        lines = [line for line in itertools.islice(f, min(skip + target.count, sys.maxsize)) if line.strip()]
        extra = sum(1 for line in f if line.strip()) if last else 0
    lines = lines[skip:]
    if len(lines) < target.count:
        raise PlyError(header.path, f"truncated: element '{target.name}' has {len(lines)} of {target.count} rows")
    if extra:
        _warn_unread(header.path, f"{extra} more rows after the {target.count} its header declares")
    width = len(target.properties)
    try:
        values = np.loadtxt(lines, dtype=np.float64, ndmin=2).reshape(target.count, -1)
    except ValueError as e:
        raise PlyError(header.path, f"element '{target.name}': unreadable ASCII rows ({e})") from None
    if values.shape[1] != width:
        raise PlyError(header.path, f"element '{target.name}': rows of {values.shape[1]} values, expected {width}")
    rows = np.zeros(target.count, dtype=target.dtype("="))
    for j, name in enumerate(target.names):
        rows[name] = values[:, j]
    return rows


def columns(rows: np.ndarray, names: list[str] | tuple[str, ...], dtype: type = np.float32) -> np.ndarray:
    """[n, len(names)] array of the named fields (exact for fields already of `dtype`)."""
    out = np.empty((len(rows), len(names)), dtype=dtype)
    for j, name in enumerate(names):
        out[:, j] = rows[name]
    return out


class AtomicFile:
    """A file written under a temporary name and renamed into place only when complete."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        if not self.path.parent.is_dir():  # else open() names the temp file, which the user never chose
            raise PlyError(self.path, f"cannot write: folder {self.path.parent} does not exist")
        remove_leftovers(self.path.parent, self.path.name, ".tmp-", "unfinished file")
        self.file = open(self.tmp, "wb")

    def commit(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class RowWriter:
    """What both PLY writers share: a known row count, checked on close, and an AtomicFile that
    appears at its path only when every announced row was written."""

    count: int
    written: int
    _out: AtomicFile

    def _finish(self) -> None:
        """Write whatever the subclass still holds back (default: nothing)."""

    def close(self) -> None:
        self._finish()
        if self.written != self.count:
            self._out.abort()
            raise ValueError(f"writing {self._out.path}: {self.written} rows written, the header announced {self.count}")
        self._out.commit()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._out.abort()
