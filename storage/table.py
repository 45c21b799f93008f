"""The block table of a generation: which version of each block is current, with its count and boxes.

A commit document is a zarr group document (`commits/<G>/zarr.json`) whose attributes hold the
table and the training state, so plain zarr can read it and one atomic PUT writes it.
Everything read here may come from a hostile store, so every field is checked.
"""
from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from octree.bounds import Box
from octree.keys import MAX_DEPTH, BlockKeyError, parse_key
from storage.backend import group_doc
from storage.errors import CommitStateError, StoreCorruptError, StoreError, StoreKeyError

MAX_COUNT = 2**31 - 1  # rows of one block; int32 row ids elsewhere in the project
# Tables of more blocks are stored as columns: at 10^9 Gaussians (~30k blocks) the list of
# entries took 17 MB and ~2.5 s to write and as long to read, on every rank at every commit.
COMPACT_ABOVE = 1024


@dataclass(frozen=True)
class BlockInfo:
    """One entry of the block table."""

    key: str  # octree cell name, "<depth>-<hex code>"
    version: int  # generation in which this data was written: blocks/<key>/<version>/
    count: int  # Gaussians (rows) in the block, > 0
    cell: Box  # the octree cell: owns the Gaussians whose means fall inside it
    tight: Box  # tight box of the means
    extent: Box  # means +- 3 sigma of the largest scale: what a camera can see of the block

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "version": self.version,
            "count": self.count,
            "cell": list(self.cell),
            "tight": list(self.tight),
            "extent": list(self.extent),
        }

    @classmethod
    def from_json(cls, doc: Any, where: str = "") -> "BlockInfo":
        """Parse and validate one entry; where names the store and commit for error messages."""
        if not isinstance(doc, Mapping):
            raise StoreCorruptError(f"{where}: block entry is not an object: {doc!r:.80}")
        key = doc.get("key")
        check_key(key, where)
        at = f"{where}, block {key}"
        return cls(
            key=key,
            version=_int_field(doc, "version", 0, MAX_COUNT, at),
            count=_int_field(doc, "count", 1, MAX_COUNT, at),
            cell=parse_box(doc.get("cell"), f"{at}: cell box"),
            tight=parse_box(doc.get("tight"), f"{at}: tight box"),
            extent=parse_box(doc.get("extent"), f"{at}: extent box"),
        )


def check_key(key: Any, where: str) -> None:
    """A block key must parse: it becomes a path in the store, so this is the guard against traversal."""
    try:
        parse_key(key)
    except BlockKeyError as e:
        raise StoreKeyError(f"{where}: {e}") from e


def parse_box(value: Any, what: str, error: type[StoreError] = StoreCorruptError) -> Box:
    """Six finite numbers with lo <= hi on every axis; raises `error` (a corrupt store by default)."""
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) != 6:
        raise error(f"{what} is not a sequence of 6 numbers: {value!r:.80}")
    if not all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and _finite(v) for v in value):
        raise error(f"{what} holds a non-finite or non-numeric value: {value!r:.80}")
    box = tuple(float(v) for v in value)
    if any(box[i] > box[i + 3] for i in range(3)):
        raise error(f"{what} has lo > hi: {box}")
    return box  # type: ignore[return-value]


def _finite(v: int | float | np.number) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer too large for a float (JSON allows any number of digits)
        return False


def _int_field(doc: Mapping[str, Any], name: str, lo: int, hi: int, where: str) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise StoreCorruptError(f"{where}: {name} {value!r:.40} is not an integer in [{lo}, {hi}]")
    return value


@dataclass(frozen=True)
class Commit:
    """A committed generation: its block table and the training state saved with it."""

    generation: int
    table: dict[str, BlockInfo]
    state: dict[str, Any]

    def to_doc(self) -> dict[str, Any]:
        """The zarr group document that stores this commit: the table as a list of entries, or
        above `COMPACT_ABOVE` blocks as columns (`encode_columns`)."""
        if len(self.table) > COMPACT_ABOVE:
            return group_doc({"generation": self.generation, "columns": encode_columns(self.table), "state": self.state})
        blocks = [self.table[k].to_json() for k in sorted(self.table, key=lambda k: parse_key(k).morton_rank())]
        attrs = {"generation": self.generation, "blocks": blocks, "state": self.state}
        return group_doc(attrs)

    @classmethod
    def from_doc(cls, doc: Any, generation: int, where: str) -> "Commit":
        """Parse and validate the document of commit `generation`; where names the store."""
        at = f"{where}, commit {generation}"
        attrs = doc.get("attributes") if isinstance(doc, Mapping) else None
        if not isinstance(attrs, Mapping):
            raise StoreCorruptError(f"{at}: commit document has no attributes")
        if attrs.get("generation") != generation:
            raise StoreCorruptError(f"{at}: document names generation {attrs.get('generation')!r:.40}")
        state = attrs.get("state")
        if "columns" in attrs and "blocks" not in attrs and isinstance(state, Mapping):
            return cls(generation, decode_columns(attrs["columns"], generation, at), dict(state))
        blocks = attrs.get("blocks")
        if not isinstance(blocks, list) or not isinstance(state, Mapping):
            raise StoreCorruptError(f"{at}: 'blocks' must be a list and 'state' an object")
        table: dict[str, BlockInfo] = {}
        for entry in blocks:
            info = BlockInfo.from_json(entry, at)
            if info.key in table:
                raise StoreCorruptError(f"{at}, block {info.key}: listed twice")
            if info.version > generation:
                raise StoreCorruptError(f"{at}, block {info.key}: version {info.version} is newer than the commit")
            table[info.key] = info
        return cls(generation, table, dict(state))


def check_state(state: Any) -> dict[str, Any]:
    """The training state must survive a JSON round trip unchanged (no NaN, no numpy scalars)."""
    if not isinstance(state, Mapping):
        raise CommitStateError(f"commit state must be a dict, got {type(state).__name__}")
    try:
        return json.loads(json.dumps(dict(state), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise CommitStateError(f"commit state is not plain JSON: {e}") from e


# The columns of a compact table: name -> (dtype on disk, values per block). Little-endian
# binary in base64 inside the JSON document, so the commit stays one zarr group document (one
# atomic write, attributes plain zarr reads) while a block costs 161 bytes instead of ~570,
# and reading it is a few vectorised checks instead of a parse per entry.
_COLUMNS = {"depth": ("<u1", 1), "code": ("<u8", 1), "version": ("<i4", 1), "count": ("<i4", 1),
            "boxes": ("<f8", 18)}  # boxes: cell, tight, extent


def encode_columns(table: Mapping[str, BlockInfo]) -> dict[str, Any]:
    """The table as base64 columns, blocks in Morton order."""
    keys = list(table)
    split = [k.split("-") for k in keys]  # keys in a table were parsed on their way in
    depth = np.array([int(d) for d, _ in split], dtype=np.int64)
    code = np.array([int(c, 16) for _, c in split], dtype=np.uint64)
    order = np.argsort(code << (3 * (MAX_DEPTH - depth)).astype(np.uint64), kind="stable")
    infos = [table[keys[i]] for i in order]
    cols = {
        "depth": depth[order],
        "code": code[order],
        "version": np.array([i.version for i in infos], dtype=np.int64),
        "count": np.array([i.count for i in infos], dtype=np.int64),
        "boxes": np.array([(*i.cell, *i.tight, *i.extent) for i in infos], dtype=np.float64).reshape(-1, 18),
    }
    doc: dict[str, Any] = {"n": len(infos)}
    for name, (dtype, _) in _COLUMNS.items():
        doc[name] = base64.b64encode(np.ascontiguousarray(cols[name], dtype=dtype).tobytes()).decode("ascii")
    return doc


def decode_columns(doc: Any, generation: int, where: str) -> dict[str, BlockInfo]:
    """Parse and validate a compact table (hostile input: every column is checked)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("n"), int) or isinstance(doc.get("n"), bool) or doc["n"] < 0:
        raise StoreCorruptError(f"{where}: compact table has no block count 'n'")
    n = doc["n"]
    cols: dict[str, np.ndarray] = {}
    for name, (dtype, width) in _COLUMNS.items():
        text = doc.get(name)
        try:
            raw = base64.b64decode(text, validate=True) if isinstance(text, str) else None
        except ValueError:
            raw = None
        if raw is None or len(raw) != n * width * np.dtype(dtype).itemsize:
            raise StoreCorruptError(f"{where}: compact table column {name!r} is not {n} x {width} {dtype} in base64")
        cols[name] = np.frombuffer(raw, dtype=dtype).reshape(n, width) if width > 1 else np.frombuffer(raw, dtype=dtype)
    depth, code = cols["depth"].astype(np.int64), cols["code"]
    bad = depth > MAX_DEPTH
    bad |= code >= (np.uint64(8) ** np.minimum(depth, MAX_DEPTH).astype(np.uint64))
    names = [f"{d}-{c:x}" for d, c in zip(depth.tolist(), code.tolist())]
    _check_column(bad, names, where, "key outside its depth's octree cells", StoreKeyError)
    version, count, boxes = cols["version"], cols["count"], cols["boxes"]
    _check_column((version < 0) | (version > generation), names, where, f"version is not in [0, {generation}]")
    _check_column((count < 1) | (count > MAX_COUNT), names, where, f"count is not in [1, {MAX_COUNT}]")
    lo, hi = boxes.reshape(n, 3, 2, 3)[:, :, 0], boxes.reshape(n, 3, 2, 3)[:, :, 1]
    _check_column(~np.isfinite(boxes).all(axis=1) | (lo > hi).any(axis=(1, 2)), names, where,
                  "a box is non-finite or has lo > hi")
    if len(set(names)) != n:
        seen: set[str] = set()
        twice = next(k for k in names if k in seen or seen.add(k))
        raise StoreCorruptError(f"{where}, block {twice}: listed twice")
    b = boxes.tolist()
    return {k: BlockInfo(k, v, c, tuple(x[0:6]), tuple(x[6:12]), tuple(x[12:18]))
            for k, v, c, x in zip(names, version.tolist(), count.tolist(), b)}


def _check_column(bad: np.ndarray, names: list[str], where: str, what: str,
                  error: type[StoreError] = StoreCorruptError) -> None:
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise error(f"{where}, block {names[i] if i < len(names) else i}: {what}")
