"""The block table of a generation: which version of each block is current, with its count and boxes.

A commit document is a zarr group document (`commits/<G>/zarr.json`) whose attributes hold the
table and the training state, so plain zarr can read it and one atomic PUT writes it.
Everything read here may come from a hostile store, so every field is checked.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from octree.bounds import Box
from octree.keys import BlockKeyError, parse_key
from storage.backend import group_doc
from storage.errors import CommitStateError, StoreCorruptError, StoreError, StoreKeyError

MAX_COUNT = 2**31 - 1  # rows of one block; int32 row ids elsewhere in the project


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
    if not all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        raise error(f"{what} holds a non-finite or non-numeric value: {value!r:.80}")
    box = tuple(float(v) for v in value)
    if any(box[i] > box[i + 3] for i in range(3)):
        raise error(f"{what} has lo > hi: {box}")
    return box  # type: ignore[return-value]


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
        """The zarr group document that stores this commit."""
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
        blocks, state = attrs.get("blocks"), attrs.get("state")
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
